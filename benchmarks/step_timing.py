#!/usr/bin/env python
"""Where a data-parallel training step's time goes: 2 ranks of hora's DistributedOptimizer.

    python benchmarks/step_timing.py                 # ResNet-20, 2 ranks, 80 steps
    python benchmarks/step_timing.py --steps 200 --np 2

Launches itself with ``hora run`` (``--worker`` is the per-rank side).  Every rank records,
for each step, the monotonic clock (one clock for every process of the host) at the start,
at the end of ``backward()`` and at the end of ``optimizer.step()``, on the model of
``examples/pytorch_synthetic_benchmark.py`` (one torch thread per rank).  Rank 0 gathers
them and prints, over the steps after the warm-up:

- each rank's forward+backward time (median, standard deviation);
- the skew: how far apart the ranks end their backward passes (what the first waits for);
- the tail: from the end of the *last* rank's backward to the moment both ranks have
  finished ``step()`` -- the reduction that backward did not hide, plus the optimizer's own
  update, which the last line measures alone (the wrapped optimizer's ``step()`` after
  ``synchronize()``) so that the difference is what hora adds;
- the same from the moment autograd produced the last rank's last gradient, which also
  counts what hora's gradient hooks do inside ``backward()``.
"""
import argparse
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    every = hvd.allgather_object((marks, updates), name="step_timing")
    if hvd.rank() == 0:
        _report(every, args.warmup)
    hvd.shutdown()


def _report(every, warmup):
    ms = 1e3
    marks = [m[warmup:] for m, _ in every]
    for rank, (m, _) in enumerate(every):
        compute = [(t1 - t0) * ms for t0, t1, _, _ in m[warmup:]]
        print(f"rank {rank}: forward+backward median {statistics.median(compute):.1f} ms, "
              f"sd {statistics.stdev(compute):.1f} ms")
    steps = list(zip(*marks))
    skew = [(max(s[1] for s in step) - min(s[1] for s in step)) * ms for step in steps]
    tail = [(max(s[2] for s in step) - max(s[1] for s in step)) * ms for step in steps]
    from_grads = [(max(s[2] for s in step) - max(s[3] for s in step)) * ms for step in steps]
    wall = [(b[0][0] - a[0][0]) * ms for a, b in zip(steps, steps[1:])]
    update = statistics.median(u * ms for _, ups in every for u in ups[warmup:])
    print(f"step: median {statistics.median(wall):.1f} ms")
    print(f"skew between the ranks' ends of backward: median {statistics.median(skew):.1f} "
          f"ms, mean {statistics.mean(skew):.1f} ms")
    print(f"tail, last rank's end of backward -> every rank's step done: median "
          f"{statistics.median(tail):.2f} ms, mean {statistics.mean(tail):.2f} ms")
    print(f"from the last rank's last gradient (autograd done with it) -> every rank's step "
          f"done: median {statistics.median(from_grads):.2f} ms, mean "
          f"{statistics.mean(from_grads):.2f} ms")
    print(f"of which the optimizer's own update (SGD step after synchronize): median "
          f"{update:.2f} ms")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--model", default="resnet20")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps <= args.warmup + 2:
        parser.error("--steps must exceed --warmup by more than 2")
    if args.worker:
        return _worker(args)
    cmd = [sys.executable, "-m", "hora", "run", "-np", str(args.np), "--timeout", "600",
           sys.executable, os.path.abspath(__file__), "--worker", "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--model", args.model,
           "--batch-size", str(args.batch_size)]
    return subprocess.call(cmd, cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main())
