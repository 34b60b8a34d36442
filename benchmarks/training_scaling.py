#!/usr/bin/env python
"""Training scaling from 1 to 2 processes: hora's DistributedOptimizer against torch DDP (gloo).

    python benchmarks/training_scaling.py                 # 3 rounds, about 2.5 minutes
    python benchmarks/training_scaling.py --rounds 1 --num-iters 2     # smoke run
    python benchmarks/training_scaling.py --json /tmp/scaling.json

Runs ``examples/pytorch_synthetic_benchmark.py`` (a CIFAR ResNet-20 on synthetic 32x32
images, one torch thread per process, every process launched by ``hora run``) as:

- hora with 1 and 2 processes;
- torch DDP over gloo with 1 and 2 processes (``--use-ddp``);
- Horovod with 1 and 2 processes (``--use-horovod``, launched by ``horovodrun``), when
  ``horovod.torch`` is importable (``--no-horovod`` skips it);
- a reference: 2 independent 1-process DDP jobs at the same time, which exchange nothing
  (a 1-process DDP job is plain torch plus a no-op gloo call).  Their total, counted only
  over the time both were in their timed phase, is what this machine gives 2 processes
  without any data parallelism (cores, memory bandwidth and caches shared), so the
  ``ceiling`` row bounds what a library can reach;
- a second reference, 2 hora ranks that exchange no gradients but wait for each other with a
  4-byte allreduce every step (``--sync-only``): what synchronising alone costs when the
  ranks' step times jitter, the best any synchronous data-parallel trainer can do here.

Each round runs every configuration once, in turn (every other round in reverse order); the
table shows the median over rounds of the total images per second.  Scaling efficiency =
throughput(2) / (2 x throughput(1)), from those medians, and also as the median of each
round's own efficiency, which a drift of the machine's speed during the benchmark does not
skew.
Timings are not assertions: the exit status is 0 when every run finished, 1 otherwise
(its cells say FAILED).  Run it on a quiet machine; the load average is printed before and
after.  On a small virtual machine one run's efficiencies swing by several points (3 runs of
6 rounds on this project's 2-CPU machine: hora 89-97%, DDP 88-90%), so compare systems
within a run and use ``--rounds 6 --budget-s 1200`` or more for a figure worth quoting.
"""
import argparse
import importlib.util
import json
import os
import platform
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "examples", "pytorch_synthetic_benchmark.py")
DEFAULT_JSON = os.path.join(tempfile.gettempdir(), "hora-bench", "training_scaling.json")
RUN_TIMEOUT_S = 300
# name -> (processes, extra benchmark flags, concurrent independent jobs)
CONFIGS = {
    "hora/1": (1, [], 1), "hora/2": (2, [], 1),
    "ddp/1": (1, ["--use-ddp"], 1), "ddp/2": (2, ["--use-ddp"], 1),
    "independent/2": (1, ["--use-ddp"], 2),
    "sync/2": (2, ["--sync-only"], 1),
}
HOROVOD_CONFIGS = {"horovod/1": (1, ["--use-horovod"], 1),
                   "horovod/2": (2, ["--use-horovod"], 1)}


def _has_horovod():
    try:
        return importlib.util.find_spec("horovod") is not None
    except (ImportError, ValueError):
        return False


def _command(np_, extra):
    """The launch command of one job: horovodrun for Horovod, hora run for the others."""
    if "--use-horovod" in extra:
        return ["horovodrun", "-np", str(np_), "-H", f"localhost:{np_}", "--gloo",
                sys.executable, BENCH]
    return [sys.executable, "-m", "hora", "run", "-np", str(np_), "--timeout",
            str(RUN_TIMEOUT_S), sys.executable, BENCH]


def _busy_s():
    """Seconds of CPU time every process of the machine has used (Linux), else None."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def _children_s():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _run(name, bench_args, workdir, configs):
    """One configuration once; returns (total img/sec, the share of the machine that other
    processes used meanwhile, or None), or raises RuntimeError."""
    busy, ours, t0 = _busy_s(), _children_s(), time.monotonic()
    total = _run_jobs(configs[name], name, bench_args, workdir)
    busy_after, wall = _busy_s(), time.monotonic() - t0
    if busy is None or busy_after is None:
        return total, None
    others = (busy_after - busy) - (_children_s() - ours)
    return total, max(0.0, others / (wall * (os.cpu_count() or 1)))


def _run_jobs(config, name, bench_args, workdir):
    np_, extra, jobs = config
    procs = []
    for j in range(jobs):
        out = os.path.join(workdir, f"{name.replace('/', '_')}_{j}.json")
        if os.path.exists(out):
            os.remove(out)
        cmd = [*_command(np_, extra), *bench_args, *extra, "--json", out]
        procs.append((subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True, cwd=ROOT, start_new_session=True), out))
    reports = []
    for p, out in procs:
        try:
            log, _ = p.communicate(timeout=RUN_TIMEOUT_S + 30)
        except subprocess.TimeoutExpired:
            for q, _ in procs:              # the launcher and every rank it started
                try:
                    os.killpg(q.pid, signal.SIGKILL)
                except OSError:
                    pass
            raise
        if p.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"{name} exited {p.returncode}:\n{log[-3000:]}")
        with open(out) as f:
            reports.append(json.load(f))
    if len(reports) == 1:
        return reports[0]["img_sec_total"]
    return _overlapped(reports)


def _overlapped(reports):
    """Total img/s of concurrent independent jobs, counted only while *all* of them were in
    their timed phase: a job's batches outside that window ran with a CPU to itself, which
    would overstate what the machine gives several processes at once."""
    start = max(r["timed_start"] for r in reports)
    end = min(r["batch_ends"][-1] for r in reports)
    total = 0.0
    for r in reports:
        inside = [t for t in r["batch_ends"] if start <= t <= end]
        if len(inside) < 3:
            raise RuntimeError(f"the independent jobs' timed phases overlapped for only "
                               f"{max(0.0, end - start):.1f} s; run more iterations")
        total += (len(inside) - 1) * r["batch_size"] / (inside[-1] - inside[0])
    return total


def _fmt(x):
    return "FAILED" if x is None else f"{x:.1f}"


def _eff(one, two):
    return "FAILED" if one is None or two is None else f"{100 * two / (2 * one):.1f}%"


def _paired(results, one, two):
    """The median over rounds of each round's own efficiency (its 2-process run against its
    1-process run, minutes apart): drift of the machine's speed over the whole benchmark,
    which the ratio of medians absorbs, cancels out within a round."""
    pairs = [b / (2 * a) for a, b in zip(results.get(one, []), results.get(two, [])) if a]
    return f"{100 * statistics.median(pairs):.1f}%" if pairs else "FAILED"


def table(medians, results=None):
    """The Markdown table of the medians (img/sec, None where a run failed); with every
    round's ``results``, also the median of the per-round efficiencies."""
    rows = [("hora", "hora/1", "hora/2"), ("torch DDP (gloo)", "ddp/1", "ddp/2"),
            *([("Horovod (gloo)", "horovod/1", "horovod/2")]
              if "horovod/1" in medians or "horovod/2" in medians else []),
            ("ceiling: 2 independent 1-process jobs", "ddp/1", "independent/2"),
            ("synchronisation only: 2 ranks, 4 bytes per step", "hora/1", "sync/2")]
    lines = ["| system | throughput(1) img/s | throughput(2) img/s | scaling efficiency | "
             "median of per-round efficiencies |",
             "|---|---:|---:|---:|---:|"]
    for label, one, two in rows:
        a, b = medians.get(one), medians.get(two)
        paired = "–" if results is None or None in (a, b) else _paired(results, one, two)
        lines.append(f"| {label} | {_fmt(a)} | {_fmt(b)} | {_eff(a, b)} | {paired} |")
    for peer, label in (("ddp", "DDP's"), ("horovod", "Horovod's")):
        ratios = [f"{100 * medians[f'hora/{n}'] / medians[f'{peer}/{n}']:.1f}% with {n}"
                  for n in ("1", "2") if medians.get(f"hora/{n}") and medians.get(f"{peer}/{n}")]
        if ratios:
            lines.append(f"\nhora's throughput as a share of {label}: {', '.join(ratios)} "
                         f"process(es)")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="resnet20")
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--num-warmup-batches", type=int, default=5)
    parser.add_argument("--num-batches-per-iter", type=int, default=10)
    parser.add_argument("--num-iters", type=int, default=5)
    parser.add_argument("--budget-s", type=float, default=240.0,
                        help="start no new round once this is spent (one round always runs)")
    parser.add_argument("--no-horovod", action="store_true",
                        help="leave Horovod out even when it is importable")
    parser.add_argument("--json", default=DEFAULT_JSON, metavar="PATH")
    args = parser.parse_args(argv)
    configs = dict(CONFIGS)
    if not args.no_horovod and _has_horovod():
        configs.update(HOROVOD_CONFIGS)
    bench_args = ["--model", args.model, "--batch-size", str(args.batch_size),
                  "--num-warmup-batches", str(args.num_warmup_batches),
                  "--num-batches-per-iter", str(args.num_batches_per_iter),
                  "--num-iters", str(args.num_iters), "--num-threads", "1", "--no-cuda"]

    load_before = os.getloadavg()
    print(f"machine: {os.cpu_count()} CPUs, load average {load_before[0]:.2f} "
          f"(1 min) before the run; {args.rounds} round(s) of {', '.join(configs)}",
          file=sys.stderr)
    results = {name: [] for name in configs}
    others = {name: [] for name in configs}
    failed = set()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hora-scaling-") as workdir:
        for r in range(args.rounds):
            spent = time.monotonic() - started
            if r and spent + spent / r > args.budget_s:
                print(f"stopping after {r} round(s): another would pass --budget-s "
                      f"{args.budget_s:g}", file=sys.stderr)
                break
            # every other round in reverse order: no configuration always runs first or
            # last in a round, so slow drift of the machine falls on all of them alike
            for name in (list(configs) if r % 2 == 0 else list(configs)[::-1]):
                if name in failed:
                    continue
                try:
                    img_s, busy = _run(name, bench_args, workdir, configs)
                    results[name].append(img_s)
                    others[name].append(busy)
                    print(f"[round {r + 1}] {name}: {img_s:.1f} img/s" + (
                        "" if busy is None else f" (other processes: {100 * busy:.0f}% of "
                        f"the CPUs)"), file=sys.stderr, flush=True)
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    print(f"[round {r + 1}] {name} FAILED: {e}", file=sys.stderr, flush=True)
                    failed.add(name)
    elapsed = time.monotonic() - started
    load_after = os.getloadavg()

    rounds = max(len(v) for v in results.values())
    medians = {n: statistics.median(v) for n, v in results.items() if v and n not in failed}
    print(f"Training throughput, {args.model}, batch {args.batch_size} per process, "
          f"1 torch thread per process, {os.cpu_count()} CPUs; median of {rounds} "
          f"round(s), total img/s\n")
    print(table(medians, results))
    shares = [b for v in others.values() for b in v if b is not None]
    print(f"\nload average (1 min): {load_before[0]:.2f} before, {load_after[0]:.2f} after; "
          f"{elapsed:.0f} s" + (f"; other processes used {100 * statistics.mean(shares):.0f}% "
                                f"of the CPUs on average during the runs (max "
                                f"{100 * max(shares):.0f}%)" if shares else ""))

    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"rounds": results, "others_cpu_share": others, "medians": medians,
                   "failed": sorted(failed), "bench_args": bench_args, "cpus": os.cpu_count(),
                   "platform": platform.platform(), "load_before": load_before,
                   "load_after": load_after, "seconds": elapsed}, f, indent=1)
    print(f"(every round's numbers: {args.json})", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
