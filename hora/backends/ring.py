"""Collective schedules over a point-to-point transport (bandwidth-optimal, numpy buffers).

Each function works on flat, contiguous numpy arrays and a transport with ``rank``, ``size``
and ``sendrecv``.  Ring neighbours: send to the next rank on the transport's ring, receive
from the one before; the ring is ``t.ring`` (the ranks in ring order) where the transport
has one, else rank order (``rank + 1``, ``rank - 1``).  Blocks stay in rank order whatever
the ring: rank r's block is at the r-th place of the buffer.

- reduce-scatter / allreduce: ring; each rank sends (N-1)/N of the buffer per phase, so an
  allreduce sends 2(N-1)/N of it.  Received chunks are reduced while later ones still arrive.
- allgather: ring, blocks of any size (first dimensions may differ per rank).
- broadcast: a pipelined chain from the root, in chunks, so each link carries the buffer once.
- up to ``SMALL`` bytes, in groups of up to ``DIRECT_MAX`` ranks, allreduce, allgather and
  broadcast skip the ring: each rank sends its buffer straight to every peer, one round trip
  instead of 2(N-1) hops.  Larger groups keep to the ring, so that a rank connects to its
  neighbours, not to every peer (:mod:`hora.core.links`).
- alltoall: N-1 pairwise exchange steps, send to ``rank + s`` while receiving from ``rank - s``.

:class:`RingPlane` offers them as a :class:`~hora.backends.base.Plane` over any
:class:`~hora.backends.base.Transport`.

Layer: backends.  Knows nothing of names or requests.
"""
import numpy as np

__all__ = ["DIRECT_MAX", "segment_bounds", "allreduce", "reducescatter", "allgather",
           "broadcast", "alltoall", "RingPlane", "reusable_buffer"]

_CHUNK = 1 << 20     # pipelining unit for broadcast and for reductions in flight
# Up to this many bytes a collective is latency-bound: every rank sends its whole buffer
# straight to every peer (one round trip) instead of walking the ring (2(N-1) hops).
SMALL = 64 << 10
DIRECT_MAX = 8       # ... in a group of at most this many ranks (N-1 connections each)


def _direct(t, nbytes, direct=None):
    """Whether a collective of ``nbytes`` over ``t`` talks to every peer at once (``direct``:
    the caller's choice, None: the rule above)."""
    if direct is not None:
        return direct
    return nbytes <= SMALL and t.size <= DIRECT_MAX


def segment_bounds(counts):
    """Start offsets for blocks of ``counts`` elements: len(counts) + 1 values."""
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + int(c))
    return bounds


def even_counts(n, size):
    """Split ``n`` elements into ``size`` blocks, the first ``n % size`` one larger."""
    q, r = divmod(n, size)
    return [q + 1 if i < r else q for i in range(size)]


def _around(t):
    """``(ring, i)``: the transport's ranks in ring order and this rank's place among them."""
    order = getattr(t, "ring", None) or range(t.size)
    return order, order.index(t.rank)


def _bytes(arr):
    return memoryview(arr).cast("B") if arr.size else memoryview(b"")


def reducescatter(t, flat, counts, reduce_fn, scratch=None):
    """Ring reduce-scatter in place: afterwards rank r's block of ``flat`` is fully reduced.

    Args:
        t: transport.  flat: 1-D contiguous array (modified).  counts: elements per rank's
        block.  reduce_fn: numpy ufunc applied as ``reduce_fn(mine, theirs, out=mine)``.
        scratch: optional 1-D array of flat's dtype, at least max(counts) long.
    """
    n = t.size
    if n == 1:
        return
    bounds = segment_bounds(counts)
    if scratch is None or scratch.size < max(counts):
        scratch = np.empty(max(counts), dtype=flat.dtype)
    item = flat.itemsize
    order, i = _around(t)
    right, left = order[(i + 1) % n], order[(i - 1) % n]
    for s in range(n - 1):
        send_seg = order[(i - s - 1) % n]
        recv_seg = order[(i - s - 2) % n]
        lo, hi = bounds[recv_seg], bounds[recv_seg + 1]
        mine = flat[lo:hi]
        theirs = scratch[:hi - lo]
        done = [0]

        def reduce_arrived(nbytes, mine=mine, theirs=theirs, done=done):
            upto = nbytes // item
            if upto > done[0]:
                reduce_fn(mine[done[0]:upto], theirs[done[0]:upto], out=mine[done[0]:upto])
                done[0] = upto

        slo, shi = bounds[send_seg], bounds[send_seg + 1]
        t.sendrecv(right, _bytes(flat[slo:shi]), left, _bytes(theirs), reduce_arrived)


def allgather(t, out, counts, direct=None):
    """Ring allgather in place: rank r's block of ``out`` is filled in everywhere."""
    n, r = t.size, t.rank
    if n == 1:
        return
    bounds = segment_bounds(counts)
    if _direct(t, out.nbytes, direct):
        mine = _bytes(out[bounds[r]:bounds[r + 1]])
        t.exchange([(p, mine) for p in range(n) if p != r],
                   [(p, _bytes(out[bounds[p]:bounds[p + 1]])) for p in range(n) if p != r])
        return
    order, i = _around(t)
    right, left = order[(i + 1) % n], order[(i - 1) % n]
    for s in range(n - 1):
        send_seg = order[(i - s) % n]
        recv_seg = order[(i - s - 1) % n]
        t.sendrecv(right, _bytes(out[bounds[send_seg]:bounds[send_seg + 1]]),
                   left, _bytes(out[bounds[recv_seg]:bounds[recv_seg + 1]]))


def allreduce(t, flat, reduce_fn, scratch=None, direct=None):
    """Allreduce in place: ring reduce-scatter then allgather, or direct for small buffers
    (``direct=False``: the ring whatever the size, connecting a rank to its neighbours
    alone)."""
    if t.size == 1 or flat.size == 0:
        return
    if _direct(t, flat.nbytes, direct):
        _allreduce_direct(t, flat, reduce_fn)
        return
    counts = even_counts(flat.size, t.size)
    reducescatter(t, flat, counts, reduce_fn, scratch)
    allgather(t, flat, counts, direct)


def _allreduce_direct(t, flat, reduce_fn):
    """Everyone sends everything to everyone, then reduces in rank order (so that every
    rank computes the bitwise-same result)."""
    n, r = t.size, t.rank
    theirs = np.empty((n, flat.size), dtype=flat.dtype)
    peers = [p for p in range(n) if p != r]
    mine = _bytes(flat)
    t.exchange([(p, mine) for p in peers], [(p, _bytes(theirs[p])) for p in peers])
    theirs[r] = flat
    flat[...] = theirs[0]
    for p in range(1, n):
        reduce_fn(flat, theirs[p], out=flat)


def broadcast(t, flat, root, direct=None):
    """Pipelined chain broadcast from ``root`` in place, along the ring (root, the next
    rank on the ring, ...)."""
    n, r = t.size, t.rank
    if n == 1 or flat.size == 0:
        return
    if _direct(t, flat.nbytes, direct):
        if r == root:
            t.exchange([(p, _bytes(flat)) for p in range(n) if p != r], [])
        else:
            t.recv(root, _bytes(flat))
        return
    order, i = _around(t)
    pos = (i - order.index(root)) % n          # distance from the root along the chain
    nxt, prev = order[(i + 1) % n], order[(i - 1) % n]
    data = _bytes(flat)
    total = len(data)
    if pos == 0:
        t.send(nxt, data)
        return
    if pos == n - 1:
        t.recv(prev, data)
        return
    # middle of the chain: forward each chunk as soon as it has arrived
    chunk = max(_CHUNK, total // 64)
    forwarded = 0
    received = 0
    while forwarded < total:
        want = min(total, received + chunk)
        if received < want:
            t.sendrecv(nxt, data[forwarded:received], prev, data[received:want])
            forwarded = received
            received = want
        else:
            t.send(nxt, data[forwarded:received])
            forwarded = received


def alltoall(t, send, send_counts, recv, recv_counts):
    """Pairwise exchange: step s sends my block for rank r+s, receives rank r-s's block for me.

    ``send_counts[j]`` elements of ``send`` go to rank j; ``recv_counts[j]`` come from rank j.
    """
    n, r = t.size, t.rank
    sb, rb = segment_bounds(send_counts), segment_bounds(recv_counts)
    recv[rb[r]:rb[r + 1]] = send[sb[r]:sb[r + 1]]
    for s in range(1, n):
        dst, src = (r + s) % n, (r - s) % n
        t.sendrecv(dst, _bytes(send[sb[dst]:sb[dst + 1]]), src, _bytes(recv[rb[src]:rb[src + 1]]))


class RingPlane:
    """The schedules above as a :class:`~hora.backends.base.Plane` over transport ``t``:
    every collective runs (never declines), on any dtype and op.

    The reductions in flight use one scratch buffer per dtype from ``scratch`` (a dict;
    None: a pool of its own), grown to the largest block seen, so steady-state collectives
    allocate nothing; planes over several views of one transport may share a pool.
    ``close()`` leaves ``t`` open: the transport's owner closes it.
    """

    def __init__(self, t, scratch=None):
        self._t = t
        self._scratch = {} if scratch is None else scratch

    def allreduce(self, flat, reduce_fn):
        if flat.size:
            allreduce(self._t, flat, reduce_fn,
                      reusable_buffer(self._scratch, flat.dtype, -(-flat.size // self._t.size)))
        return True

    def reducescatter(self, flat, counts, reduce_fn):
        reducescatter(self._t, flat, counts, reduce_fn,
                      reusable_buffer(self._scratch, flat.dtype, max(counts)))
        return True

    def allgather(self, out, counts):
        allgather(self._t, out, counts)
        return True

    def broadcast(self, flat, root):
        broadcast(self._t, flat, root)
        return True

    def alltoall(self, send, send_counts, recv, recv_counts):
        alltoall(self._t, send, send_counts, recv, recv_counts)
        return True

    def close(self):
        pass


def reusable_buffer(pool, dtype, n):
    """``n`` elements of the buffer kept in ``pool`` (a dict) for ``dtype``, replaced by a
    larger one when too small."""
    buf = pool.get(dtype)
    if buf is None or buf.size < n:
        buf = pool[dtype] = np.empty(max(n, 1), dtype=dtype)
    return buf[:n]
