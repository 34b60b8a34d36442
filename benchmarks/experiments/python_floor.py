#!/usr/bin/env python
"""The least a Python rank can spend on a small allreduce of one host, against hora and
Open MPI in the same run: what a latency target for Python ranks can ask.

    python benchmarks/experiments/python_floor.py                 # N = 2 and 4, about 40 s
    python benchmarks/experiments/python_floor.py --np 4 --steps 20000

A *floor* round is the smallest allreduce a Python rank can do, on processes forked from this
one that share one anonymous mapping: each rank writes its float32 into its slot and the
round's number into its word, waits until every rank's word shows the round, and adds the
slots with one NumPy call (a waiter polls; where the ranks outnumber the CPUs it yields its
CPU between looks, as MPI's ranks do then).  It has no checks, no names and no fallback:
nothing a library's call needs beyond the exchange itself.  In the *rank 0 answers* row,
as on hora's board, the other ranks wait instead for rank 0, which waits for every post and
then writes each rank a reply word (and yields once, when crowded).  The *floor + W* rows add W
microseconds of other Python before each post (single-element NumPy additions, timed on
one rank alone beforehand): the rest of a call, hot in the cache.

``hora`` and ``Open MPI`` are ``hora bench --systems hora mpi --sizes 4`` at the same N, run
by this script after the floor rounds (Open MPI is skipped where mpi4py or mpirun is not
installed).  Each figure is the median over the rounds of the slowest rank's mean; the
ratio column is against Open MPI.  Timings are not assertions: the exit status is 0 when
everything ran.
"""
import argparse
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

WORDS = 8                    # int64 words per rank's row: one cache line each
US = 1e6


def _calibrate(k, reps=20000):
    """Microseconds that ``k`` single-element NumPy additions take, hot, on this process."""
    a, b, c = (np.ones(1, np.float32) for _ in range(3))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            for _ in range(k):
                np.add(a, b, out=c)
        best = min(best, (time.perf_counter() - t0) / reps)
    return best * US


def _rank(area, rank, n, steps, work, crowded, rounds, out_fd, answered=False):
    """One forked rank: ``rounds`` timed rounds of ``steps`` floor allreduces each
    (``answered``: rank 0 answers each post, as on the board)."""
    words = np.frombuffer(area, dtype=np.int64, count=2 * n * WORDS)
    posts = words[:n * WORDS:WORDS]
    replies = words[n * WORDS::WORDS]
    others = posts[1:]
    data = np.frombuffer(area, dtype=np.float32, count=n * 16, offset=4096)[::16]
    mine = np.ones(1, np.float32)
    acc = np.zeros((), np.float32)
    a, b, c = (np.ones(1, np.float32) for _ in range(3))
    yield_cpu = os.sched_yield
    seq = 0
    times = []
    for r in range(rounds + 1):
        t0 = time.perf_counter()
        for _ in range(steps):
            for _ in range(work):
                np.add(a, b, out=c)
            seq += 1
            data[rank] = mine[0]
            posts[rank] = seq
            if not answered:
                while posts.min() < seq:
                    if crowded:
                        yield_cpu()
            elif rank == 0:
                while others.min() < seq:
                    if crowded:
                        yield_cpu()
                replies[1:] = seq
                if crowded:             # (the board's rank 0 yields once after answering)
                    yield_cpu()
            else:
                while replies[rank] < seq:
                    if crowded:
                        yield_cpu()
            np.add.reduce(data, out=acc)
            if acc != n:
                raise SystemExit(f"rank {rank}: sum {acc} != {n}")
        if r:                                   # the first round warms up
            times.append((time.perf_counter() - t0) / steps)
    os.write(out_fd, json.dumps(times).encode() + b"\n")


def floor(n, steps, work, rounds, answered=False):
    """The floor round's median time (seconds) over ``rounds``, on ``n`` forked ranks with
    ``work`` additions before each post (``answered``: rank 0 answers each post): of each
    round, the slowest rank's mean."""
    area = mmap.mmap(-1, 8192)                  # shared with the children by fork
    crowded = n > (os.cpu_count() or 1)
    read_fd, write_fd = os.pipe()
    pids = []
    for rank in range(n):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(read_fd)
                _rank(area, rank, n, steps, work, crowded, rounds, write_fd, answered)
                code = 0
            finally:
                os._exit(code)
        pids.append(pid)
    os.close(write_fd)
    with os.fdopen(read_fd) as f:
        per_rank = [json.loads(line) for line in f]
    failed = [pid for pid in pids if os.waitpid(pid, 0)[1] != 0]
    if failed or len(per_rank) != n:
        raise SystemExit(f"floor N={n}: {len(failed)} rank(s) failed")
    return statistics.median(max(ts) for ts in zip(*per_rank))


def peers(nps):
    """``{(system, n): seconds}`` of ``hora bench``'s 4 B allreduce for hora and Open MPI."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.json")
        cmd = [sys.executable, "-m", "hora", "bench", "--systems", "hora", "mpi", "--sizes",
               "4", "--np", *map(str, nps), "--no-limits", "--no-plot", "--json", path]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not os.path.exists(path):
            print(proc.stdout[-2000:], proc.stderr[-2000:], file=sys.stderr)
            raise SystemExit("hora bench failed")
        with open(path) as f:
            results = json.load(f)["results"]
    out = {}
    for system, by_n in results.items():
        for n, rows in by_n.items():
            for row in rows:
                if row.get("bytes") == 4 and row.get("time_s"):
                    out[system, int(n)] = row["time_s"]
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--np", type=int, nargs="+", default=[2, 4], help="numbers of ranks")
    p.add_argument("--steps", type=int, default=10000, help="floor allreduces per round")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per row")
    p.add_argument("--work", type=int, nargs="+", default=[4, 10, 20],
                   help="NumPy additions of the 'floor + W' rows")
    p.add_argument("--no-peers", action="store_true", help="skip hora bench (hora, Open MPI)")
    args = p.parse_args()

    rows = [("floor", 0), ("floor, rank 0 answers", 0)] + [
        (f"floor + {_calibrate(k):.1f} us of Python", k) for k in args.work]
    table = {(label, n): floor(n, args.steps, k, args.rounds, label.endswith("answers"))
             for label, k in rows for n in args.np}
    measured = {} if args.no_peers else peers(args.np)
    for system, label in (("hora", "hora (hora bench)"), ("mpi", "Open MPI (hora bench)")):
        for n in args.np:
            if (system, n) in measured:
                table[label, n] = measured[system, n]
        rows.append((label, None))

    cpus = os.cpu_count()
    print(f"4 B float32 Sum allreduce, one host, {cpus} CPUs; µs per call (ratio to Open MPI)")
    print()
    print("| | " + " | ".join(f"N={n}" for n in args.np) + " |")
    print("|---|" + "---:|" * len(args.np))
    for label, _ in rows:
        cells = []
        for n in args.np:
            t = table.get((label, n))
            mpi = table.get(("Open MPI (hora bench)", n))
            if t is None:
                cells.append("—")
            elif mpi:
                cells.append(f"{t * US:.1f} ({t / mpi:.1f}x)")
            else:
                cells.append(f"{t * US:.1f}")
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
