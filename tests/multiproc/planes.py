"""A worker that shows which collectives a data plane carried (not the TCP fallback).

Each rank wraps its engine's plane methods with counters, runs one collective of each kind
above ring.SMALL, and returns the plane's class and, per method, how many calls it served
(returned True).  The values are checked against numpy on every rank.
"""
import collections

import numpy as np

import hora

KINDS = ("allreduce", "allgather", "broadcast", "reducescatter", "alltoall")


def carried_by_plane():
    from hora.core import state
    plane = state.engine()._plane
    carried = collections.Counter()
    for kind in KINDS:
        method = getattr(plane, kind, None)
        if method is not None:
            def spy(*args, _method=method, _kind=kind):
                served = _method(*args)
                carried[_kind] += bool(served)
                return served
            setattr(plane, kind, spy)
    r, n = hora.rank(), hora.size()
    x = np.arange(40_000, dtype=np.float32)
    assert np.array_equal(hora.allreduce(x * (r + 1), op=hora.Sum, name="sum"),
                          x * (n * (n + 1) // 2))
    gathered = hora.allgather(np.full((20_000 + r, 2), r, np.float64), name="gather")
    assert np.array_equal(gathered[:, 0], np.repeat(np.arange(n), [20_000 + k for k in range(n)]))
    assert np.array_equal(hora.broadcast(x * r, root_rank=n - 1, name="bcast"), x * (n - 1))
    mine = hora.reducescatter(np.ones((30_000, 2), np.float32) * (r + 1), op=hora.Max, name="rs")
    assert mine.shape[1:] == (2,) and np.all(mine == n)
    sent = np.repeat(np.arange(n, dtype=np.int64) + 100 * r, 3_000)
    received, _ = hora.alltoall(sent, name="a2a")
    assert np.array_equal(received, np.repeat(np.arange(n) * 100 + r, 3_000))
    # uint16: a dtype gloo lacks (its plane declines and TCP serves), MPI has
    total = hora.allreduce(np.ones(40_000, np.uint16), op=hora.Sum, name="u16")
    assert np.all(total == n)
    return type(plane).__name__, dict(carried)
