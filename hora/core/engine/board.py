"""The board: blocking allreduces and barriers of a one-host job (and its small broadcasts and
allgathers), settled in shared memory.

A blocking allreduce of at most :data:`BOARD_BYTES` (``hora.allreduce``,
``hora.torch.allreduce_``, metric averaging) or a blocking ``barrier()`` spends most of its
time in the control path: a request to rank 0 over TCP, its negotiation, the answer back,
and two thread hand-offs.  When every rank is on this host, the calling thread can instead
use one segment of shared memory that every rank maps
(:class:`~hora.backends.board_segment.BoardSegment`: its layout, words and waits):

- every other rank writes the collective's signature (name, kind, op, dtype, shape, scale
  factors) and its prescaled input into its own slot, then posts;
- rank 0, in its own call of the collective, stages its own input, waits until every rank
  has posted, checks that every signature equals its own, and answers each post *shared*;
- each rank reduces every slot's input in rank order, straight into its own result (as the
  engine's path for inputs up to 8 KiB does, so that those results are the same bits either
  way).

From :data:`STRIPE_BYTES`, where reducing every input on every rank would cost more than the
hand-off saves, rank 0 answers *go* instead: every rank reduces one stripe of the result area
(every slot's elements there, in rank order), says so, and copies the result out once every
stripe is done.  A barrier carries no data: rank 0's answer (*result*) releases it.  Small
blocking broadcasts and allgathers on one host take shared rounds too: every rank copies the
root's slot, or every slot in rank order (an allgather's rows may differ from rank to rank).
One float32 or float64 number summed or averaged without a prescale skips numpy: each rank
adds the slots up in Python floats, rounding to the dtype after each addition, which gives
numpy's bits (:meth:`Board.scalar`).

Rank 0 decides every post (:mod:`.board_rules`), and answers each exactly once, with the
result or with *go through the engine* whenever the board cannot settle the call for
certain; a rank told so submits the collective to the engine as if the board did not exist.
Across hosts every host has a board of its own, whose rank 0 is the host's leader, and the
leaders settle *host rounds* among themselves (:mod:`.host_rounds`); this module's
:meth:`Board.partial` and :meth:`Board.combine` are their arithmetic.  A repeated blocking
allreduce keeps its choices in a :class:`~.lanes.Lane`; the calls themselves, and their
hand-over to the engine, are :mod:`.board_calls`.

Layer: core.
"""
import numpy as np

from ...backends.board_segment import (BOARD_BYTES, FALLBACK, GATHERED, GO, NBYTES, RESULT,
                                       ROW, SHARED, SIG_MAX, STRIPE_BYTES, BoardSegment)
from ...config import Settings
from ..fusion import scale
from ..messages import ALLGATHER, ALLREDUCE, BROADCAST, Average, Sum
from .folds import add_up, fold, pack, times

__all__ = ["BOARD_BYTES", "STRIPE_BYTES", "RESULT", "FALLBACK", "GO", "SHARED", "Board"]

UNSTAGED_BYTES = 256 << 10  # from this size a rank's own stripe of its input is read from
#                             its array, not staged: below it the two partial copies cost
#                             more Python than they save (docs/performance-notes.md)
SCALAR_OPS = (Sum, Average)     # a one-element float allreduce of these: Python floats
SIGS_KEPT = 4096            # signatures kept for reuse: a training loop makes a few hundred
INPUTS_KEPT = 256           # lists of slots' views kept for reuse (per dtype, bytes, area)


class Board(BoardSegment):
    """One rank's board: the collectives on its :class:`BoardSegment`.

    Args:
        mapping, rank, size, spin_s, crowded, limit: the segment's (rank and size on this
            host's board).
        timeout: seconds a rank waits for rank 0's answer, and for the others' stripes,
            while their engines live (HORA_TRANSPORT_TIMEOUT: a rank stopped in the middle of
            a call); then :class:`~hora.errors.CollectiveTimeoutError`.
        leaders: in a job on several hosts, the global rank of every host's leader (its
            board's rank 0), in host order, global rank 0 first; None: one host.
        job_size: the job's size (an Average divides by it); None: ``size``.
    """

    def __init__(self, mapping, rank, size, spin_s, crowded,
                 timeout=Settings.transport_timeout, leaders=None, job_size=None,
                 limit=BOARD_BYTES):
        self.leaders = tuple(leaders or (0,))
        # a worker of a board across hosts waits for the other hosts, tens of microseconds
        # away: on a crowded host its yields would only slow the leaders, so it sleeps
        super().__init__(mapping, rank, size, spin_s, crowded, timeout,
                         far=rank > 0 and len(self.leaders) > 1, limit=limit)
        self.job_size = size if job_size is None else job_size
        if len(self.leaders) > 1:   # across hosts the hierarchical ring does better at that
            self.capacity = min(self.capacity, STRIPE_BYTES - 1)
        self.sig_max = SIG_MAX
        # for the one-element sums (scalar), per dtype (float32, float64): a view of the
        # whole segment as numbers of it, a scratch number, slot 0's number in each SHARED
        # round's area (0, 1; the areas take turns), and each slot's distance from slot 0
        whole = memoryview(mapping).cast("B")
        self._scalars = {np.dtype(f).str: (whole[:len(whole) // n * n].cast(f),
                                           memoryview(bytearray(n)).cast(f),
                                           (self.small_area(0, 0) // n,
                                            self.small_area(0, 1) // n),
                                           tuple(range(0, size * self.slot_bytes // n,
                                                       self.slot_bytes // n)))
                         for f, n in (("f", 4), ("d", 8))}
        self._scalar_of = (None, None)      # the last request scalar() saw, and its answer
        self._sigs = {}                     # (name, op, dtype, shapes, scales) -> bytes
        self._mine = None                   # this rank's input, when its stripe is not staged
        self._inputs = {}                   # (dtype, bytes, area) -> slots' views, a buffer
        self._partials = {}                 # (dtype, bytes, area) -> result area's, slots'

    # -- every rank -------------------------------------------------------------------------
    def signature(self, req):
        """What every rank's call must match: the request's name, kind, op, root, dtype,
        shapes (an allgather's without the first dimension, which may differ) and scale
        factors, as bytes."""
        shapes = req.shapes
        if req.kind == ALLGATHER:
            shapes = tuple(s[1:] for s in shapes)
        key = (req.name, req.kind, req.op, req.root, req.dtype, shapes, req.prescale,
               req.postscale)
        sig = self._sigs.get(key)
        if sig is None:
            if len(self._sigs) > SIGS_KEPT:
                self._sigs.clear()
            sig = self._sigs[key] = repr(key).encode()
        return sig

    def post(self, sig, req, arrays, nbytes):
        """Post this rank's ``sig`` and its input: ``arrays`` (``nbytes`` in all) times the
        prescale factor of ``req``.  Returns the post's number, for :meth:`reply`."""
        if sig is not self.last_sig:    # a training loop posts the same few again and again
            self.write_sig(sig)
        self.stage(req, arrays, nbytes)
        return self.ring(nbytes)

    def stage(self, req, arrays, nbytes):
        """Put this rank's input (``arrays``, ``nbytes`` in all, times the prescale factor of
        ``req``) in its slot; from UNSTAGED_BYTES, one contiguous array without a prescale
        leaves out this rank's stripe, which :meth:`reduce_stripe` reads from the array.  Of
        a broadcast, only the root stages its input; of an allgather, each rank also writes
        its byte count into its row."""
        self._mine = None
        if req.kind != ALLREDUCE:
            if req.kind == ALLGATHER:   # (the others read it after SHARED: gathered())
                self.w[self.row + GATHERED + (self.shared & 1)] = nbytes
            elif req.kind == BROADCAST and req.root != self.rank:
                return                  # only the root's input is read: copy_shared()
        elif nbytes <= 8 and len(arrays) == 1:
            scalar = self.scalar(req, nbytes)
            if scalar is not None:      # (item(): the value as a Python float, exactly)
                view, _, first, apart = scalar
                view[first[self.shared & 1] + apart[self.rank]] = arrays[0].item()
                return
        if not nbytes:
            return                      # a barrier, or an empty allreduce
        dst = self.view(self.rank, req.dtype, nbytes)
        if nbytes >= UNSTAGED_BYTES and req.prescale == 1 and len(arrays) == 1:
            a = arrays[0]
            if a.flags.c_contiguous and a.dtype == dst.dtype:
                # this rank alone reads its own stripe (reduce_stripe): from ``a`` itself
                mine = self._mine = a.reshape(-1)
                lo, hi = self.stripe(mine.size)
                if lo:
                    np.copyto(dst[:lo], mine[:lo])
                if hi < mine.size:
                    np.copyto(dst[hi:], mine[hi:])
                return
        pack(dst, arrays)
        if req.prescale != 1:
            scale(dst, req.prescale, 1)

    def scalar(self, req, nbytes):
        """For an allreduce of one float32 or float64 element (``nbytes``), an op of
        SCALAR_OPS and no prescale: ``(view of the segment as numbers, scratch number, slot
        0's index in each small area, each slot's distance from slot 0)`` of its dtype, the
        same on every rank (the signatures match); else None.

        A loss or a metric is such a number, and at a few microseconds a call the numpy calls
        of the general path (a copy into the slot, one ufunc per rank, the postscale: most
        of a microsecond each) are what a call costs.  Python's float arithmetic gives the
        same bits: a float64 sum is numpy's, and a float32 sum computed in float64 and
        rounded once to float32 (stored in the float32 scratch) is the correctly rounded
        float32 result, as numpy's (float64 carries more than twice float32's precision plus
        two bits, so rounding twice is harmless)."""
        last, scalar = self._scalar_of
        if req is last:                 # (a blocking call's request is kept: lanes, quick)
            return scalar
        scalar = None
        if req.op in SCALAR_OPS and req.prescale == 1:
            scalar = self._scalars.get(req.dtype)
            if scalar is not None and scalar[0].itemsize != nbytes:
                scalar = None
        self._scalar_of = (req, scalar)
        return scalar

    # -- SHARED rounds, every rank ------------------------------------------------------------
    def reduce_shared(self, req, nbytes, out=None):
        """After SHARED (every rank's input of ``nbytes`` is in its slot): the reduction of the
        slots in rank order, postscaled, into ``out`` (a flat array of the request's dtype)
        or else into a buffer of this rank's, to copy out before its next board call.  Every
        rank computes the same bits, those of :meth:`partial` and :meth:`finish`."""
        if nbytes <= 8 and out is not None:
            scalar = self.scalar(req, nbytes)
            if scalar is not None:
                out[0] = self._fold_scalar(req, scalar)
                self.shared += 1
                return out
        key = (req.dtype, nbytes, self.shared & 1)
        got = self._inputs.get(key)
        if got is None:             # every slot's input, and a buffer for the result
            if len(self._inputs) > INPUTS_KEPT:
                self._inputs.clear()
            views = [self.view(r, req.dtype, nbytes) for r in range(self.size)]
            got = self._inputs[key] = (views, np.empty_like(views[0]))
        views, buffer = got
        out = buffer if out is None else out
        fold(req, views, out)
        self.finish(req, out)
        self.shared += 1
        return out

    def _fold_scalar(self, req, scalar):
        """:meth:`reduce_shared` of one number (:meth:`scalar`): every slot's, in rank
        order, rounded to the dtype after each addition, then postscaled."""
        view, t, first, apart = scalar
        at = first[self.shared & 1]
        acc = add_up(view, t, at, apart[1:], view[at])
        if req.postscale != 1 or req.op == Average:     # (a Sum calls nothing more)
            acc = times(t, acc, self.factor(req))
        return acc

    def copy_shared(self, req, nbytes):
        """After SHARED of a broadcast (its root's input of ``nbytes`` is in the root's
        slot): a copy of it, flat, this rank's to keep."""
        out = self.view(req.root, req.dtype, nbytes).copy()
        self.shared += 1
        return out

    def gathered(self, req):
        """After SHARED of an allgather (every rank's input is in its slot, its bytes in its
        row): every input in rank order, flat, this rank's to keep.  (A rank posting its
        next call meanwhile writes the other area's count.)"""
        w, at = self.w, GATHERED + (self.shared & 1)
        sizes = tuple(w[r * ROW + at] for r in range(self.size))
        key = (req.dtype, sizes, self.shared & 1)
        views = self._inputs.get(key)
        if views is None:
            if len(self._inputs) > INPUTS_KEPT:
                self._inputs.clear()
            views = self._inputs[key] = [self.view(r, req.dtype, nbytes)
                                         for r, nbytes in enumerate(sizes)]
        self.shared += 1
        return np.concatenate(views)

    # -- striped rounds (GO), every rank --------------------------------------------------------
    def reduce_stripe(self, req, nbytes):
        """This rank's stripe of the result: every slot's elements there, in rank order (one
        rank computes each element, so every rank reads the same bits); then says so."""
        lo, hi = self.stripe(nbytes // np.dtype(req.dtype).itemsize)
        if hi > lo:
            acc = self.view(-1, req.dtype, nbytes)[lo:hi]
            inputs = [self.view(r, req.dtype, nbytes)[lo:hi] for r in range(self.size)]
            if self._mine is not None:      # (stage left it out of the slot)
                inputs[self.rank] = self._mine[lo:hi]
            fold(req, inputs, acc)
            self.finish(req, acc)
        self._mine = None
        self.stripe_done()

    def result(self, dtype, nbytes):
        """The last result, a flat array of ``dtype`` (a view into the board: copy it out
        before posting again)."""
        return self.view(-1, dtype, nbytes)

    # -- rank 0 -------------------------------------------------------------------------------
    def matches(self, posts, sig, nbytes):
        """Whether every open post in ``posts`` (every rank's) is the collective ``sig`` of
        ``nbytes`` (None: any number; an allgather's ranks may bring different ones)."""
        w = self.w
        for r in posts:
            if nbytes is not None and w[r * ROW + NBYTES] != nbytes:
                return False
            if self.read_sig(r) != sig:
                return False
        return True

    def partial(self, req, arrays, nbytes):
        """This board's part of the reduction (rank 0's input, ``arrays`` times the prescale
        factor, and every slot's, in rank order), as the bytes a :class:`HostPost` carries;
        :meth:`combine` adds the hosts' parts.  One float number summed or averaged is added
        up in Python floats, as :meth:`reduce_shared` does (see :meth:`scalar`)."""
        if nbytes <= 8 and len(arrays) == 1:
            scalar = self.scalar(req, nbytes)
            if scalar is not None:
                view, t, first, apart = scalar
                # (item(): the dtype's value, exactly)
                t[0] = add_up(view, t, first[self.shared & 1], apart[1:], arrays[0].item())
                return t.tobytes()
        key = (req.dtype, nbytes, self.shared & 1)
        views = self._partials.get(key)
        if views is None:
            if len(self._partials) > INPUTS_KEPT:
                self._partials.clear()
            views = self._partials[key] = [self.view(r, req.dtype, nbytes)
                                           for r in (-1, *range(1, self.size))]
        acc = views[0]
        pack(acc, arrays)
        if req.prescale != 1:
            scale(acc, req.prescale, 1)
        if self.size > 1:           # (a host of one rank: its input is the host's part)
            fold(req, views, acc)
        return acc.tobytes()

    def combine(self, req, parts, nbytes):
        """The hosts' parts ``parts`` (:meth:`partial`'s bytes, from every host's board)
        reduced in host order and postscaled, into the result area (returned, flat): the
        same bits on every host."""
        out = self.view(-1, req.dtype, nbytes)
        scalar = self.scalar(req, nbytes) if nbytes <= 8 else None
        if scalar is None:
            arrays = [np.frombuffer(p, out.dtype) for p in parts]
            if len(arrays) > 1:
                fold(req, arrays, out)
            else:
                np.copyto(out, arrays[0])
            self.finish(req, out)
            return out
        view, t, _, _ = scalar
        fmt = t.format
        acc = memoryview(parts[0]).cast(fmt)[0]
        for p in parts[1:]:
            t[0] = acc + memoryview(p).cast(fmt)[0]
            acc = t[0]
        if req.postscale != 1 or req.op == Average:
            acc = times(t, acc, self.factor(req))
        view[self.result_at // t.itemsize] = acc
        return out

    def finish(self, req, acc):
        """The postscale of the reduction ``acc`` (an Average divides by the job's size)."""
        if req.postscale != 1 or req.op == Average:
            scale(acc, self.factor(req), 1)

    def factor(self, req):
        """The one factor of ``req``'s postscale and, for an Average, the division by the
        job's size, combined as :func:`scale` combines them."""
        return float(req.postscale) / (self.job_size if req.op == Average else 1)
