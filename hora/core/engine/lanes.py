"""Lanes: a blocking allreduce that a training loop repeats, with its board choices made once.

A loop calls the same allreduce (the same name, op, dtype, shape and scale factors) on every
step.  :func:`make_lane` makes, for such a call, every offset, view and choice the board
would otherwise make on each call: where this rank's input goes in each small area, the
other slots' views, the ufunc and the postscale factor, the stripe of a striped round.  The
call itself (:meth:`~.board_calls.BoardCalls.lane_call`) then posts, stages and reduces
through the :class:`Lane`'s methods.  Where the ranks outnumber the CPUs a call's CPU time
is what a round costs, twice over (two ranks take turns on each CPU), and those choices
were a third of it.

Layer: core.
"""
import array

import numpy as np

from ...backends.board_segment import SIG_MAX, STRIPE_BYTES
from ..fusion import scale
from ..messages import ALLREDUCE, Average
from .board import UNSTAGED_BYTES
from .folds import REDUCE, add_up, fold, times

__all__ = ["Lane", "make_lane"]

# the ufuncs a lane calls with their output given positionally (NumPy deprecates that form
# for np.maximum and np.minimum, whose folds take Board.reduce_shared's general path)
_POSITIONAL = (np.add, np.multiply)
_NEVER = (1 << 64) - 1      # a signature version no slot has (Lane.vers: another collective's)


def make_lane(board, req, sig, nbytes, dtype, shape):
    """A :class:`Lane` for the blocking allreduce ``req`` (signature ``sig``, one array of
    ``nbytes``, its numpy ``dtype`` and ``shape``) on ``board``, when the board settles it
    without a prescale; else None."""
    if (req.kind != ALLREDUCE or not 0 < nbytes <= board.capacity
            or len(sig) > SIG_MAX or req.prescale != 1):
        return None
    lane = Lane(board, req, sig, nbytes, dtype, shape)
    lane.hosts = len(board.leaders) > 1
    lane.factor = board.factor(req) if req.postscale != 1 or req.op == Average else 1.0
    if lane.factor != 1 and nbytes > dtype.itemsize and dtype in (np.float32, np.float64):
        # the factor as scale() rounds it for these, which it multiplies by in place
        lane.mul = np.float32(lane.factor) if dtype == np.float32 else lane.factor
    if lane.hosts or nbytes >= STRIPE_BYTES:    # every rank copies the result area out
        lane.result = board.view(-1, dtype, nbytes)
    if nbytes >= STRIPE_BYTES:      # GO rounds: as Board.stage and reduce_stripe choose
        n = nbytes // dtype.itemsize
        lo, hi = lane.stripe = board.stripe(n)
        lane.acc = lane.result[lo:hi]
        slots = [board.view(r, dtype, nbytes) for r in range(board.size)]
        lane.inputs = [v[lo:hi] for v in slots]
        own = slots[board.rank]
        lane.unstaged = nbytes >= UNSTAGED_BYTES
        # (destination, first, end) of each part of the input the slot gets
        lane.mine = (tuple((own[i:j], i, j) for i, j in ((0, lo), (hi, n)) if j > i)
                     if lane.unstaged else ((own, 0, n),))
        return lane
    scalar = board.scalar(req, nbytes) if nbytes <= 8 else None
    if scalar is not None:
        lane.view, lane.t, lane.first, apart = scalar
        lane.mine = tuple(f + apart[board.rank] for f in lane.first)
        lane.inputs = apart[1:]
    else:
        lane.inputs = tuple([board.u8[off:off + nbytes].view(dtype)
                             for off in (board.small_area(r, area) for r in range(board.size))]
                            for area in (0, 1))
        lane.mine = tuple(views[board.rank] for views in lane.inputs)
        fn = REDUCE[req.op]
        if board.size > 1 and nbytes > dtype.itemsize and fn in _POSITIONAL:
            lane.fold = fn      # fold's steps for each area; more than one element: see fold
            lane.folds = tuple((v[0], v[1], tuple(v[2:])) for v in lane.inputs)
    if not lane.flat:           # where the input goes, in the lane's shape
        lane.mine = tuple(m if lane.view is not None else m.reshape(shape) for m in lane.mine)
    return lane


class Lane:
    """What :func:`make_lane` makes once for a repeated blocking allreduce: its ``board``, the
    request and its ``op``, its signature, bytes, numpy dtype and shape (``flat``: 1-d), its
    name's key in flight, ``named`` (the call as ``stats.counters.last_op`` names it), the
    postscale factor ``factor`` (1: none; ``mul``, that factor as :func:`scale` rounds it, for more than
    one float32 or float64), and where this rank's input goes in each of the two small
    areas (``mine``).  One number in Python floats: ``view`` and ``t`` (see
    :meth:`Board.scalar`), ``mine`` and ``first`` as indices of ``view``, ``inputs`` the
    other slots' distances from slot 0; numpy: ``view`` None, ``mine`` this rank's views,
    ``inputs`` every slot's views, for each area, and for a Sum, an Average or a Product of
    more than one element, its ufunc (``fold``) and each area's views as ``(first, second,
    the rest)`` (``folds``).  ``result``: the result area as a flat array of ``dtype``
    (boards of host rounds, striped lanes).  ``hosts``: the board plays host rounds.  On
    rank 0, ``vers``: each other rank's version of the lane's signature in its slot, as
    rank 0 last read them (``epoch`` then), :data:`_NEVER` where the slot held another's.

    A striped lane (from STRIPE_BYTES, one host: GO rounds) has ``stripe``, this rank's
    ``(lo, hi)``; ``acc``, its stripe of the result area; ``inputs``, every slot's stripe;
    ``unstaged``, whether this rank's stripe is read from the caller's array instead of its
    slot; and ``mine``, the parts of the input that go into the slot, as ``(destination,
    first, end)``."""

    __slots__ = ("board", "req", "op", "sig", "nbytes", "dtype", "shape", "flat", "key",
                 "named", "factor", "view", "t", "mine", "first", "inputs", "result", "hosts",
                 "stripe", "acc", "unstaged", "mul", "fold", "folds", "vers", "epoch",
                 "postscale")

    def __init__(self, board, req, sig, nbytes, dtype, shape):
        self.board = board
        self.req, self.sig, self.nbytes, self.dtype, self.shape = req, sig, nbytes, dtype, shape
        self.op, self.flat = req.op, len(shape) == 1
        self.postscale = req.postscale      # (ops._repeated compares a call's with it)
        self.key = (req.process_set, req.name)
        self.named = ("allreduce", req.name)    # (as stats.Counters' last_op)
        self.factor = 1.0
        self.mul = self.fold = self.folds = None
        self.view = self.t = self.mine = self.first = self.inputs = self.result = None
        self.stripe = self.acc = self.vers = None
        self.hosts = self.unstaged = False
        self.epoch = -1

    # -- every rank ---------------------------------------------------------------------------
    def stage(self, a):
        """This rank's input ``a`` into its slot, this round's area (of a striped lane: the
        parts the other ranks reduce; ``a`` is contiguous)."""
        if self.stripe is not None:
            flat = a.reshape(-1)
            for dst, i, j in self.mine:
                np.copyto(dst, flat[i:j])
            return
        mine = self.mine[self.board.shared & 1]
        if self.view is not None:       # (item(): the value as a Python float, exactly)
            self.view[mine] = a.item()
        else:                           # (``a`` has the lane's dtype and shape)
            mine[...] = a

    def post(self, a):
        """A worker's post of ``a``; returns its number (:meth:`Board.post`'s steps)."""
        board = self.board
        if self.sig is not board.last_sig:
            board.write_sig(self.sig)
        self.stage(a)
        return board.ring(self.nbytes)

    def fold_into(self, out):
        """After SHARED: the reduction of every slot into ``out`` (None: a new flat array),
        returned (:meth:`Board.reduce_shared`'s steps)."""
        board = self.board
        area = board.shared & 1
        board.shared += 1
        view = self.view
        if view is not None:
            at = self.first[area]
            acc = add_up(view, self.t, at, self.inputs, view[at])
            if self.factor != 1:
                acc = times(self.t, acc, self.factor)
            if out is None:
                out = np.empty(1, self.dtype)
            out[0] = acc
            return out
        fn = self.fold
        if fn is not None:      # (fold's steps, made once; the ufunc allocates ``out``)
            first, second, rest = self.folds[area]
            out = fn(first, second, out)
            for x in rest:
                fn(out, x, out)
        else:
            if out is None:
                out = np.empty(self.nbytes // self.dtype.itemsize, self.dtype)
            fold(self.req, self.inputs[area], out)
        if self.mul is not None:    # (scale()'s product, without its choices)
            np.multiply(out, self.mul, out)
        elif self.factor != 1:
            scale(out, self.factor, 1)
        return out

    def reduce_stripe(self, a):
        """After GO: this rank's stripe of the result (:meth:`Board.reduce_stripe`'s steps)."""
        acc = self.acc
        if acc.size:
            inputs = self.inputs
            if self.unstaged:           # (stage left this rank's stripe out of the slot)
                inputs = inputs.copy()
                lo, hi = self.stripe
                inputs[self.board.rank] = a.reshape(-1)[lo:hi]
            fold(self.req, inputs, acc)
            if self.factor != 1:
                scale(acc, self.factor, 1)
        self.board.stripe_done()

    # -- rank 0 -------------------------------------------------------------------------------
    def all_open(self):
        """Rank 0: whether every other rank's open post is this lane's collective (as
        :meth:`Board.matches` finds: its signature, which fixes an allreduce's bytes, in its
        slot), their numbers those of ``next``; else the board's ``missing`` is a rank yet to
        post, or None when a post is another collective's."""
        board = self.board
        if self.epoch != board.epoch:   # (a signature read since: which are the lane's)
            vers = array.array("Q", [v if s == self.sig else _NEVER for v, s in board.known])
            self.vers, self.epoch = memoryview(vers)[1:], board.epoch
        if board.post_col == board.next_col and board.sigver_col == self.vers:
            return True
        nxt, vers = board.next, self.vers
        for r, _ in board.rows:         # (which rank, in rank order; or a post since)
            seq = board.post_col[r - 1]
            if seq < nxt[r]:
                board.missing = r
                return False
            if seq != nxt[r] or board.sigver_col[r - 1] != vers[r - 1]:
                board.missing = None    # (Board.matches reads the new signature)
                return False
        return True

    def answer(self, what):
        """Rank 0, its input staged: when every other rank's open post is this lane's
        collective, answer each with ``what`` (SHARED or GO) and return True; else answer
        nothing and return False (the board's ``missing`` says why)."""
        if not self.all_open():
            return False
        self.board.answer_open(what)
        return True

    def open_posts(self):
        """Rank 0: ``{rank: seq}`` of every other rank's open post when each is this lane's
        collective, else None."""
        if not self.all_open():
            return None
        nxt = self.board.next
        return {r: nxt[r] for r, _ in self.board.rows}
