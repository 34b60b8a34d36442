#!/usr/bin/env python
"""What one address layout saves Python processes that take turns on a CPU, against the
system's randomized layouts, measured side by side in one run.

    python benchmarks/experiments/address_layout.py                       # about 2 minutes
    python benchmarks/experiments/address_layout.py --np 4 --sizes 4,64,1K --launches 3

*Turns*: two fresh Python processes, both pinned to CPU 0, take turns through a word of
shared memory (the one waiting yields its CPU); each turn runs the same few microseconds of
varied Python (``json.dumps``, a generator, a ``Counter``), timed with the thread's CPU
clock.  Then each runs the same work alone, back to back, for comparison.  This happens
twice: once with the system's address-space randomization (each process has its own
layout), and once with both started in the fixed layout that ``hora run`` gives ranks that
outnumber the CPUs (:mod:`hora.runner.proc`: the ``ADDR_NO_RANDOMIZE`` personality).

*hora*: ``hora bench --systems hora mpi`` at ``--np`` ranks, with ``HORA_RANK_ASLR=on``
(every rank randomized) and with the default (``auto``: the fixed layout where the ranks
outnumber the CPUs), the two in turn, ``--launches`` times each; each figure is the median of
the launches' medians, and Open MPI's is the median over every launch of both.

Timings are not assertions: the exit status is 0 when everything ran.
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

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

US = 1e6


def _turns_child(me, path, turns, repeat):
    """One of the two processes: take ``turns`` turns, then do the same work alone."""
    import collections
    os.sched_setaffinity(0, {0})
    with open(path, "r+b") as f:
        word = memoryview(mmap.mmap(f.fileno(), 64)).cast("Q")
    d = {"a": 1, "b": [1, 2, 3]}

    def work():
        s = 0
        for i in range(repeat):
            s += len(json.dumps(d)) + sum(x for x in d["b"]) + len(str(i))
            s += collections.Counter("abcab")["a"]
        return s

    def take(n):
        busy = 0.0
        for _ in range(n):
            while word[0] % 2 != me:
                os.sched_yield()
            t = time.thread_time()
            work()
            busy += time.thread_time() - t
            word[0] += 1
        return busy / n

    take(min(turns, 1000))              # warm up, in step with the other process
    shared = take(turns)
    t = time.thread_time()
    for _ in range(turns):
        work()
    alone = (time.thread_time() - t) / turns
    print(json.dumps([shared, alone]), flush=True)


def turns(fixed, count, repeat):
    """``(work a turn taking turns, work alone)`` in seconds, the mean of both processes."""
    from hora.runner import proc
    with tempfile.NamedTemporaryFile(dir="/dev/shm" if os.path.isdir("/dev/shm") else None,
                                     prefix="hora-turns-") as f:
        f.write(b"\0" * 64)
        f.flush()
        children = [subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--child", str(me), f.name,
             str(count), str(repeat)], stdout=subprocess.PIPE, text=True,
            preexec_fn=proc.parent_death_hook(fixed)) for me in (0, 1)]
        results = [json.loads(c.communicate(timeout=300)[0]) for c in children]
    if any(c.returncode for c in children):
        raise SystemExit("a turns process failed")
    return tuple(statistics.mean(r[i] for r in results) for i in (0, 1))


def bench(np_, sizes, aslr):
    """``{(system, bytes): seconds}`` of one ``hora bench`` launch."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.json")
        cmd = [sys.executable, "-m", "hora", "bench", "--systems", "hora", "mpi", "--sizes",
               sizes, "--np", str(np_), "--launches", "1", "--no-limits", "--no-plot",
               "--json", path]
        env = dict(os.environ)
        env.pop("HORA_RANK_ASLR", None)
        if aslr is not None:
            env["HORA_RANK_ASLR"] = aslr
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if done.returncode != 0 or not os.path.exists(path):
            print(done.stdout[-2000:], done.stderr[-2000:], file=sys.stderr)
            raise SystemExit("hora bench failed")
        with open(path) as f:
            results = json.load(f)["results"]
    return {(system, row["bytes"]): row["time_s"] for system, by_n in results.items()
            for row in by_n.get(str(np_), ()) if row.get("time_s")}


def _size(n):
    return f"{n // 1024} KiB" if n >= 1024 else f"{n} B"


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _turns_child(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=40000, help="turns a process takes")
    p.add_argument("--repeat", type=int, default=1,
                   help="times a turn runs its piece of Python")
    p.add_argument("--np", type=int, default=4, help="hora bench's number of ranks")
    p.add_argument("--sizes", default="4,64,1K,16K,256K", help="hora bench's sizes")
    p.add_argument("--launches", type=int, default=2, help="hora bench launches of each")
    p.add_argument("--no-bench", action="store_true", help="only the turns")
    args = p.parse_args()

    rows = []
    for fixed in (False, True, False, True):
        rows.append((fixed, turns(fixed, args.turns, args.repeat)))
    print(f"Two processes pinned to CPU 0 taking turns ({os.cpu_count()} CPUs here); "
          f"µs of thread CPU time a turn")
    print()
    print("| layout | work a turn, taking turns | the same work alone | taking turns / alone |")
    print("|---|---:|---:|---:|")
    for fixed, (shared, alone) in rows:
        name = "one layout (fixed)" if fixed else "randomized (each its own)"
        print(f"| {name} | {shared * US:.1f} | {alone * US:.1f} | {shared / alone:.2f}x |")
    if args.no_bench:
        return

    got = {"on": [], None: []}
    for _ in range(args.launches):
        for aslr in ("on", None):
            got[aslr].append(bench(args.np, args.sizes, aslr))
    sizes = sorted({b for run in got["on"] + got[None] for (_, b) in run})

    def median(runs, system, b):
        values = [run[system, b] for run in runs if (system, b) in run]
        return statistics.median(values) if values else None

    print()
    print(f"hora bench, N={args.np}, float32 Sum allreduce; µs a call (median of "
          f"{args.launches} launches each)")
    print()
    print("| size | hora, HORA_RANK_ASLR=on | hora, default | Open MPI | on / default "
          "| default / Open MPI |")
    print("|---:|---:|---:|---:|---:|---:|")
    for b in sizes:
        on, auto = median(got["on"], "hora", b), median(got[None], "hora", b)
        mpi = median(got["on"] + got[None], "mpi", b)
        cells = [f"{t * US:,.1f}" if t else "—" for t in (on, auto, mpi)]
        cells.append(f"{on / auto:.2f}x" if on and auto else "—")
        cells.append(f"{auto / mpi:.2f}x" if auto and mpi else "—")
        print(f"| {_size(b)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
