#!/usr/bin/env python
"""Small blocking collectives of one host, hora against Open MPI in the same run: allreduce,
barrier, broadcast, allgather, and the object forms, 4-byte payloads.

    python benchmarks/small_collectives.py                  # N = 2 and 4, about 1 minute
    python benchmarks/small_collectives.py --np 2 --launches 5

Three systems, each launched ``--launches`` times, the systems in turn:

- ``hora``: ``hora run -np N``, the default plane (the shared-memory board takes these calls);
- ``hora, engine``: the same with ``HORA_SHM_BOARD=0`` (the engine: a request to rank 0 over
  TCP, its answer, the data over the TCP ring);
- ``Open MPI``: mpi4py under ``mpirun`` (skipped where either is missing): ``Allreduce``,
  ``Barrier``, ``Bcast``, ``Allgather`` on NumPy buffers, and ``bcast`` / ``allgather`` of
  the same small dict for the object rows.

Every rank runs each operation for ``--seconds`` after a warm-up, the ranks lined up by a
barrier; a figure is the slowest rank's mean call, the median over the launches.  The ratio
columns divide by Open MPI's time.  Timings are not assertions: the exit status is 0 when
every launch ran.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

OPS = ["allreduce", "barrier", "broadcast", "allgather", "broadcast_object", "allgather_object"]
OBJ = {"step": 1, "loss": 0.25}


def _hora_ops():
    import hora
    hora.init()
    a = np.ones(1, np.float32)
    calls = {
        "allreduce": lambda: hora.allreduce_(a, op=hora.Sum, name="ar"),
        "barrier": hora.barrier,
        "broadcast": lambda: hora.broadcast(a, 0, name="bc"),
        "allgather": lambda: hora.allgather(a, name="ag"),
        "broadcast_object": lambda: hora.broadcast_object(OBJ, 0, name="bo"),
        "allgather_object": lambda: hora.allgather_object(OBJ, name="ao"),
    }
    return hora.rank(), hora.size(), calls, hora.barrier, hora.shutdown, \
        lambda x: float(hora.allreduce(np.array([x]), op=hora.Max, name="max")[0])


def _mpi_ops():
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    a, out = np.ones(1, np.float32), np.empty(1, np.float32)
    gathered = np.empty(comm.Get_size(), np.float32)
    calls = {
        "allreduce": lambda: comm.Allreduce(a, out, op=MPI.SUM),
        "barrier": comm.Barrier,
        "broadcast": lambda: comm.Bcast(a, 0),
        "allgather": lambda: comm.Allgather(a, gathered),
        "broadcast_object": lambda: comm.bcast(OBJ, 0),
        "allgather_object": lambda: comm.allgather(OBJ),
    }
    return comm.Get_rank(), comm.Get_size(), calls, comm.Barrier, lambda: None, \
        lambda x: comm.allreduce(x, op=MPI.MAX)


def rank_main(system, seconds, out):
    """One rank: time every op; rank 0 writes ``{op: slowest rank's mean µs}`` to ``out``."""
    rank, _, calls, barrier, close, max_of = _hora_ops() if system == "hora" else _mpi_ops()
    got = {}
    try:
        for op in OPS:
            call = calls[op]
            for _ in range(200):
                call()
            # as many calls as rank 0 makes in ``seconds`` (every rank must make the same)
            barrier()
            t0 = time.perf_counter()
            for _ in range(200):
                call()
            per = (time.perf_counter() - t0) / 200
            iters = int(max_of(max(10, seconds / max(per, 1e-7))))
            barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                call()
            got[op] = max_of((time.perf_counter() - t0) / iters * 1e6)
    finally:
        close()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(got, f)


def _launch(system, n, seconds, timeout, mpi=None):
    """One launch of ``system`` on ``n`` ranks: ``{op: µs}``, or None when it cannot run."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        me = [sys.executable, os.path.abspath(__file__), "--rank", "--seconds", str(seconds),
              "--out", out]
        env = dict(os.environ)
        if system == "mpi":
            cmd = [*mpi, "-np", str(n), *me, "--system", "mpi"]
        else:
            cmd = [sys.executable, "-m", "hora", "run", "-np", str(n), *me, "--system", "hora"]
            env["HORA_SHM_BOARD"] = "0" if system == "engine" else "1"
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired as e:
            sys.stderr.write(f"{system} N={n} ran past {timeout:g} s: {e}\n")
            return None
        if proc.returncode != 0 or not os.path.exists(out):
            sys.stderr.write(f"{system} N={n} failed (exit {proc.returncode}):\n"
                             f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}\n")
            return None
        with open(out) as f:
            return json.load(f)


def _mpiexec():
    """``[mpiexec, flags...]`` as ``hora bench`` runs it (Open MPI's flags for root and for
    more ranks than CPUs), or None: no MPI here, or mpi4py missing."""
    import importlib.util

    from hora.bench.jobs import _mpiexec as mpiexec
    return mpiexec() if importlib.util.find_spec("mpi4py") else None


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--np", type=int, nargs="*", default=[2, 4])
    p.add_argument("--launches", type=int, default=3)
    p.add_argument("--seconds", type=float, default=0.3, help="timed seconds per op per launch")
    p.add_argument("--json", default=None, help="write every launch's figures here")
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--system", default="hora", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank:
        rank_main(args.system, args.seconds, args.out)
        return 0
    mpi = _mpiexec()
    systems = ["hora", "engine"] + (["mpi"] if mpi else [])
    if "mpi" not in systems:
        print("Open MPI skipped: mpi4py or mpirun is not installed")
    names = {"hora": "hora", "engine": "hora, engine", "mpi": "Open MPI"}
    ok = True
    record = {}
    for n in args.np:
        runs = {s: [] for s in systems}
        for _ in range(args.launches):
            for s in systems:
                got = _launch(s, n, args.seconds, timeout=60 + 20 * args.seconds * len(OPS),
                              mpi=mpi)
                ok = ok and got is not None
                if got is not None:
                    runs[s].append(got)
        record[n] = runs
        med = {s: {op: statistics.median(r[op] for r in runs[s]) for op in OPS}
               for s in systems if runs[s]}
        print(f"\nN = {n} ({os.cpu_count()} CPUs), µs per call, median of "
              f"{args.launches} launches (each launch's figure in brackets)")
        head = "| op | " + " | ".join(names[s] for s in med)
        if "mpi" in med:
            head += " | hora / Open MPI | engine / Open MPI"
        print(head + " |")
        print("|---" * (head.count("|")) + "|")
        for op in OPS:
            cells = []
            for s in med:
                each = ", ".join(f"{r[op]:.1f}" for r in runs[s])
                cells.append(f"{med[s][op]:.1f} ({each})")
            if "mpi" in med:
                for s in ("hora", "engine"):
                    cells.append(f"{med[s][op] / med['mpi'][op]:.1f}x" if s in med else "")
            print(f"| {op} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
