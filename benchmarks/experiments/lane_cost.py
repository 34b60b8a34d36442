#!/usr/bin/env python
"""What one call through a lane costs a rank on its own: ``hora.allreduce_`` of a small
float32 array on a board of ``--np`` ranks, as rank 1 (a worker: its post, rank 0's answer,
its fold) and as rank 0 (its stage, the check of the posts, its answers, its fold), in this
one process, the other ranks' words written by hand before each call.  No second process
and no scheduler: what is left is the call's own Python and NumPy.

    python benchmarks/experiments/lane_cost.py                   # 16 float32 Sum, N = 4
    python benchmarks/experiments/lane_cost.py --count 1         # one number (Python floats)
    python benchmarks/experiments/lane_cost.py --no-valgrind     # microseconds only

It prints microseconds a call (timeit, the best of 7 blocks) and, where valgrind is
installed, instructions a call (callgrind: two runs of 1,000 and 51,000 calls, the
difference over 50,000).  Where ranks outnumber the CPUs every rank's call lengthens each
round, and launches of a job on a shared machine spread too widely to see a change of a few
percent (docs/performance-notes.md); the instruction count is the same run after
run, whatever else the machine does.  The engine around the call is a stand-in port
(``_calls``) whose engine has nothing under way and takes no call of its own.
"""
import argparse
import mmap
import os
import subprocess
import sys
import threading
import time
import timeit
import types

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import hora                                     # noqa: E402
from hora.backends import board_segment as S    # noqa: E402
from hora.core import state                     # noqa: E402
from hora.core.engine import board as B         # noqa: E402
from hora.core.engine.board_calls import BoardCalls     # noqa: E402
from hora.core.engine.board_port import Port    # noqa: E402
from hora.core.engine.lanes import make_lane    # noqa: E402
from hora.core.messages import ALLREDUCE, Request, Sum    # noqa: E402


def _refused(*args):
    raise AssertionError("the stand-in engine takes no call of its own")


def _calls(board, size):
    """The board's calls of a running job whose engine has nothing under way, through a
    stand-in port."""
    port = Port(taking=lambda: True, running=lambda: True, busy=lambda: False,
                step=lambda: False, idle=_refused, crashed=_refused, nudge=lambda: None,
                drive=threading.Lock(), inflight={}, take_name=_refused, release=_refused,
                to_engine=_refused, every_rank_came=lambda now: None, side=None,
                clock=time.monotonic, spin_s=1e-3, crowded=True)
    return BoardCalls(board, port, size, board.rank)


def make_call(rank, size, count):
    """``call()``: one ``hora.allreduce_`` through its lane as ``rank``, the other ranks'
    part written first."""
    board = B.Board(mmap.mmap(-1, S.board_bytes(size)), rank, size, spin_s=1e-3,
                    crowded=True)
    x = np.zeros(count, np.float32)
    calls = _calls(board, size)
    req = Request("lane", ALLREDUCE, x.dtype.str, (x.shape,), Sum, -1, 1.0, 1.0, None, 0, "")
    sig = board.signature(req)
    calls.lanes["lane"] = make_lane(board, req, sig, x.nbytes, x.dtype, x.shape)
    state._ctx = types.SimpleNamespace(engine=types.SimpleNamespace(
        lanes=calls.lanes, lane_now=calls.lane_call))
    w = board.w
    if rank:
        reply = rank * S.ROW + S.REPLY

        def others():               # rank 0's answer to the coming post, ahead of it
            w[reply] = ((board.seq + 1) << S.ANSWER_BITS) | S.SHARED
    else:
        S.os = types.SimpleNamespace(sched_yield=lambda: None)   # alone: yield to nobody
        rows = [r * S.ROW for r in range(1, size)]
        for at in rows:             # every worker's signature, as rank 0 read it once
            w[at + S.SIGVER] = 1
            w[at + S.NBYTES] = x.nbytes
        board.known[1:] = [(1, sig)] * (size - 1)
        nxt = board.next

        def others():               # every worker's next post
            seq = nxt[1]
            for at in rows:
                w[at + S.POST] = seq
    op = hora.Sum

    def call():
        others()
        hora.allreduce_(x, op=op, name="lane")
    return call, others


def _child(rank, size, count, calls):
    call, _ = make_call(rank, size, count)
    for _ in range(calls):
        call()


def _instructions(rank, size, count):
    """Instructions a call (callgrind), or None where valgrind is not installed."""
    counts = []
    for calls in (1000, 51000):
        cmd = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable,
               os.path.abspath(__file__), "--child", str(rank), str(size), str(count),
               str(calls)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                                  env={**os.environ, "PYTHONHASHSEED": "0"})
        except FileNotFoundError:
            return None
        line = [ln for ln in done.stderr.splitlines() if "Collected :" in ln]
        if done.returncode or not line:
            raise RuntimeError(f"callgrind failed: {done.stderr[-2000:]}")
        counts.append(int(line[-1].split(":")[-1]))
    return (counts[1] - counts[0]) / 50000


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--np", type=int, default=4, help="ranks on the board (default 4)")
    p.add_argument("--count", type=int, default=16, help="float32 elements (default 16)")
    p.add_argument("--no-valgrind", action="store_true", help="microseconds only")
    p.add_argument("--child", nargs=4, type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        _child(*args.child)
        return 0
    if not S.supported():
        print("the board needs x86-64 Linux")
        return 0
    print(f"hora.allreduce_ of {args.count} float32 (Sum) through its lane, a board of "
          f"{args.np} ranks, one process")
    print("| rank | us a call | instructions a call |")
    print("|---|---:|---:|")
    for rank in (1, 0):
        call, others = make_call(rank, args.np, args.count)
        call()
        n = 20000
        best = min(timeit.repeat(call, number=n, repeat=7)) / n
        alone = min(timeit.repeat(others, number=n, repeat=7)) / n
        ins = None if args.no_valgrind else _instructions(rank, args.np, args.count)
        who = "1 (a worker)" if rank else "0"
        print(f"| {who} | {(best - alone) * 1e6:.2f} | "
              f"{'-' if ins is None else f'{ins:,.0f}'} |")
    print("(the instructions include the other ranks' words written by hand; the "
          "microseconds do not)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
