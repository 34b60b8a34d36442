#!/usr/bin/env python
"""Where a small allreduce across hosts spends its CPU: each rank's CPU time per call, under
``hora run`` and under ``mpirun``, 2 network-namespace hosts x 2 ranks on this machine.

    sudo python benchmarks/experiments/multihost_cpu.py [--calls 10000] [--launches 3] [--bytes 4]
                                                        [--per-host 2 | --layout 2,1]

Same hosts and launchers as ``allreduce_multihost.py`` (real sshds, Open MPI's ranks yielding
while they wait).  Each rank warms up, then times ``--calls`` back-to-back allreduces of
``--bytes`` bytes of float32 in place (``hora.allreduce_``; mpi4py's ``Allreduce`` with
``IN_PLACE``) and reads ``getrusage`` of its own thread around them.  Printed per launch and
rank: wall time, user and system CPU, and voluntary (sleeps) and involuntary (preempted or
yielding) context switches, per call; then the ranks' CPU per call summed, and that sum over
the machine's CPUs.  When that last figure is close to the wall time, the CPUs are saturated
and a call can take no less than the ranks' CPU divided among the CPUs: less CPU per call is
then the only way to a shorter round.
"""
import os
import sys

if len(sys.argv) > 1 and sys.argv[1] == "--rank":     # one rank of the job
    import resource
    import time

    import numpy as np

    system, calls, nbytes = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    x = np.ones(max(1, nbytes // 4), np.float32)
    if system == "hora":
        import hora
        hora.init()
        rank = hora.rank()

        def call():
            hora.allreduce_(x, op=hora.Sum, name="cpu")

        barrier = hora.barrier
    else:
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        rank = comm.Get_rank()

        def call():
            comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)

        barrier = comm.Barrier
    for _ in range(min(2000, calls)):
        call()
    barrier()
    a, t0 = resource.getrusage(resource.RUSAGE_THREAD), time.perf_counter()
    for _ in range(calls):
        call()
    t1, b = time.perf_counter(), resource.getrusage(resource.RUSAGE_THREAD)
    us = 1e6 / calls
    print(f"CPU {rank} {(t1 - t0) * us:.1f} {(b.ru_utime - a.ru_utime) * us:.1f} "
          f"{(b.ru_stime - a.ru_stime) * us:.1f} {(b.ru_nvcsw - a.ru_nvcsw) / calls:.2f} "
          f"{(b.ru_nivcsw - a.ru_nivcsw) / calls:.2f}", flush=True)
    sys.exit(0)

import argparse  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402

BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(BENCHMARKS)
sys.path[:0] = [BENCHMARKS, ROOT]     # allreduce_multihost and its _cpu; hora and tests
from allreduce_multihost import (PER_HOST, hora_launcher, mpi_launcher,  # noqa: E402
                                 prepare, remove_mpi_segments, require_sshd)
from hora.bench import jobs  # noqa: E402
from tests import netns  # noqa: E402

_LINE = re.compile(r"CPU (\d+) ([\d.]+) ([\d.]+) ([\d.]+) ([\d.]+) ([\d.]+)")


def launch(argv, n, timeout):
    """Run one job of ``n`` ranks; ``{rank: (wall, user, sys, voluntary, involuntary)}`` per
    call."""
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                       stdin=subprocess.DEVNULL, env=jobs._worker_env())
    found = {int(m[1]): tuple(float(v) for v in m.groups()[1:])
             for m in _LINE.finditer(p.stdout)}
    if p.returncode or len(found) != n:
        raise SystemExit(f"{argv[0]} failed (exit {p.returncode}):\n{p.stdout[-2000:]}\n"
                         f"{p.stderr[-3000:]}")
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=10000)
    parser.add_argument("--launches", type=int, default=3, help="of each system, alternating")
    parser.add_argument("--bytes", type=int, default=4)
    parser.add_argument("--per-host", type=int, default=PER_HOST,
                        help=f"ranks on each of the 2 hosts (default {PER_HOST})")
    parser.add_argument("--layout", help="the ranks on each host, e.g. '2,1' (instead of "
                                           "--per-host: hosts of different sizes)")
    args = parser.parse_args()
    counts = ((args.per_host, args.per_host) if args.layout is None
              else tuple(int(c) for c in args.layout.split(",")))
    if len(counts) != 2 or min(counts) < 1:
        parser.error("two hosts of at least 1 rank each")
    n = sum(counts)
    prepare()
    rank_argv = [sys.executable, os.path.abspath(__file__), "--rank"]
    cpus = os.cpu_count()
    print(f"allreduce_ of {args.bytes} B, {n} ranks on 2 network-namespace hosts "
          f"({counts[0]} + {counts[1]}), {cpus} "
          f"CPUs, {args.calls} calls a launch; per call, µs (switches: count per call)\n")
    print("| system | launch | rank | wall | user | sys | sleeps | preempted/yields |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    summary = []
    with netns.Cluster(["ok", "ok"]) as cluster:
        require_sshd(cluster)
        runners = {"hora": hora_launcher(cluster, 240, counts),
                   "mpi": mpi_launcher(cluster, per_host=counts)}
        try:
            for i in range(args.launches):
                for system in (("hora", "mpi") if i % 2 == 0 else ("mpi", "hora")):
                    found = launch([*runners[system](n), *rank_argv, system, str(args.calls),
                                    str(args.bytes)], n, timeout=240)
                    for r in sorted(found):
                        w, u, s, vol, inv = found[r]
                        print(f"| {system} | {i + 1} | {r} | {w:.1f} | {u:.1f} | {s:.1f} | "
                              f"{vol:.2f} | {inv:.2f} |")
                    wall = max(v[0] for v in found.values())
                    cpu = sum(v[1] + v[2] for v in found.values())
                    summary.append((system, i + 1, wall, cpu))
        finally:
            remove_mpi_segments(cluster)
    print(f"\n| system | launch | wall a call (µs) | the ranks' CPU a call (µs) | "
          f"that over {cpus} CPUs (µs) |")
    print("|---|---:|---:|---:|---:|")
    for system, i, wall, cpu in summary:
        print(f"| {system} | {i} | {wall:.1f} | {cpu:.1f} | {cpu / cpus:.1f} |")


if __name__ == "__main__":
    main()
