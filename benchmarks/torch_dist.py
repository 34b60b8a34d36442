#!/usr/bin/env python
"""hora as a torch.distributed backend: ``dist.all_reduce`` and DDP training, against gloo.

    python benchmarks/torch_dist.py                  # all three parts (about 10 minutes on 2 CPUs)
    python benchmarks/torch_dist.py --quick          # smoke run (about a minute)
    python benchmarks/torch_dist.py --parts allreduce --np 2 --launches 5

**allreduce**: ``dist.all_reduce`` of a float32 CPU tensor (Sum, in place, one torch thread),
4 B and 64 MiB, on the default group of ``init_process_group("hora")`` (``dist hora``) and of
``init_process_group("gloo")`` (``dist gloo``), both in ranks started by ``hora run``'s Python
API; beside them mpi4py's ``Allreduce`` under ``mpiexec`` (Open MPI, when there is one) and,
as a reference for what the process group adds, hora's own ``hora.torch.allreduce_``.  The
rank program, its check of a known sum, its warm-up and rounds are ``hora bench``'s
(:func:`hora.bench.ranks.measure`); every (system, N) job is launched ``--launches`` times,
the systems taking turns, and the figure is the median of the slowest rank's round over
every launch.  busbw = bytes / time * 2(N-1)/N, GB = 1e9 B; ``X / hora`` is t_X / t_hora
(above 1, hora is faster); a ratio marked ``?`` compares figures whose rounds spread over half
their median or that ran at machine speeds a fifth apart (:func:`hora.bench.report.doubtful`).

**ddp**: DistributedDataParallel training of a CIFAR ResNet-20 (the model of
``examples/pytorch_synthetic_benchmark.py``) on synthetic 32x32 images, batch 32 a rank, one
torch thread, BatchNorm statistics local (``forward_sync_buffers=False``), on backend hora and
on gloo, at N = 1 and 2.  Each round runs the four in turn (every other round reversed);
throughput = images of every rank / the slowest rank's time for ``--steps`` steps after
``--warmup`` steps; scaling efficiency = throughput(2) / (2 x throughput(1)), from the
medians, and the median of each round's own efficiency.  Each run checks that its ranks end
with the same parameters.

**steps**: where a DDP step's time goes, robust to a machine whose speed drifts: one job of 2
ranks holds a DDP ResNet-20 on the default group (hora) and one on a gloo group of the same
ranks, and runs blocks of 5 steps of each in turn, and of ``no_sync()`` steps (the
computation alone); the median over ``--blocks`` blocks of the slowest rank's time a step,
and what communication adds to the computation.

Targets (issue 64), printed from this run's numbers: at N = 2, 64 MiB busbw at least 2x
gloo's, 4 B latency at most 0.1x gloo's, and DDP scaling efficiency at least gloo's + 5
points.  Timings are not assertions: exit 0 when every job ran and verified, else 1.
"""
import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time

from _cpu import others_share  # the benchmarks folder is sys.path[0]

from hora.bench import jobs as bench_jobs
from hora.bench.ranks import _GlooComm, hora_job, measure
from hora.bench.report import doubtful, fmt_size
from hora.runner import run as hora_run

KiB, MiB = 1 << 10, 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "pytorch_synthetic_benchmark.py")
DEFAULT_JSON = os.path.join(tempfile.gettempdir(), "hora-bench", "torch_dist.json")
SIZES = [4, 64 * MiB]
JOB_TIMEOUT_S = 300.0
SEED = 42
BATCH = 32                  # images a rank a step, as the synthetic benchmark's default
# system -> what the table calls it; "dist hora" is the system under test
NAMES = {"dist-hora": "dist hora", "dist-gloo": "dist gloo", "mpi": "Open MPI",
         "hora-torch": "hora.torch"}
PEERS = ("dist-gloo", "mpi")


# -- allreduce ----------------------------------------------------------------------------------
class _DistComm(_GlooComm):
    """``dist.all_reduce`` on the default group of ``backend``, for
    :func:`hora.bench.ranks.measure`: ``hora bench``'s gloo rank but for how it starts."""

    def __init__(self, backend):  # (not _GlooComm's: the group starts otherwise)
        import torch
        import torch.distributed as dist

        import hora.torch  # noqa: F401 - registers "hora"; RANK, WORLD_SIZE from hora run
        torch.set_num_threads(1)
        self._torch, self._dist, self._backend = torch, dist, backend
        dist.init_process_group(backend)
        self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def tuning(self, nbytes):
        if self._backend != "hora":
            return False
        from hora.bench.ranks import _hora_tunes        # hora's plane measuring itself
        return _hora_tunes(nbytes)


def _dist_job(backend, plan):
    comm = _DistComm(backend)
    try:
        return measure(comm, plan)
    finally:
        comm.close()


def _runner(system):
    if system == "dist-hora":
        return lambda n, plan: hora_run(_dist_job, args=("hora", plan), np=n,
                                        timeout_s=plan["job_timeout_s"])
    if system == "dist-gloo":
        return lambda n, plan: hora_run(_dist_job, args=("gloo", plan), np=n,
                                        timeout_s=plan["job_timeout_s"])
    if system == "hora-torch":
        return lambda n, plan: hora_run(hora_job, args=(plan, "torch"), np=n,
                                        timeout_s=plan["job_timeout_s"])
    # mpi4py under mpiexec, as hora bench runs it
    return lambda n, plan: bench_jobs._run_launched(n, plan, system="mpi",
                                                    launcher=bench_jobs._mpiexec_n)


def run_allreduce(systems, nps, plan):
    """``{system: {N: rows or {"error": text}}}`` (rows as ``hora bench``'s)."""
    done = {s: {n: [] for n in nps} for s in systems}
    errors = {s: {} for s in systems}
    schedule = [(k, n, s) for k in range(plan["launches"]) for n in nps
                for s in (systems if k % 2 == 0 else systems[::-1])]
    for i, (k, n, s) in enumerate(schedule):
        if n in errors[s]:
            continue
        t0 = time.monotonic()
        try:
            done[s][n].append(_runner(s)(n, plan))
            status = "ok"
        except Exception as e:  # noqa: BLE001 - a failed job is reported
            errors[s][n] = status = f"FAILED: {type(e).__name__}: {e}"
        print(f"[torch_dist] allreduce job {i + 1}/{len(schedule)}: {s} N={n} "
              f"(launch {k + 1}): {status} ({time.monotonic() - t0:.1f} s)", file=sys.stderr)
    return {s: {n: {"error": errors[s][n]} if n in errors[s]
                else bench_jobs._summarize(done[s][n], n) for n in nps} for s in systems}


def _row(results, system, n, nbytes):
    rows = results.get(system, {}).get(n)
    if not isinstance(rows, list):
        return None
    return next((r for r in rows if r["bytes"] == nbytes), None)


def print_allreduce(results, systems, nps, sizes):
    peers = [p for p in PEERS if p in systems]
    head = ["size", "N"]
    for s in systems:
        head += [f"{NAMES[s]} µs", f"{NAMES[s]} busbw GB/s"]
    head += [f"{NAMES[p]} / dist hora" for p in peers]
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---:" for _ in head) + "|")
    for size in sizes:
        for n in nps:
            cells = [fmt_size(size), str(n)]
            for s in systems:
                row = _row(results, s, n, size)
                cells += ([f"{row['latency_us']:,.1f} ({row['min_s'] * 1e6:,.1f}-"
                           f"{row['max_s'] * 1e6:,.1f})", f"{row['busbw_gbps']:.3g}"]
                          if row else ["FAILED", "FAILED"])
            mine = _row(results, "dist-hora", n, size)
            for p in peers:
                theirs = _row(results, p, n, size)
                cells.append(f"{theirs['time_s'] / mine['time_s']:.2f}x"
                             f"{'?' if doubtful(mine, theirs) else ''}"
                             if mine and theirs else "-")
            print("| " + " | ".join(cells) + " |")


# -- DDP training -------------------------------------------------------------------------------
def _ddp(group, example):
    """A DDP ResNet-20 over ``group`` (None: the default group), its optimizer and one
    training step, every rank from the same seed; ``step(sync=False)`` runs under
    ``no_sync()`` (the step's computation alone)."""
    import importlib.util
    import inspect

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    spec = importlib.util.spec_from_file_location("_synthetic_benchmark", example)
    synthetic = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(synthetic)
    torch.manual_seed(SEED)
    local_buffers = ({"forward_sync_buffers": False}
                     if "forward_sync_buffers" in inspect.signature(DDP).parameters
                     else {"broadcast_buffers": False})
    model = DDP(synthetic.ResNet(synthetic.MODELS["resnet20"], 10), process_group=group,
                **local_buffers)
    opt = torch.optim.SGD(model.parameters(), lr=0.01 * dist.get_world_size(), momentum=0.9)
    data = torch.randn(BATCH, 3, 32, 32)
    target = torch.randint(0, 10, (BATCH,))

    def step(sync=True):
        opt.zero_grad()
        if sync:
            F.cross_entropy(model(data), target).backward()
        else:
            with model.no_sync():
                F.cross_entropy(model(data), target).backward()
        opt.step()
    return model, step


def _digest(model):
    flat = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
    return hashlib.sha256(flat).hexdigest()


def _ddp_job(backend, example, warmup, steps):
    """DDP ResNet-20 on every rank: ``(seconds for the timed steps, a digest of the
    parameters)``."""
    import torch
    import torch.distributed as dist

    import hora.torch  # noqa: F401 - registers "hora"
    torch.set_num_threads(1)
    dist.init_process_group(backend)
    try:
        model, step = _ddp(None, example)
        for _ in range(warmup):
            step()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        dist.barrier()
        return time.perf_counter() - t0, _digest(model)
    finally:
        dist.destroy_process_group()


STEP_KINDS = ("hora", "gloo", "compute")
BLOCK_STEPS = 5


def _step_times_job(example, blocks):
    """One job, two DDP models (default group: hora; a gloo group), and ``no_sync()`` steps
    (no communication): blocks of :data:`BLOCK_STEPS` steps of each in turn.  Returns
    ``{kind: [seconds a step of each block]}`` and the two models' digests."""
    import torch
    import torch.distributed as dist

    import hora.torch  # noqa: F401 - registers "hora"
    torch.set_num_threads(1)
    dist.init_process_group("hora")
    try:
        runs = {"hora": _ddp(None, example), "gloo": _ddp(dist.new_group(backend="gloo"),
                                                          example)}
        runs["compute"] = (runs["hora"][0], lambda: runs["hora"][1](sync=False))
        for _, step in runs.values():
            for _ in range(2):
                step()
        times = {kind: [] for kind in STEP_KINDS}
        for b in range(blocks):
            for kind in (STEP_KINDS if b % 2 == 0 else STEP_KINDS[::-1]):
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(BLOCK_STEPS):
                    runs[kind][1]()
                times[kind].append((time.perf_counter() - t0) / BLOCK_STEPS)
        return times, (_digest(runs["hora"][0]), _digest(runs["gloo"][0]))
    finally:
        dist.destroy_process_group()


def run_step_times(blocks):
    """``{kind: median over blocks of the slowest rank's seconds a step}``."""
    per_rank = hora_run(_step_times_job, args=(EXAMPLE, blocks), np=2,
                        timeout_s=JOB_TIMEOUT_S)
    if len({digests for _, digests in per_rank}) != 1:
        raise RuntimeError("the ranks ended with different parameters")
    return {kind: statistics.median(max(times[kind][b] for times, _ in per_rank)
                                    for b in range(blocks)) for kind in STEP_KINDS}


def print_step_times(step_s):
    compute = step_s["compute"]
    print("| DDP ResNet-20, N = 2, one job | ms a step | communication's share (step - "
          "compute) |")
    print("|---|---:|---:|")
    for kind, label in (("hora", "DDP, hora"), ("gloo", "DDP, gloo (a group of the job)"),
                        ("compute", "compute alone (no_sync)")):
        extra = f"{(step_s[kind] - compute) * 1e3:.1f} ms" if kind != "compute" else ""
        print(f"| {label} | {step_s[kind] * 1e3:.1f} | {extra} |")


DDP_CONFIGS = [("hora", 1), ("hora", 2), ("gloo", 1), ("gloo", 2)]


def run_ddp(rounds, warmup, steps):
    """``{"hora/1": [img/s of each round], ...}``, the failures, and the share of the
    machine other processes used."""
    rates = {f"{b}/{n}": [] for b, n in DDP_CONFIGS}
    errors, shares = {}, []
    for r in range(rounds):
        for backend, n in (DDP_CONFIGS if r % 2 == 0 else DDP_CONFIGS[::-1]):
            key = f"{backend}/{n}"
            if key in errors:
                continue
            t0 = time.monotonic()
            try:
                per_rank, share = others_share(
                    hora_run, _ddp_job, args=(backend, EXAMPLE, warmup, steps), np=n,
                    timeout_s=JOB_TIMEOUT_S)
                if len({digest for _, digest in per_rank}) != 1:
                    raise RuntimeError("the ranks ended with different parameters")
                rates[key].append(n * BATCH * steps / max(t for t, _ in per_rank))
                shares.append(share)
                status = f"{rates[key][-1]:.1f} img/s"
            except Exception as e:  # noqa: BLE001 - a failed run is reported
                errors[key] = status = f"FAILED: {type(e).__name__}: {e}"
            print(f"[torch_dist] ddp round {r + 1}/{rounds}: {key}: {status} "
                  f"({time.monotonic() - t0:.1f} s)", file=sys.stderr)
    return rates, errors, [s for s in shares if s is not None]


def ddp_summary(rates):
    """Per backend: the median throughputs, the efficiency from them and the median of the
    rounds' own efficiencies."""
    out = {}
    for backend in ("hora", "gloo"):
        one, two = rates[f"{backend}/1"], rates[f"{backend}/2"]
        if not one or not two:
            continue
        rounds = [b / (2 * a) for a, b in zip(one, two)]
        out[backend] = {"img_s_1": statistics.median(one), "img_s_2": statistics.median(two),
                        "efficiency": statistics.median(two) / (2 * statistics.median(one)),
                        "round_efficiency": statistics.median(rounds)}
    return out


def print_ddp(summary):
    print("| backend | throughput(1) img/s | throughput(2) img/s | scaling efficiency | "
          "median of per-round efficiencies |")
    print("|---|---:|---:|---:|---:|")
    for backend, s in summary.items():
        print(f"| DDP, {backend} | {s['img_s_1']:.1f} | {s['img_s_2']:.1f} | "
              f"{s['efficiency']:.1%} | {s['round_efficiency']:.1%} |")


# -- targets ------------------------------------------------------------------------------------
def targets(results, summary):
    """``[(target, value text, met or None)]`` from this run's numbers."""
    out = []
    big, small = (_row(results, s, 2, 64 * MiB) for s in ("dist-hora", "dist-gloo")), \
        (_row(results, s, 2, 4) for s in ("dist-hora", "dist-gloo"))
    hora_big, gloo_big = big
    hora_small, gloo_small = small
    if hora_big and gloo_big:
        ratio = hora_big["busbw_gbps"] / gloo_big["busbw_gbps"]
        out.append(("64 MiB busbw at N = 2, at least 2x gloo's", f"{ratio:.2f}x", ratio >= 2))
    if hora_small and gloo_small:
        ratio = hora_small["time_s"] / gloo_small["time_s"]
        out.append(("4 B latency at N = 2, at most 0.1x gloo's", f"{ratio:.3f}x",
                    ratio <= 0.1))
    if "hora" in summary and "gloo" in summary:
        points = 100 * (summary["hora"]["efficiency"] - summary["gloo"]["efficiency"])
        out.append(("DDP scaling efficiency at N = 2, at least gloo's + 5 points",
                    f"{points:+.1f} points", points >= 5))
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", nargs="+", choices=("allreduce", "ddp", "steps"),
                   default=["allreduce", "ddp", "steps"])
    p.add_argument("--np", type=int, nargs="+", default=None, metavar="N",
                   help="allreduce: numbers of ranks (default 2 4; quick: 2)")
    p.add_argument("--launches", type=int, default=None,
                   help="allreduce: launches of every (system, N) job (default 3; quick 1)")
    p.add_argument("--rounds", type=int, default=None,
                   help="allreduce: timed rounds a size in each launch (default 2; quick 1); "
                        "ddp: rounds of the four runs (default 3; quick 1)")
    p.add_argument("--no-mpi", action="store_true", help="allreduce: leave Open MPI out")
    p.add_argument("--steps", type=int, default=None,
                   help="ddp: timed steps (default 30; quick 5)")
    p.add_argument("--warmup", type=int, default=None,
                   help="ddp: steps before timing (default 5; quick 2)")
    p.add_argument("--blocks", type=int, default=None,
                   help="steps: blocks of each kind of step (default 8; quick 2)")
    p.add_argument("--quick", action="store_true", help="smoke run: numbers not to compare")
    p.add_argument("--json", default=DEFAULT_JSON, metavar="PATH")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    started, load_before = time.monotonic(), os.getloadavg()
    nps = args.np or ([2] if args.quick else [2, 4])
    plan = {"sizes": SIZES, "launches": args.launches or (1 if args.quick else 3),
            "rounds": args.rounds or (1 if args.quick else 2),
            "round_s": 0.05 if args.quick else 0.4, "size_budget_s": 12.0,
            "job_timeout_s": JOB_TIMEOUT_S}
    results, summary, ddp, step_s, failed = {}, {}, {}, {}, []
    if "allreduce" in args.parts:
        systems, skipped = bench_jobs.available(["mpi"] if not args.no_mpi else [])
        for s, why in skipped.items():
            print(f"[torch_dist] skipping {s}: {why}", file=sys.stderr)
        systems = ["dist-hora", "dist-gloo", *systems, "hora-torch"]
        results = run_allreduce(systems, nps, plan)
        failed += [f"allreduce {s} N={n}" for s in systems for n, r in results[s].items()
                   if "error" in r]
    if "ddp" in args.parts:
        rounds = args.rounds or (1 if args.quick else 3)
        rates, errors, shares = run_ddp(rounds, args.warmup or (2 if args.quick else 5),
                                        args.steps or (5 if args.quick else 30))
        summary = ddp_summary(rates)
        ddp = {"rates": rates, "errors": errors, "others_cpu_share": shares}
        failed += [f"ddp {key}" for key in errors]
    if "steps" in args.parts:
        try:
            step_s = run_step_times(args.blocks or (2 if args.quick else 8))
        except Exception as e:  # noqa: BLE001 - a failed run is reported
            failed.append(f"steps: {type(e).__name__}: {e}")
    print(f"\nload average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f} "
          f"({os.cpu_count()} CPUs)\n")
    if results:
        print_allreduce(results, list(results), nps, SIZES)
        print()
    if summary:
        print_ddp(summary)
        if ddp["others_cpu_share"]:
            print(f"\nother processes used {max(ddp['others_cpu_share']):.0%} of the CPUs "
                  f"at most during a DDP run")
        print()
    if step_s:
        print_step_times(step_s)
        print()
    found = [] if args.quick else targets(results, summary)
    for name, value, met in found:
        print(f"- {name}: {value}: {'met' if met else 'NOT met'}")
    elapsed = time.monotonic() - started
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"benchmark": "torch_dist", "argv": sys.argv[1:], "plan": plan,
                   "allreduce": results, "ddp": ddp, "ddp_summary": summary,
                   "step_s": step_s, "targets": found, "elapsed_s": elapsed}, f, indent=1)
    print(f"\n{elapsed:.0f} s in all; results written to {args.json}")
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
