#!/usr/bin/env python
"""What seeing a job costs: ResNet-20 training at N=2 with the timeline and the metrics on.

    python benchmarks/observability_cost.py                      # 5 rounds (~4 minutes)
    python benchmarks/observability_cost.py --baseline-tree /tmp/hora-before

Runs ``examples/pytorch_synthetic_benchmark.py`` (ResNet-20, 32 images a rank a step, one
torch thread a rank) under ``hora run -np 2`` as:

- ``off``: neither the timeline nor the metrics writer (the counters behind
  ``hora.metrics()`` always run);
- ``timeline``: ``HORA_TIMELINE`` (rank 0 writes every rank's events);
- ``metrics``: ``HORA_METRICS_DIR`` with a write every second;
- ``both``;
- ``baseline`` (with ``--baseline-tree DIR``): the same benchmark on another checkout of hora
  (a ``git worktree`` of the commit before the timeline, say), to show that with both off
  the engine costs what it did.

Each round runs every configuration once, in an order that alternates; the table is the
median over rounds of the images per second (both ranks) and its ratio to ``off``.  One
timeline of the last round is summarized with ``hora timeline`` (``--plot`` writes its
picture, default benchmarks/figures/timeline_summary.png).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _run(tree, env_extra, tmp, name):
    out = os.path.join(tmp, f"result-{name}.json")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HORA_", "HOROVOD_"))}
    env.update(env_extra)
    env["PYTHONPATH"] = tree
    env["OMP_NUM_THREADS"] = "1"
    argv = [sys.executable, "-m", "hora", "run", "-np", "2", sys.executable,
            os.path.join(tree, "examples", "pytorch_synthetic_benchmark.py"), "--model",
            "resnet20", "--num-iters", "6", "--num-batches-per-iter", "10", "--json", out]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600,
                          stdin=subprocess.DEVNULL, cwd=tree)
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{done.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)["img_sec_total"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--baseline-tree", help="another hora checkout to run as 'baseline'")
    parser.add_argument("--plot", default=os.path.join(HERE, "figures",
                                                       "timeline_summary.png"))
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "trace.json")
        configs = [("off", ROOT, {}),
                   ("timeline", ROOT, {"HORA_TIMELINE": trace}),
                   ("metrics", ROOT, {"HORA_METRICS_DIR": os.path.join(tmp, "tb"),
                                      "HORA_METRICS_PERIOD": "1"}),
                   ("both", ROOT, {"HORA_TIMELINE": trace,
                                   "HORA_METRICS_DIR": os.path.join(tmp, "tb2"),
                                   "HORA_METRICS_PERIOD": "1"})]
        if args.baseline_tree:
            configs.append(("baseline", os.path.abspath(args.baseline_tree), {}))
        for i in range(args.rounds):
            order = configs if i % 2 == 0 else configs[::-1]
            for name, tree, env in order:
                results.setdefault(name, []).append(_run(tree, env, tmp, name))
            print(f"round {i + 1}: " + ", ".join(f"{n} {results[n][-1]:.1f}"
                                                 for n, _, _ in configs), flush=True)
        off = statistics.median(results["off"])
        print(f"\nResNet-20, N=2, images/s (both ranks), median of {args.rounds} rounds "
              f"({os.cpu_count()} CPUs)\n")
        print("| configuration | img/s | min-max | vs off |")
        print("|---|---|---|---|")
        for name, _, _ in configs:
            values = results[name]
            med = statistics.median(values)
            print(f"| {name} | {med:.1f} | {min(values):.1f}-{max(values):.1f} | "
                  f"{med / off:.3f} |")
        size = os.path.getsize(trace)
        print(f"\none timeline ({size / 1e6:.1f} MB):\n", flush=True)
        subprocess.run([sys.executable, "-m", "hora", "timeline", trace, "--top", "12",
                        *(["--plot", args.plot] if args.plot else [])],
                       env=dict(os.environ, PYTHONPATH=ROOT), check=True)


if __name__ == "__main__":
    main()
