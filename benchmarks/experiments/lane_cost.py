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
run, whatever else the machine does.  The engine around the call is a stand-in with the
attributes the lane's path reads (``_engine``); a change of that path that reads more shows
here as an AttributeError.
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
from hora.core import state                     # noqa: E402
from hora.core.engine import RUNNING, Engine    # noqa: E402
from hora.core.engine import board as B         # noqa: E402
from hora.core.messages import ALLREDUCE, Request, Sum    # noqa: E402

_METHODS = ("lane_now", "_lane_tail", "_lane_rank0", "_busy", "_hint", "_lane_wait", "_count_wait")


def _engine(board, size):
    """A stand-in for the engine of a running job whose engine has nothing under way."""
    eng = types.SimpleNamespace(
        _queue=types.SimpleNamespace(inflight={}, items=[]), _state=RUNNING,
        _board_lock=threading.Lock(), _drive=threading.Lock(), _board=board,
        _running=lambda: True, _nudge=lambda: None, _exec=types.SimpleNamespace(pending={}),
        _pacer=types.SimpleNamespace(unsent=[]), _coord_idle=lambda: True,
        _side=types.SimpleNamespace(coord=types.SimpleNamespace(last_submit={})),
        _clock=time.monotonic, _hinted=0.0, _in_board=False, _held_back=False, size=size,
        lanes={})
    for name in _METHODS:
        setattr(eng, name, types.MethodType(getattr(Engine, name), eng))
    return eng


def make_call(rank, size, count):
    """``call()``: one ``hora.allreduce_`` through its lane as ``rank``, the other ranks'
    part written first."""
    board = B.Board(mmap.mmap(-1, B.board_bytes(size)), rank, size, spin_s=1e-3,
                    crowded=True)
    x = np.zeros(count, np.float32)
    req = Request("lane", ALLREDUCE, x.dtype.str, (x.shape,), Sum, -1, 1.0, 1.0, None, 0, "")
    sig = board.signature(req)
    lane = board.lane(req, sig, x.nbytes, x.dtype, x.shape)
    eng = _engine(board, size)
    # (as Engine.allreduce_now makes a lane's call)
    lane.call = (board.lane_caller(lane, eng, RUNNING) if rank
                 else board.lane_caller0(lane, eng, RUNNING, 10e-3))
    eng.lanes["lane"] = lane
    state._ctx = types.SimpleNamespace(engine=eng)
    w = board._w
    if rank:
        reply = rank * B._ROW + B._REPLY

        def others():               # rank 0's answer to the coming post, ahead of it
            w[reply] = (board._seq + 1) * 8 + B.SHARED
    else:
        B.os = types.SimpleNamespace(sched_yield=lambda: None)   # alone: yield to nobody
        rows = [r * B._ROW for r in range(1, size)]
        for at in rows:             # every worker's signature, as rank 0 read it once
            w[at + B._SIGVER] = 1
            w[at + B._NBYTES] = x.nbytes
        board._known[1:] = [(1, sig)] * (size - 1)
        nxt = board._next

        def others():               # every worker's next post
            seq = nxt[1]
            for at in rows:
                w[at] = seq
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
    if not B.supported():
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
