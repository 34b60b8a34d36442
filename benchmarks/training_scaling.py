#!/usr/bin/env python
"""Training scaling from 1 to 2 processes: hora against torch DDP and TensorFlow's MWMS.

hora's DistributedOptimizer against torch DDP (gloo), and hora's DistributedGradientTape
against TensorFlow's MultiWorkerMirroredStrategy (MWMS).

    python benchmarks/training_scaling.py                 # torch, then TensorFlow: ~6 minutes
    python benchmarks/training_scaling.py --frameworks torch      # torch alone, ~2.5 minutes
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

TensorFlow (``--frameworks`` includes ``tf``, the default when TensorFlow is importable) runs
after torch, with its own rounds and ``--budget-s``, the same way:
``examples/tensorflow2_synthetic_benchmark.py`` (the same ResNet-20 in Keras, a
``tf.function`` step, one intra-op thread and ``--tf-inter-threads`` (1) inter-op threads per
process, launched by ``hora run``) as hora with 1 and 2 processes, TensorFlow's
``MultiWorkerMirroredStrategy`` with 1 and 2 workers (``--use-mwms``: TensorFlow's own ring
allreduce over gRPC between workers on localhost, ``TF_CONFIG`` built from ports the ranks
exchange through hora before hora shuts down), 2 independent 1-process hora jobs at once
(the ceiling) and 2 synchronisation-only hora ranks, in a second table.

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
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from _cpu import others_share  # the benchmarks folder is sys.path[0]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "examples", "pytorch_synthetic_benchmark.py")
TF_BENCH = os.path.join(ROOT, "examples", "tensorflow2_synthetic_benchmark.py")
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
TF_CONFIGS = {
    "hora/1": (1, [], 1), "hora/2": (2, [], 1),
    "mwms/1": (1, ["--use-mwms"], 1), "mwms/2": (2, ["--use-mwms"], 1),
    "independent/2": (1, [], 2),
    "sync/2": (2, ["--sync-only"], 1),
}
FRAMEWORKS = ("torch", "tf")


def _has_horovod():
    try:
        return importlib.util.find_spec("horovod") is not None
    except (ImportError, ValueError):
        return False


def _has_tensorflow():
    try:
        return importlib.util.find_spec("tensorflow") is not None
    except (ImportError, ValueError):
        return False


def _command(np_, extra, bench=BENCH):
    """The launch command of one job: horovodrun for Horovod, hora run for the others."""
    if "--use-horovod" in extra:
        return ["horovodrun", "-np", str(np_), "-H", f"localhost:{np_}", "--gloo",
                sys.executable, bench]
    return [sys.executable, "-m", "hora", "run", "-np", str(np_), "--timeout",
            str(RUN_TIMEOUT_S), sys.executable, bench]


def _run(name, bench_args, workdir, configs, bench=BENCH):
    """One configuration once; returns (total img/sec, the share of the machine that other
    processes used meanwhile, or None), or raises RuntimeError."""
    return others_share(_run_jobs, configs[name], name, bench_args, workdir, bench)


def _run_jobs(config, name, bench_args, workdir, bench=BENCH):
    np_, extra, jobs = config
    procs = []
    for j in range(jobs):
        out = os.path.join(workdir, f"{name.replace('/', '_')}_{j}.json")
        if os.path.exists(out):
            os.remove(out)
        cmd = [*_command(np_, extra, bench), *bench_args, *extra, "--json", out]
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


def table(medians, results=None, framework="torch"):
    """The Markdown table of the medians (img/sec, None where a run failed); with every
    round's ``results``, also the median of the per-round efficiencies."""
    if framework == "tf":
        return _table(medians, results, [
            ("hora", "hora/1", "hora/2"),
            ("TensorFlow MultiWorkerMirroredStrategy (ring)", "mwms/1", "mwms/2"),
            ("ceiling: 2 independent 1-process jobs", "hora/1", "independent/2"),
            ("synchronisation only: 2 ranks, 4 bytes per step", "hora/1", "sync/2")],
            [("mwms", "MultiWorkerMirroredStrategy's")])
    rows = [("hora", "hora/1", "hora/2"), ("torch DDP (gloo)", "ddp/1", "ddp/2"),
            *([("Horovod (gloo)", "horovod/1", "horovod/2")]
              if "horovod/1" in medians or "horovod/2" in medians else []),
            ("ceiling: 2 independent 1-process jobs", "ddp/1", "independent/2"),
            ("synchronisation only: 2 ranks, 4 bytes per step", "hora/1", "sync/2")]
    return _table(medians, results, rows, [("ddp", "DDP's"), ("horovod", "Horovod's")])


def _table(medians, results, rows, peers):
    """``rows``: (label, 1-process config, 2-process config); ``peers``: (config prefix,
    label) of the systems whose throughput hora's is shown as a share of."""
    lines = ["| system | throughput(1) img/s | throughput(2) img/s | scaling efficiency | "
             "median of per-round efficiencies |",
             "|---|---:|---:|---:|---:|"]
    for label, one, two in rows:
        a, b = medians.get(one), medians.get(two)
        paired = "–" if results is None or None in (a, b) else _paired(results, one, two)
        lines.append(f"| {label} | {_fmt(a)} | {_fmt(b)} | {_eff(a, b)} | {paired} |")
    for peer, label in peers:
        ratios = [f"{100 * medians[f'hora/{n}'] / medians[f'{peer}/{n}']:.1f}% with {n}"
                  for n in ("1", "2") if medians.get(f"hora/{n}") and medians.get(f"{peer}/{n}")]
        if ratios:
            lines.append(f"\nhora's throughput as a share of {label}: {', '.join(ratios)} "
                         f"process(es)")
    return "\n".join(lines)


def _rounds(configs, bench, bench_args, args, label):
    """Every configuration once per round, for up to ``args.rounds`` rounds within
    ``args.budget_s``; returns (img/s per round, other processes' CPU share per round,
    failed configurations, seconds, load averages before and after)."""
    load_before = os.getloadavg()
    print(f"machine: {os.cpu_count()} CPUs, load average {load_before[0]:.2f} "
          f"(1 min) before the run; {args.rounds} round(s) of {label}{', '.join(configs)}",
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
                    img_s, busy = _run(name, bench_args, workdir, configs, bench)
                    results[name].append(img_s)
                    others[name].append(busy)
                    print(f"[round {r + 1}] {label}{name}: {img_s:.1f} img/s" + (
                        "" if busy is None else f" (other processes: {100 * busy:.0f}% of "
                        f"the CPUs)"), file=sys.stderr, flush=True)
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    print(f"[round {r + 1}] {label}{name} FAILED: {e}", file=sys.stderr,
                          flush=True)
                    failed.add(name)
    return results, others, failed, time.monotonic() - started, load_before, os.getloadavg()


def _report(results, others, failed, elapsed, load_before, load_after, heading, framework):
    """Print one framework's table; returns its medians."""
    rounds = max(len(v) for v in results.values())
    medians = {n: statistics.median(v) for n, v in results.items() if v and n not in failed}
    print(heading.format(rounds=rounds))
    print(table(medians, results, framework))
    if framework == "tf":
        print(_tf_target(medians))
    shares = [b for v in others.values() for b in v if b is not None]
    print(f"\nload average (1 min): {load_before[0]:.2f} before, {load_after[0]:.2f} after; "
          f"{elapsed:.0f} s" + (f"; other processes used {100 * statistics.mean(shares):.0f}% "
                                f"of the CPUs on average during the runs (max "
                                f"{100 * max(shares):.0f}%)" if shares else ""))
    return medians


def _tf_target(medians):
    """hora's target in the TensorFlow table: scaling efficiency >= 90% and >= the strategy's."""
    if not all(medians.get(k) for k in ("hora/1", "hora/2", "mwms/1", "mwms/2")):
        return "\ntarget (hora >= 90% and >= MultiWorkerMirroredStrategy): n/a, a run failed"
    hora = medians["hora/2"] / (2 * medians["hora/1"])
    mwms = medians["mwms/2"] / (2 * medians["mwms/1"])
    met = "met" if hora >= 0.9 and hora >= mwms else "NOT met"
    return (f"\ntarget: hora's scaling efficiency >= 90% and >= MultiWorkerMirroredStrategy's: "
            f"{met} ({100 * hora:.1f}% against {100 * mwms:.1f}%)")


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
                        help="start no new round once this is spent (one round always runs); "
                             "each framework has its own")
    parser.add_argument("--no-horovod", action="store_true",
                        help="leave Horovod out even when it is importable")
    parser.add_argument("--frameworks", default="torch,tf",
                        help="comma-separated, of: torch, tf (tf is skipped, with a note, "
                             "where TensorFlow is not importable)")
    parser.add_argument("--tf-inter-threads", type=int, default=1,
                        help="TensorFlow inter-op threads per process (intra-op: 1)")
    parser.add_argument("--json", default=DEFAULT_JSON, metavar="PATH")
    args = parser.parse_args(argv)
    frameworks = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    unknown = sorted(set(frameworks) - set(FRAMEWORKS))
    if unknown or not frameworks:
        parser.error(f"--frameworks: unknown {', '.join(unknown) or 'empty list'} "
                     f"(choose from {', '.join(FRAMEWORKS)})")
    if "tf" in frameworks and not _has_tensorflow():
        print("TensorFlow is not importable: its table is left out "
              "(pip install -e '.[tensorflow]')", file=sys.stderr)
        frameworks.remove("tf")
    configs = dict(CONFIGS)
    if not args.no_horovod and _has_horovod():
        configs.update(HOROVOD_CONFIGS)
    common = ["--model", args.model, "--batch-size", str(args.batch_size),
              "--num-warmup-batches", str(args.num_warmup_batches),
              "--num-batches-per-iter", str(args.num_batches_per_iter),
              "--num-iters", str(args.num_iters), "--num-threads", "1"]
    bench_args = [*common, "--no-cuda"]
    tf_bench_args = [*common, "--num-inter-threads", str(args.tf_inter_threads), "--no-cuda"]

    report, failed_any = {}, False
    if "torch" in frameworks:
        results, others, failed, elapsed, load_before, load_after = _rounds(
            configs, BENCH, bench_args, args, "")
        medians = _report(results, others, failed, elapsed, load_before, load_after,
                          f"Training throughput, {args.model}, batch {args.batch_size} per "
                          f"process, 1 torch thread per process, {os.cpu_count()} CPUs; "
                          f"median of {{rounds}} round(s), total img/s\n", "torch")
        report.update({"rounds": results, "others_cpu_share": others, "medians": medians,
                       "failed": sorted(failed), "bench_args": bench_args,
                       "load_before": load_before, "load_after": load_after,
                       "seconds": elapsed})
        failed_any |= bool(failed)
    if "tf" in frameworks:
        if "torch" in frameworks:
            print()
        results, others, failed, elapsed, load_before, load_after = _rounds(
            TF_CONFIGS, TF_BENCH, tf_bench_args, args, "tf ")
        medians = _report(results, others, failed, elapsed, load_before, load_after,
                          f"TensorFlow training throughput, {args.model}, batch "
                          f"{args.batch_size} per process, 1 intra-op and "
                          f"{args.tf_inter_threads} inter-op thread(s) per process, "
                          f"{os.cpu_count()} CPUs; median of {{rounds}} round(s), "
                          f"total img/s\n", "tf")
        report["tensorflow"] = {"rounds": results, "others_cpu_share": others,
                                "medians": medians, "failed": sorted(failed),
                                "bench_args": tf_bench_args, "load_before": load_before,
                                "load_after": load_after, "seconds": elapsed}
        failed_any |= bool(failed)

    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({**report, "frameworks": frameworks, "cpus": os.cpu_count(),
                   "platform": platform.platform()}, f, indent=1)
    print(f"(every round's numbers: {args.json})", file=sys.stderr)
    return 1 if failed_any else 0


if __name__ == "__main__":
    sys.exit(main())
