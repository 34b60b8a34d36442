#!/usr/bin/env python
"""What one small allreduce costs through hora.jax: inside ``jax.jit``, eagerly, and on hora's
NumPy API, on N ranks of one host.

    python benchmarks/jax_call_cost.py                       # N = 2, 4 B, about 30 s
    python benchmarks/jax_call_cost.py --sizes 4 1048576     # also 1 MiB
    python benchmarks/jax_call_cost.py --round-s 0.1 --rounds 3          # smoke run

Launches itself with ``hora run`` (``--worker`` is the per-rank side).  Every rank times a
float32 ``Sum`` allreduce of the same buffer, called in a loop, through:

- ``numpy``: ``hora.allreduce(array)``, hora's core API (the floor for the others);
- ``eager``: ``hvd.allreduce(jax_array)`` outside any trace;
- ``jit``: a jitted function holding one ``hvd.allreduce`` (one ordered ``io_callback``),
  called and waited for (``block_until_ready``) once per allreduce;
- ``jit x8``: eight allreduces in one jitted function, the time per allreduce;

and two references that involve no other rank: ``jit, no collective`` (the same function
with ``x + 0``: what a jitted call costs) and ``jit, io_callback identity`` (an ordered
``io_callback`` returning its input: the hop from XLA into Python and back).

Each path warms up, then rank 0 picks the number of calls that takes about ``--round-s`` and
every rank runs ``--rounds`` rounds of that many calls, each after a barrier.  A round's time
per call is the slowest rank's mean; the table shows the median over rounds and its ratio to
the ``numpy`` row.  Timings are not assertions: the exit status is 0 when the job ran.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from _timing import time_rounds  # the benchmarks folder is sys.path[0]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATHS = ["numpy", "eager", "jit", "jit x8", "jit, no collective", "jit, io_callback identity"]
PER_FUNCTION = 8
US = 1e6


def _callers(tag, nbytes):
    """path -> (a function doing one call, the allreduces it does)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import io_callback

    import hora
    import hora.jax as hvd
    array = np.ones(max(1, nbytes // 4), dtype=np.float32)
    x = jnp.asarray(array)
    one = jax.jit(lambda x: hvd.allreduce(x, op=hvd.Sum, name=f"{tag}.jit"))
    many = jax.jit(lambda x: [hvd.allreduce(x, op=hvd.Sum, name=f"{tag}.jit{k}")
                              for k in range(PER_FUNCTION)])
    plain = jax.jit(lambda x: x + 0)
    hop = jax.jit(lambda x: io_callback(lambda a: a, jax.ShapeDtypeStruct(x.shape, x.dtype),
                                        x, ordered=True))
    return {
        "numpy": (lambda: hora.allreduce(array, op=hora.Sum, name=f"{tag}.numpy"), 1),
        "eager": (lambda: hvd.allreduce(x, op=hvd.Sum, name=f"{tag}.eager")
                  .block_until_ready(), 1),
        "jit": (lambda: one(x).block_until_ready(), 1),
        "jit x8": (lambda: jax.block_until_ready(many(x)), PER_FUNCTION),
        "jit, no collective": (lambda: plain(x).block_until_ready(), 1),
        "jit, io_callback identity": (lambda: hop(x).block_until_ready(), 1),
    }


def _worker(args):
    import hora
    hora.init()
    times = {}
    for nbytes in args.sizes:
        for path, (call, per) in _callers(f"cost{nbytes}", nbytes).items():
            _, rounds = time_rounds(hora, call, per, f"{path}.{nbytes}", args.warmup,
                                    args.rounds, args.round_s)
            times[f"{path}|{nbytes}"] = rounds
    every = hora.allgather_object(times, name="jax_call_cost")
    if hora.rank() == 0:
        with open(args.out, "w") as f:
            json.dump(every, f)
    hora.shutdown()
    return 0


def _label(nbytes):
    return f"{nbytes} B" if nbytes < 1024 else f"{nbytes / (1 << 20):g} MiB"


def _table(every, sizes):
    medians = {key: statistics.median(max(r[key][i] for r in every)
                                      for i in range(len(every[0][key])))
               for key in every[0]}
    lines = ["| path | " + " | ".join(f"{_label(s)} µs/call | vs numpy" for s in sizes) + " |",
             "|---|" + "---:|---:|" * len(sizes)]
    for path in PATHS:
        cells = []
        for s in sizes:
            t, base = medians[f"{path}|{s}"], medians[f"numpy|{s}"]
            cells += [f"{t * US:.1f}", f"{t / base:.2f}x"]
        lines.append(f"| {path} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--sizes", type=int, nargs="+", default=[4], help="bytes")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--round-s", type=float, default=0.4,
                        help="about how long one round of calls takes")
    parser.add_argument("--warmup", type=int, default=20, help="calls before timing")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return _worker(args)
    env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2",
               XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
    with tempfile.TemporaryDirectory(prefix="hora-jax-cost-") as tmp:
        out = os.path.join(tmp, "every.json")
        cmd = [sys.executable, "-m", "hora", "run", "-np", str(args.np), "--timeout", "600",
               sys.executable, os.path.abspath(__file__), "--worker", "--out", out,
               "--rounds", str(args.rounds), "--round-s", str(args.round_s),
               "--warmup", str(args.warmup), "--sizes", *map(str, args.sizes)]
        load = os.getloadavg()[0]
        if subprocess.call(cmd, cwd=ROOT, env=env) != 0:
            return 1
        with open(out) as f:
            every = json.load(f)
    print(f"allreduce (float32 Sum) per call, N = {args.np}, one host, {os.cpu_count()} CPUs "
          f"(load {load:.1f} at start), XLA one thread per rank; median of {args.rounds} "
          f"rounds of the slowest rank's mean\n")
    print(_table(every, args.sizes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
