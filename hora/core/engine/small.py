"""Small allreduces, reduced by the coordinator.  Pure: no sockets, no clock.

An allreduce of at most :data:`SMALL_ALLREDUCE` bytes travels with its request (each rank
sends its prescaled input, :func:`payloads`); rank 0 reduces every member's copy in rank
order, as the direct path does (:meth:`SmallReductions.settle`), and sends the result with
its answer as a :class:`~hora.core.wire.Value`, so the collective costs one round trip to
rank 0 and no data-plane step.  A host leader sends its host's inputs already reduced
(:mod:`.relay`): rank 0 adds one partial a host.  Everyone gets rank 0's bytes: the result is
identical on every rank.  When an input is missing (a member's copy was larger, or on a device), the
answer stays the ``Run`` that sends it to the data plane.

Layer: core.
"""
import numpy as np

from ..messages import ALLREDUCE, Average
from ..negotiation import nbytes
from ..wire import Run, Value
from ..fusion import NUMPY, Fusion, scale
from .folds import REDUCE

__all__ = ["SMALL_ALLREDUCE", "small", "payloads", "SmallReductions"]

SMALL_ALLREDUCE = 8 << 10


def small(req):
    """Whether ``req`` is an allreduce whose input travels with it."""
    return (req.kind == ALLREDUCE and not req.device and req.error is None
            and nbytes(req) <= SMALL_ALLREDUCE)


def payloads(requests, pending):
    """``{(set, name): this rank's prescaled bytes}`` for the small allreduces among
    ``requests``, whose inputs are in ``pending`` (``(set, name) -> (request, arrays,
    handle)``)."""
    out = {}
    for req in requests:
        if small(req):
            key = (req.process_set, req.name)
            entry = pending.get(key)
            if entry is not None:   # None: already failed by another rank's error
                out[key] = prescaled(req, entry[1])
    return out


class SmallReductions:
    """Rank 0's store of the inputs that came with requests, and their reduction.

    Args:
        coordinator: the :class:`~hora.core.negotiation.Coordinator` (for the requests
            behind cache ids, and process-set members).
    """

    def __init__(self, coordinator):
        self._coord = coordinator
        # (set, name) -> {first rank: (request, bytes, how many ranks' inputs they sum)}
        self._inputs = {}

    def take(self, rank, full, small_inputs, ids):
        """``rank`` sent ``full`` requests and the cached ``ids``, with ``small_inputs``
        (``{(set, name): bytes}``)."""
        if not small_inputs:
            return
        reqs = {(q.process_set, q.name): q for q in full}
        reqs.update(((q.process_set, q.name), q) for q in
                    map(self._coord.cached_request, ids))
        for key, blob in small_inputs.items():
            self._inputs.setdefault(key, {})[rank] = (reqs[key], blob, 1)

    def take_host(self, ranks, partials, ids):
        """A host leader sent its host's (``ranks``) partial results ``partials``
        (``{(set, name): bytes}``) of the cached ``ids`` (:mod:`.relay`): one entry, under
        the host's first rank, for all of them."""
        if not partials:
            return
        n = len(ranks)
        for q in map(self._coord.cached_request, ids):
            key = (q.process_set, q.name)
            blob = partials.get(key)
            if blob is not None:
                self._inputs.setdefault(key, {})[ranks[0]] = (q, blob, n)

    def settle(self, resp, pending):
        """``resp``, or the :class:`~hora.core.wire.Value` that answers it when it is a
        ready allreduce whose every input came with its request (rank 0's own from
        ``pending``, as in :func:`payloads`).  Forgets the inputs of every collective
        ``resp`` runs or fails."""
        tag = resp.tag
        if tag != "run" and tag != "error":
            return resp
        set_id, names = resp.set_id, resp.names
        inputs = [self._inputs.pop((set_id, name), None) for name in names]
        if resp.__class__ is not Run or resp.kind != ALLREDUCE or resp.extra is not None:
            return resp
        members = self._coord.members(set_id)
        results = []
        for name, got in zip(names, inputs):
            got = dict(got or {})
            mine = pending.get((set_id, name)) if 0 in members else None
            if mine is not None and small(mine[0]):
                got[0] = (mine[0], prescaled(mine[0], mine[1]), 1)
            # (every entry is a member's, or a host's of members: none counted twice)
            if sum(part[2] for part in got.values()) != len(members):
                return resp                 # larger than SMALL_ALLREDUCE: the data plane
            parts = [got[r] for r in sorted(got)]      # in rank order, a host's at its first
            req = parts[0][0]
            dtype = np.dtype(req.dtype)
            acc = np.frombuffer(parts[0][1], dtype=dtype).copy()
            for _, blob, _ in parts[1:]:
                REDUCE[req.op](acc, np.frombuffer(blob, dtype=dtype), out=acc)
            scale(acc, req.postscale, len(members) if req.op == Average else 1)
            results.append(acc.tobytes())
        return Value(set_id, names, tuple(results))


def prescaled(req, arrays):
    """The request's arrays, flattened into one buffer of its dtype, times its prescale."""
    if len(arrays) == 1 and req.prescale == 1:
        return np.ascontiguousarray(arrays[0], dtype=req.dtype).tobytes()
    buf = _PACK.pack(arrays, np.dtype(req.dtype), False)    # a copy: the callers' stay as is
    scale(buf, req.prescale, 1)
    return buf.tobytes()


_PACK = Fusion(NUMPY)       # packs into new buffers only (never in place): keeps no state
