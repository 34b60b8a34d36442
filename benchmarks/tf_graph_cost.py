#!/usr/bin/env python
"""What one allreduce costs through hora.tensorflow: inside ``tf.function``, eagerly, and on
hora's NumPy API, at 4 B and 1 MiB (and for a training step's gradients), on N ranks of one
host.

    python benchmarks/tf_graph_cost.py                  # N = 2, about a minute
    python benchmarks/tf_graph_cost.py --round-s 0.1 --rounds 3       # smoke run
    python benchmarks/tf_graph_cost.py --np 2 --json /tmp/tf_graph_cost.json

Launches itself with ``hora run`` (``--worker`` is the per-rank side).  Every rank times a
float32 ``Sum`` allreduce of the same buffer, called in a loop, and also the grouped
allreduce of one tensor per trainable variable of the synthetic benchmark's ResNet-20 (65
tensors, 1.09 MB: what ``DistributedGradientTape`` reduces every step), through:

- ``numpy``: ``hora.allreduce(array)`` (``hora.grouped_allreduce``), hora's core API (the
  floor for the others);
- ``eager``: ``hvd.allreduce(tensor)`` outside any function: the tensor becomes an array,
  the core reduces it, the result becomes a tensor;
- ``tf.function``: a ``tf.function(jit_compile=False)`` holding one ``hvd.allreduce``,
  called once per allreduce: the graph path of a training step (a ``tf.numpy_function``
  node calling the core), with the function call around it;
- ``tf.function x8``: eight allreduces in one function, the time per allreduce: the graph
  path with the function call's cost shared out.

and, for reading the table, two references that involve no other rank:

- ``tf.function, no collective``: the same function with ``tf.identity`` in place of the
  allreduce (what calling a ``tf.function`` costs);
- ``tf.function, numpy_function identity``: the same with a ``tf.numpy_function`` that
  returns its input (what the hop from the graph into Python and back costs).

Each (path, size) warms up, then rank 0 picks the number of calls that takes about
``--round-s`` and every rank runs ``--rounds`` rounds of that many calls, each after a
barrier.  A round's time per call is the slowest rank's mean, and the table shows the median
over rounds and its ratio to the ``numpy`` row at the same size.  Timings are not
assertions: the exit status is 0 when the job ran.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from _timing import time_rounds  # the benchmarks folder is sys.path[0]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = {"4 B": [(1,)], "1 MiB": [(1 << 18,)],  # label -> the shapes of the float32 tensors
         "ResNet-20 grads": None}                # the example's trainable variables
PATHS = ["numpy", "eager", "tf.function", "tf.function x8",
         "tf.function, no collective", "tf.function, numpy_function identity"]
PER_FUNCTION = 8                                 # allreduces in the "x8" function
US = 1e6


def _resnet20_shapes():
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from tensorflow2_synthetic_benchmark import cifar_resnet
    return [tuple(v.shape) for v in cifar_resnet(3, 32, 10).trainable_variables]


def _callers(tag, shapes):
    """path -> a function doing one call (or PER_FUNCTION calls), and the calls it does.  One
    shape: ``allreduce``; several: ``grouped_allreduce`` of them all."""
    import numpy as np
    import tensorflow as tf

    import hora
    import hora.tensorflow as hvd
    arrays = [np.ones(s, dtype=np.float32) for s in shapes]
    tensors = [tf.constant(a) for a in arrays]
    if len(shapes) == 1:
        def numpy_op(name):
            return hora.allreduce(arrays[0], op=hora.Sum, name=name)

        def tf_op(xs, name):
            return hvd.allreduce(xs[0], op=hvd.Sum, name=name)
    else:
        def numpy_op(name):
            return hora.grouped_allreduce(arrays, op=hora.Sum, name=name)

        def tf_op(xs, name):
            return hvd.grouped_allreduce(xs, op=hvd.Sum, name=name)

    @tf.function(jit_compile=False)
    def graph_one(xs):
        return tf_op(xs, f"{tag}_graph")

    @tf.function(jit_compile=False)
    def graph_many(xs):
        return [tf_op(xs, f"{tag}_graph{k}") for k in range(PER_FUNCTION)]

    @tf.function(jit_compile=False)
    def graph_identity(xs):
        return [tf.identity(x) for x in xs]

    @tf.function(jit_compile=False)
    def graph_numpy_identity(xs):
        outs = tf.numpy_function(lambda *a: list(a), xs, [tf.float32] * len(xs), stateful=True)
        for o, x in zip(outs, xs):
            o.set_shape(x.shape)
        return outs

    return {
        "numpy": (lambda: numpy_op(f"{tag}_numpy"), 1),
        "eager": (lambda: tf_op(tensors, f"{tag}_eager"), 1),
        "tf.function": (lambda: graph_one(tensors), 1),
        "tf.function x8": (lambda: graph_many(tensors), PER_FUNCTION),
        "tf.function, no collective": (lambda: graph_identity(tensors), 1),
        "tf.function, numpy_function identity": (lambda: graph_numpy_identity(tensors), 1),
    }


def _worker(args):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(args.inter_threads)

    import hora
    hora.init()
    times = {}                          # "path|size" -> per-call seconds of every round
    for k, (label, shapes) in enumerate(SIZES.items()):
        for path, (call, per) in _callers(f"cost{k}", shapes or _resnet20_shapes()).items():
            calls, rounds = time_rounds(hora, call, per, f"{path}.{label}", args.warmup,
                                        args.rounds, args.round_s)
            times[f"{path}|{label}"] = {"calls": calls * per, "rounds": rounds}
    every = hora.allgather_object(times, name="tf_graph_cost")
    if hora.rank() == 0:
        with open(args.out, "w") as f:
            json.dump(every, f)
    hora.shutdown()
    return 0


def _table(every):
    """Median over rounds of the slowest rank's time per call, and the ratio to numpy."""
    medians = {}
    for key in every[0]:
        slowest = [max(r[key]["rounds"][i] for r in every)
                   for i in range(len(every[0][key]["rounds"]))]
        medians[key] = statistics.median(slowest)
    lines = ["| path | " + " | ".join(f"{s} µs/call | {s} vs numpy" for s in SIZES) + " |",
             "|---|" + "---:|---:|" * len(SIZES)]
    for path in PATHS:
        cells = []
        for label in SIZES:
            t, base = medians[f"{path}|{label}"], medians[f"numpy|{label}"]
            cells += [f"{t * US:.1f}", f"{t / base:.2f}x"]
        lines.append(f"| {path} | " + " | ".join(cells) + " |")
    return medians, "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--round-s", type=float, default=0.4,
                        help="about how long one round of calls takes")
    parser.add_argument("--warmup", type=int, default=20, help="calls before timing")
    parser.add_argument("--inter-threads", type=int, default=1,
                        help="TensorFlow inter-op threads per rank (intra-op: 1)")
    parser.add_argument("--json", metavar="PATH", help="write every round's times here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return _worker(args)
    with tempfile.TemporaryDirectory(prefix="hora-tf-cost-") as tmp:
        out = os.path.join(tmp, "every.json")
        cmd = [sys.executable, "-m", "hora", "run", "-np", str(args.np), "--timeout", "600",
               sys.executable, os.path.abspath(__file__), "--worker", "--out", out,
               "--rounds", str(args.rounds), "--round-s", str(args.round_s),
               "--warmup", str(args.warmup), "--inter-threads", str(args.inter_threads)]
        load = os.getloadavg()[0]
        started = time.monotonic()
        if subprocess.call(cmd, cwd=ROOT) != 0:
            return 1
        with open(out) as f:
            every = json.load(f)
    medians, table = _table(every)
    print(f"allreduce (float32 Sum) per call, N = {args.np}, one host, {os.cpu_count()} CPUs, "
          f"TensorFlow 1 intra-op / {args.inter_threads} inter-op thread(s); median of "
          f"{args.rounds} rounds of the slowest rank's mean\n")
    print(table)
    print(f"\nload average (1 min) {load:.2f} before the run; "
          f"{time.monotonic() - started:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"np": args.np, "medians_s": medians, "every_rank": every}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
