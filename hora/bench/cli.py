"""``hora bench``: allreduce latency and bus bandwidth, hora side by side with its peers.

    hora bench                                  # full run: 4 B .. 256 MiB, N = 2 and 4
    hora bench --quick                          # smoke run: N = 2, 3 sizes, 1 round
    hora bench --np 2 --max-size 16M --systems hora gloo mpi --json /tmp/ar.json

Every system reduces the same float32 buffers with op Sum, in one run, each rank a separate
process:

- ``hora``: hora's NumPy API with its default data plane (``HORA_BACKEND=auto``: shared
  memory on one host); ``hora-<backend>`` forces one of ``hora.config.BACKENDS``
  (``hora-tcp``: the TCP ring); ``hora-torch``: a CPU tensor through ``hora.torch.allreduce``
  with one torch thread; all started by ``hora.runner.run``, except ``hora-mpi``, whose
  ranks must be MPI's: ``mpiexec`` starts them;
- ``gloo``: torch.distributed's gloo backend, ranks started by ``multiprocessing`` (spawn);
- ``mpi``: mpi4py's ``Allreduce`` under ``mpiexec`` (Open MPI);
- ``horovod``: ``horovod.torch.allreduce`` under ``horovodrun --gloo``, when importable.

A system that cannot run here is skipped with the reason.  Every (system, N) job is launched
``--launches`` times (3), the systems in turn, so that a slow spell of the machine hits one
launch of each rather than one system's whole row.  Per size, every rank checks one
allreduce of known inputs, warms up, and times ``--rounds`` rounds (see
:mod:`hora.bench.ranks`); a round's time is the slowest rank's per-iteration mean and the
reported time the median over the rounds of every launch.  Bandwidth as in nccl-tests:
algbw = bytes / time, busbw = algbw * 2(N-1)/N, GB = 1e9 B.  The run also measures the
machine's limits (:mod:`hora.bench.limits`), prints a Markdown table with t_peer / t_hora
ratios and hora's target ratios (:mod:`hora.bench.report`), writes JSON and draws a PNG.
The jobs themselves are :mod:`hora.bench.jobs`; this module is the command line, light to
import since ``hora`` builds its parser, with this command in it, on every start.
Exit status: 0 when every job ran and verified, 1 when one failed (its cells say FAILED),
2 on bad arguments.

Layer: bench, beside the runner: uses its Python API (``hora.runner.run``), and
hora.config's list of data planes; never hora.core.
"""
import argparse
import functools
import json
import os
import sys
import tempfile
import time

from ..config import BACKENDS, env_value

__all__ = ["main", "add_command", "add_arguments", "system_names", "parse_size"]

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
DEFAULT_SIZES = [4, 64, KiB, 16 * KiB, 256 * KiB, MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB]
QUICK_SIZES = [4, 16 * KiB, MiB]
OUT_DIR = os.path.join(tempfile.gettempdir(), "hora-bench")
DEFAULT_JSON = os.path.join(OUT_DIR, "allreduce.json")
DEFAULT_PNG = os.path.join(OUT_DIR, "allreduce.png")
PEERS = ("gloo", "mpi", "horovod")
JOB_TIMEOUT_S = 480.0       # one (system, N) job: a hang fails that job, not the run
# on one host these data planes are the default's (shared memory): not run unless asked for
SAME_AS_DEFAULT_ON_ONE_HOST = ("auto", "shm", "hierarchical")
_UNITS = {"": 1, "B": 1, "K": KiB, "KB": KiB, "KIB": KiB, "M": MiB, "MB": MiB, "MIB": MiB,
          "G": GiB, "GB": GiB, "GIB": GiB}


def system_names():
    """(every system ``--systems`` accepts, the default selection), in table order."""
    # nccl moves CUDA tensors; on the host buffers timed here it is auto
    planes = [f"hora-{b}" for b in BACKENDS if b not in ("auto", "nccl")]
    default = ["hora"] + [p for p in planes
                          if p[len("hora-"):] not in SAME_AS_DEFAULT_ON_ONE_HOST]
    return ["hora", *planes, "hora-torch", *PEERS], [*default, "hora-torch", *PEERS]


# -- command line ---------------------------------------------------------------------------------
def parse_size(text):
    """'4', '64B', '16K', '1MiB', '2G' -> bytes (binary units)."""
    t = text.strip().upper()
    digits = t.rstrip("BKMGI")
    unit = t[len(digits):]
    if not digits.isdigit() or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: expected e.g. 4, 64B, 16K, 1MiB")
    return int(digits) * _UNITS[unit]


def _size_list(text):
    return [parse_size(s) for s in text.replace(",", " ").split()]


def add_arguments(p):
    """``hora bench``'s options, on parser ``p``."""
    every, default = system_names()
    p.add_argument("--np", type=int, nargs="+", default=None, metavar="N",
                   help="numbers of ranks (default: 2 4; quick: 2)")
    p.add_argument("--systems", "--libs", dest="systems", nargs="+", default=default,
                   choices=every, metavar="SYSTEM",
                   help=f"systems to run, of {', '.join(every)} (default: {' '.join(default)}; "
                        "one that cannot run here is skipped with the reason)")
    p.add_argument("--sizes", type=_size_list, default=None,
                   help="message sizes, e.g. '4,1K,1M' (default: 4 B, 64 B, 1 KiB, 16 KiB, "
                        "256 KiB, 1 MiB, 4 MiB, 16 MiB, 64 MiB, 256 MiB)")
    p.add_argument("--max-size", type=parse_size, default=None, help="drop sizes above this")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: sizes 4 B, 16 KiB, 1 MiB; N = 2 unless --np says; "
                        "1 round; small limit tests")
    p.add_argument("--launches", type=int, default=None,
                   help="times every (system, N) job is launched, the systems in turn; their "
                        "rounds are pooled (default 3; quick 1)")
    p.add_argument("--rounds", type=int, default=None,
                   help="timed rounds per size in each launch (default 1; quick 1)")
    p.add_argument("--round-s", type=float, default=None,
                   help="target seconds per timed round (default 0.4; quick 0.05)")
    p.add_argument("--size-budget-s", type=float, default=12.0,
                   help="seconds the timed rounds of one size may take, over all launches: "
                        "beyond it, fewer iterations per round, then fewer rounds (default 12)")
    p.add_argument("--job-timeout-s", type=float, default=JOB_TIMEOUT_S,
                   help=f"limit for one (system, N) job (default {JOB_TIMEOUT_S:g})")
    p.add_argument("--no-limits", action="store_true",
                   help="skip the memcpy/add/shared-memory/TCP tests")
    p.add_argument("--json", default=DEFAULT_JSON, metavar="PATH",
                   help=f"write results here (default {DEFAULT_JSON})")
    p.add_argument("--plot", default=DEFAULT_PNG, metavar="PATH",
                   help=f"draw busbw vs size here, PNG (default {DEFAULT_PNG}; needs matplotlib)")
    p.add_argument("--no-plot", action="store_true", help="draw no plot")


def add_command(subparsers):
    """Register ``hora bench`` on the ``hora`` command's subparsers."""
    p = subparsers.add_parser(
        "bench", help="allreduce latency and bandwidth: hora side by side with its peers",
        description="Allreduce (float32, Sum) latency and bus bandwidth of hora's data planes, "
                    "torch.distributed gloo, mpi4py + Open MPI and Horovod, in one run; "
                    "the machine's limits; a Markdown table, JSON and a PNG plot.")
    add_arguments(p)
    p.set_defaults(handler=functools.partial(run_bench, parser=p))


def _plan(args):
    sizes = args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES)
    if args.max_size is not None:
        sizes = [s for s in sizes if s <= args.max_size]
    return {"sizes": sorted(set(sizes)),
            "launches": args.launches or (1 if args.quick else 3),
            "rounds": args.rounds or 1,
            "round_s": args.round_s or (0.05 if args.quick else 0.4),
            "size_budget_s": args.size_budget_s,
            "job_timeout_s": args.job_timeout_s}


def _check_args(args, parser):
    if args.np is None:
        args.np = [2] if args.quick else [2, 4]
    if min(args.np) < 2:
        parser.error(f"--np: every N must be at least 2, got {args.np}")
    for flag, value in (("--launches", args.launches), ("--rounds", args.rounds),
                        ("--round-s", args.round_s),
                        ("--size-budget-s", args.size_budget_s),
                        ("--job-timeout-s", args.job_timeout_s)):
        if value is not None and value <= 0:
            parser.error(f"{flag} must be positive, got {value}")
    plan = _plan(args)
    if not plan["sizes"]:
        parser.error("no sizes left to run (check --sizes / --max-size)")
    return plan


def run_bench(args, parser):
    """Run the benchmark ``args`` describe; returns the exit status."""
    plan = _check_args(args, parser)
    nps = list(dict.fromkeys(args.np))
    started = time.monotonic()
    from . import report                        # here: `hora run` need not import them
    from ..runner.proc import fixed_layout_refused
    from .jobs import available, machine_info, run_jobs
    from .limits import measure_limits
    systems, skipped = available(list(dict.fromkeys(args.systems)))
    for s, why in skipped.items():
        print(f"[bench] skipping {s}: {why}", file=sys.stderr)
    results = run_jobs(systems, nps, plan)
    # after the jobs: measured first, the first launch right after these large copies and
    # streams ran at half speed throughout in 6 runs of 8 (N=4, 4 B: 45-66 us against
    # 26-35), and in none of 7 without them
    limits = None if args.no_limits else measure_limits(args.quick)
    if limits is not None:
        report.print_limits(limits)
    if max(nps) > (os.cpu_count() or 1):
        print(f"note: N={max(nps)} ranks share {os.cpu_count()} CPUs (oversubscribed); "
              f"{_layout_note(env_value('RANK_ASLR').lower(), fixed_layout_refused())}")
    print(f"hora vs X = t_X / t_hora: above 1 hora is faster (for large sizes it equals the "
          f"busbw ratio hora/X); busbw = bytes/time * 2(N-1)/N, GB = 1e9 B"
          f"{'; skipped: ' + ', '.join(skipped) if skipped else ''}\n")
    report.print_table(results, systems, nps, plan["sizes"])
    report.print_spread_warnings(results, systems, nps, plan["sizes"])
    report.print_speed_warnings(results, systems, nps, plan["sizes"])
    print()
    if args.quick:
        found = []
        print(report.QUICK_NOTE)
    else:
        found = report.targets(results)
        report.print_targets(found)
    why_no_plot = ("--no-plot" if args.no_plot
                   else report.plot(results, systems, nps, args.plot, limits))
    plot_path = None if why_no_plot else args.plot
    elapsed = time.monotonic() - started
    _write_json(args.json, {
        "benchmark": "allreduce", "dtype": "float32", "op": "Sum", "argv": sys.argv[1:],
        "plan": plan, "systems": systems, "nps": nps, "skipped": skipped, "limits": limits,
        "results": results, "targets": found, "plot": plot_path, "elapsed_s": elapsed,
        "machine": machine_info(systems)})
    print(f"\n{elapsed:.0f} s in all; results written to {args.json}"
          + (f", plot to {plot_path}" if plot_path else f"; no plot: {why_no_plot}"))
    failed = [f"{s} N={n}" for s in systems for n, r in results[s].items() if "error" in r]
    if failed:
        print(f"FAILED: {', '.join(failed)} (see the messages above)", file=sys.stderr)
        return 1
    return 0


def _layout_note(policy, refused=None):
    """How hora's ranks are laid out in memory under ``HORA_RANK_ASLR`` = ``policy``, which
    changes small collectives of ranks that share CPUs (hora.runner.proc); ``refused``: why
    this machine cannot give them one layout, if it cannot."""
    where = {"on": "each have an address layout of their own, randomized",
             "off": "share one address layout",
             "auto": "share one address layout where they outnumber the CPUs"}[policy]
    if refused and policy != "on":
        where = f"each have an address layout of their own, randomized, as {refused}"
    return (f"hora's ranks {where} (HORA_RANK_ASLR={policy}); the peers' ranks keep the "
            f"system's randomization")


def _write_json(path, data):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)


def main(argv=None, prog=None):
    """Entry point of ``benchmarks/allreduce.py`` (``hora bench`` without the ``hora``)."""
    parser = argparse.ArgumentParser(prog=prog, description=(
        "Allreduce (float32, Sum) latency and bus bandwidth: hora side by side with "
        "torch.distributed gloo, mpi4py and Horovod (the same as `hora bench`)."))
    add_arguments(parser)
    return run_bench(parser.parse_args(argv), parser)
