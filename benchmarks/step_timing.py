#!/usr/bin/env python
"""Where a data-parallel training step's time goes: 1 rank, then N ranks of hora's
DistributedOptimizer, and what separates the two.

    python benchmarks/step_timing.py                 # ResNet-20, 1 then 2 ranks, 80 steps each
    python benchmarks/step_timing.py --steps 200 --np 2
    python benchmarks/step_timing.py --np 2 --no-single      # the 2-rank run alone

Launches itself with ``hora run`` (``--worker`` is the per-rank side), once with 1 rank and
once with ``--np`` ranks.  Every rank records, for each step, the monotonic clock (one clock
for every process of the host) at the start, at the end of ``backward()`` and at the end of
``optimizer.step()``, on the model of ``examples/pytorch_synthetic_benchmark.py`` (one torch
thread per rank).  Over the steps after the warm-up it prints, for each run:

- each rank's forward+backward time (median, standard deviation);
- the skew: how far apart the ranks end their backward passes (what the first waits for);
- the tail: from the end of the *last* rank's backward to the moment every rank has
  finished ``step()`` -- the reduction that backward did not hide, plus the optimizer's own
  update, which the last line measures alone (the wrapped optimizer's ``step()`` after
  ``synchronize()``) so that the difference is what hora adds; split by the rank that
  ended its backward last (a worker's request makes a round trip to rank 0 first);
- the same from the moment autograd produced the last rank's last gradient, which also
  counts what hora's gradient hooks do inside ``backward()``.

Then it splits the difference between the two runs' mean step times (what the scaling
efficiency loses) into: the ranks computing more slowly side by side than one process alone
(cores, caches and memory bandwidth shared); waiting for the slower rank's backward (noise in
the step times: what any synchronous trainer pays); hora's exchange after backward (the
N-rank tail beyond the 1-rank one); and the rest.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MS = 1e3


def _worker(args):
    import torch
    import torch.nn.functional as F
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from pytorch_synthetic_benchmark import MODELS, ResNet

    import hora.torch as hvd
    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(0)
    model = ResNet(MODELS[args.model], 10)
    last_grad = [0.0]

    def mark(_):
        last_grad[0] = time.monotonic()
    for p in model.parameters():            # before hora's hooks, so these run first
        p.register_post_accumulate_grad_hook(mark)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    x = torch.randn(args.batch_size, 3, 32, 32)
    y = torch.randint(0, 10, (args.batch_size,))
    marks, updates = [], []
    for _ in range(args.steps):
        t0 = time.monotonic()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        t1 = time.monotonic()
        opt.synchronize()
        t2 = time.monotonic()
        with opt.skip_synchronize():
            opt.step()
        t3 = time.monotonic()
        marks.append((t0, t1, t3, last_grad[0]))
        updates.append(t3 - t2)
    from hora.core import state
    offers = state.engine().offers_taken     # steps this rank ran without asking rank 0
    every = hvd.allgather_object((marks, updates, offers), name="step_timing")
    if hvd.rank() == 0:
        with open(args.out, "w") as f:
            json.dump([[m[args.warmup:], u[args.warmup:], o] for m, u, o in every], f)
    hvd.shutdown()


def _summary(every):
    """The figures of one run (times in ms) from every rank's (marks, updates)."""
    marks = [m for m, _, _ in every]
    steps = list(zip(*marks))       # per step: every rank's (start, end of backward, ...)
    compute = [[(t1 - t0) * MS for t0, t1, _, _ in m] for m in marks]
    return {
        "ranks": len(every),
        "compute": compute,
        "skew": [(max(s[1] for s in step) - min(s[1] for s in step)) * MS for step in steps],
        # how much later than the ranks' average the last backward ends
        "wait": [(max(s[1] for s in step) - statistics.fmean(s[1] for s in step)) * MS
                 for step in steps],
        "tail": [(max(s[2] for s in step) - max(s[1] for s in step)) * MS for step in steps],
        "from_grads": [(max(s[2] for s in step) - max(s[3] for s in step)) * MS
                       for step in steps],
        "wall": [(b[0][0] - a[0][0]) * MS for a, b in zip(steps, steps[1:])],
        # which rank ended its backward last, step by step (the tail splits by it: a
        # worker's request travels to rank 0 and back, rank 0's own goes nowhere)
        "last": [max(range(len(step)), key=lambda r: step[r][1]) for step in steps],
        "update": statistics.median(u * MS for _, ups, _ in every for u in ups),
        "offers": [o for _, _, o in every],
    }


def _report(s):
    print(f"-- {s['ranks']} rank(s)")
    for rank, c in enumerate(s["compute"]):
        print(f"rank {rank}: forward+backward median {statistics.median(c):.1f} ms, "
              f"sd {statistics.stdev(c):.1f} ms")
    print(f"step: median {statistics.median(s['wall']):.1f} ms, "
          f"mean {statistics.fmean(s['wall']):.1f} ms")
    if s["ranks"] > 1:
        print(f"skew between the ranks' ends of backward: median "
              f"{statistics.median(s['skew']):.1f} ms, mean {statistics.fmean(s['skew']):.1f} ms")
    print(f"tail, last rank's end of backward -> every rank's step done: median "
          f"{statistics.median(s['tail']):.2f} ms, mean {statistics.fmean(s['tail']):.2f} ms")
    if s["ranks"] > 1:
        by_last = {}
        for rank, tail in zip(s["last"], s["tail"]):
            by_last.setdefault(rank, []).append(tail)
        print("tail by the rank whose backward ended last: " + ", ".join(
            f"rank {r} ({len(t)} steps) median {statistics.median(t):.2f} ms"
            for r, t in sorted(by_last.items())))
        print("steps run on rank 0's answer given in advance (offers taken), by rank: "
              + ", ".join(map(str, s["offers"])))
    print(f"from the last rank's last gradient (autograd done with it) -> every rank's step "
          f"done: median {statistics.median(s['from_grads']):.2f} ms, mean "
          f"{statistics.fmean(s['from_grads']):.2f} ms")
    print(f"of which the optimizer's own update (SGD step after synchronize): median "
          f"{s['update']:.2f} ms")


def _budget(one, many):
    """Split the mean step's growth from 1 to N ranks into its causes; prints a table."""
    step1, stepn = statistics.fmean(one["wall"]), statistics.fmean(many["wall"])

    def mean_compute(s):
        return statistics.fmean(statistics.fmean(c) for c in s["compute"])
    parts = [
        ("the ranks compute more slowly side by side (machine shared)",
         mean_compute(many) - mean_compute(one)),
        ("waiting for the slower rank's backward (step-time noise)",
         statistics.fmean(many["wait"])),
        ("hora's exchange after backward (N-rank tail - 1-rank tail)",
         statistics.fmean(many["tail"]) - statistics.fmean(one["tail"])),
    ]
    parts.append(("the rest", stepn - step1 - sum(v for _, v in parts)))
    print(f"-- from 1 to {many['ranks']} ranks: mean step {step1:.1f} -> {stepn:.1f} ms, "
          f"scaling efficiency {step1 / stepn:.1%}")
    print("| where the step grew | ms | % of the N-rank step |")
    print("|---|---:|---:|")
    for what, v in parts:
        print(f"| {what} | {v:.2f} | {v / stepn:.1%} |")


def _run(args, np, out):
    cmd = [sys.executable, "-m", "hora", "run", "-np", str(np), "--timeout", "600",
           sys.executable, os.path.abspath(__file__), "--worker", "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--model", args.model,
           "--batch-size", str(args.batch_size), "--out", out]
    if subprocess.call(cmd, cwd=ROOT) != 0:
        return None
    with open(out) as f:
        return _summary(json.load(f))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--model", default="resnet20")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--no-single", action="store_true",
                        help="skip the 1-rank run (and the comparison)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps <= args.warmup + 2:
        parser.error("--steps must exceed --warmup by more than 2")
    if args.worker:
        return _worker(args)
    sizes = [args.np] if args.no_single or args.np == 1 else [1, args.np]
    with tempfile.TemporaryDirectory() as tmp:
        runs = [_run(args, np, os.path.join(tmp, f"np{np}.json")) for np in sizes]
    if None in runs:
        return 1
    for s in runs:
        _report(s)
    if len(runs) == 2:
        _budget(*runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
