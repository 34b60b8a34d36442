"""The board's calls: a blocking collective settled on the board by the calling thread, and
handed to the engine whenever the board does not settle it.

:class:`BoardCalls` is what the engine's facade calls for a blocking call that may settle at
once (``Engine.submit`` of a blocking call, ``Engine.allreduce_now``, ``Engine.lane_now``),
and what its steps call on rank 0 (:meth:`BoardCalls.serve`).  It reaches the engine only
through a :class:`Port`: the in-flight marks of the names, the engine's life, whether it has
work under way, one step of it, and the way into it for a call the board sends there.  The
board's decisions are :mod:`.board_rules`; its memory and words :class:`~.board.Board`; the
host rounds of a job on several hosts :mod:`.host_rounds`.

A call's life on the board: the caller takes the board (one call at a time in a process)
and marks the name in flight; a worker posts and waits for rank 0's answer; rank 0 stages
its input, waits for every post, checks them (:func:`.board_rules.rank0_verdict`) and
answers; every rank then reduces (SHARED), reduces its stripe (GO) or copies the result
(RESULT).  Told to fall back, or failing, the call goes on in the engine as if the board did
not exist.

Layer: core.
"""
import threading
import time

import numpy as np

from ...errors import CollectiveTimeoutError, TransportBrokenError
from .. import stats, timeline
from ..fusion import scale
from ..messages import ALLGATHER, ALLREDUCE, BARRIER, BROADCAST, Request
from .board import FALLBACK, GO, RESULT, SHARED
from .board_port import DONE, ENGINE, STOPPED, passed
from .board_rules import NUDGE_S, declined, malformed, rank0_verdict, round_answer, stale
from .executor import count_collective, count_reduced, results_of
from .folds import copy_out
from .host_rounds import HostRounds
from .lanes import make_lane
from .small import prescaled

__all__ = ["BoardCalls", "settled"]

BOARD_STEP_S = 50e-6        # rank 0 waiting on the board takes an engine step this often: it
#                             hears its sockets (a dead peer, a message) within a few polls
HINT_S = 10e-3              # and tells the stall inspector that every rank came this often
DRIVE_WAIT_S = 1.0          # rank 0's call waits this long for another thread's engine step
QUICK_KEPT = 4096           # allreduce()'s requests kept for reuse (a loop makes a few hundred)


def _row_items(shape):
    """The elements of one row of an allgather's input of ``shape`` (a 0-d array: one)."""
    return int(np.prod(shape[1:], dtype=np.int64))


class BoardCalls:
    """The blocking calls of one process (global ``rank`` of ``size``) that may settle at
    once: on the ``board`` (None: none here), or alone in a job of one rank.  ``port``: the
    engine's :class:`~.board_port.Port`."""

    def __init__(self, board, port, size, rank):
        self.board, self.port, self.size = board, port, size
        self.lock = threading.Lock()        # one board call at a time in this process
        self.in_call = False                # rank 0: a caller is in a board call (holds drive)
        self.lanes = {}                     # name -> the Lane that allreduce() made last
        self._quick = {}                    # allreduce()'s requests, by their arguments
        self._hinted = 0.0                  # rank 0: when a call last told the inspector
        self.rounds = (HostRounds(board, port, self, rank)
                       if board is not None and board.rank == 0 and len(board.leaders) > 1
                       else None)

    # -- the entries ---------------------------------------------------------------------------
    def allreduce(self, a, op, name, prescale, postscale, inplace):
        """The blocking allreduce of the numpy array ``a`` (a number dtype; ``op`` a plain
        op, ``name`` drawn) on the global set: settled at once where it can be, else through
        the engine.  Returns the result (``a`` itself when ``inplace``)."""
        quick = self._quick
        tkey = (name, op, a.dtype, a.shape, prescale, postscale)
        got = quick.get(tkey)
        if got is None:
            if len(quick) > QUICK_KEPT:
                quick.clear()
                self.lanes.clear()
            request = Request(name, ALLREDUCE, a.dtype.str, (a.shape,), op, -1,
                              float(prescale), float(postscale), None, 0, "")
            board = self.board
            sig = board and board.signature(request)
            lane = board and make_lane(board, request, sig, a.nbytes, a.dtype, a.shape)
            got = quick[tkey] = (request, sig, (0, name), lane)
        request, sig, key, lane = got
        if lane is not None:            # (the callers' next look, ops._repeated: lane_call)
            self.lanes[name] = lane
            done = self.lane_call(lane, a, inplace)
            if done is not None:
                return done
        port = self.port
        mark = object()             # (take_name's check, without its call)
        if not (port.taking() and port.inflight.setdefault(key, mark) is mark):
            port.take_name(request)     # raises the refusal (or takes it: freed meanwhile)
        if inplace:             # where the board may put the result: a flat view of a
            out = a if a.ndim == 1 else a.reshape(-1) if a.flags.c_contiguous else None
        else:
            out = np.empty(a.size, a.dtype)
        rec = timeline._recorder
        started = time.monotonic() if rec is not None else 0.0
        outcome, flat = self.settle(request, [a], a.nbytes, sig, out)
        if outcome is DONE:
            timeline.board_span(rec, request, started, a.nbytes)
            count_reduced(flat.nbytes, "board", name)
            if flat is not out:     # a buffer of the board's, or of a one-rank job
                if out is None:     # (a not contiguous)
                    np.copyto(a, flat.reshape(a.shape))
                else:
                    np.copyto(out, flat)
            if not inplace:
                a = out.reshape(a.shape)
            port.release(key)
            return a
        return port.to_engine(request, [a], inplace, outcome is STOPPED)

    def lane_call(self, lane, a, inplace):
        """The blocking allreduce of ``a`` through ``lane`` (of :attr:`lanes`), whose dtype
        and shape ``a`` has (and writable when ``inplace``): :meth:`settle`'s board call in
        the fewest steps.  Returns the result, or None before anything was taken: the
        caller takes the general path (``a`` is neither flat nor contiguous (of a striped
        lane: not contiguous), the name is in flight, the engine is not running, or another
        thread is on the board).  Once posted, whatever the board does not settle goes on
        as :meth:`settle`'s would."""
        rec = timeline._recorder
        started = time.monotonic() if rec is not None else 0.0
        if not inplace:
            out = None              # (made by the reduction, or a copy of the result area)
        elif lane.flat:             # (``a`` has the lane's shape)
            out = a
        elif a.flags.c_contiguous:
            out = a.reshape(-1)
        else:
            return None
        if lane.stripe is not None and not a.flags.c_contiguous:
            return None
        port, lock = self.port, self.lock
        if not port.taking() or not lock.acquire(False):
            return None
        # the name in flight (take_name's check, without its call): while this call holds
        # the board, the lane itself marks it, since no other call of this process can be
        # in the lane meanwhile; the engine's turn takes a mark of its own
        key, inflight = lane.key, port.inflight
        if inflight.setdefault(key, lane) is not lane:
            lock.release()
            return None
        board = self.board
        got = None
        try:
            if board.rank:
                got = board.wait_reply(lane.post(a), port.running, port.nudge, NUDGE_S,
                                       lane.req.name)
            else:
                got = self._lane_rank0(lane, a)
            if got == SHARED:
                out = lane.fold_into(out)
            elif got == GO:         # (a striped lane: this rank's stripe, then the others')
                lane.reduce_stripe(a)
                got = RESULT if board.wait_stripes(port.running, lane.req.name) else None
                if got:
                    out = copy_out(out, lane.result)
            elif got == RESULT:     # (a host round: the result is in the result area)
                out = copy_out(out, lane.result)
        except (CollectiveTimeoutError, TransportBrokenError) as e:
            got = self.broke(e)
        finally:
            if got == SHARED or got == RESULT:
                inflight.pop(key, None)
            elif inflight.get(key) is lane:     # (not cleared by a failure meanwhile)
                inflight[key] = object()
            lock.release()
        if got == SHARED or got == RESULT:
            timeline.board_span(rec, lane.req, started, lane.nbytes)
            c = stats.counters      # (count_reduced's counts, in stats.Counters' lane_*)
            c.lane_calls += 1
            c.lane_bytes += lane.nbytes
            c.last_op = lane.named
            c.plane = "board"
            return a if inplace else out if lane.flat else out.reshape(lane.shape)
        if board.rank and got == FALLBACK:
            passed("told")
        return port.to_engine(lane.req, [a], inplace, got is None or got is STOPPED)

    def settle(self, req, arrays, size, sig=None, out=None):
        """Try to settle the blocking allreduce, broadcast, allgather or barrier ``req`` (of
        ``size`` bytes) at once: alone, or on the board (``sig``: the board's signature of
        ``req``, when known).  Returns ``(DONE, flat)`` (``flat``: the reduced values,
        either ``out`` (a flat array of the request's dtype, which this call may write the
        result into) or a buffer to copy out before the next board call; None for a
        barrier), ``(STOPPED, None)`` (the engine stopped meanwhile: raise its failure) or
        ``(ENGINE, None)``: submit it to the engine."""
        gather = req.kind == ALLGATHER
        rows = gather and _row_items(req.shapes[0])
        board = self.board
        if self.size == 1:
            if malformed(req.kind, req.root, 1, rows):
                return ENGINE, None
            return DONE, _alone(req, arrays)
        if sig is None:
            sig = board.signature(req)
        if declined(req.kind, size, req.root, self.size, rows, board.capacity,
                    len(board.leaders), len(sig), board.sig_max):
            return ENGINE, None
        if not self.lock.acquire(False):
            return ENGINE, None
        try:
            if board.rank != 0:         # a worker of its host's board
                seq = board.post(sig, req, arrays, size)
                got = board.wait_reply(seq, self.port.running, self.port.nudge, NUDGE_S,
                                       req.name)
                if got is None:     # the engine stopped: a peer died, or the job is over
                    return STOPPED, None
                if got == RESULT:
                    return DONE, (None if req.kind == BARRIER
                                  else board.result(req.dtype, size))
                if got != GO and got != SHARED:
                    return passed("told"), None
            else:                       # rank 0, or another host's leader
                got = self._as_rank0(self._rank0, req, arrays, sig, size)
                if got is not GO and got is not SHARED:
                    return got if got.__class__ is tuple else (got, None)
            if got == SHARED:
                if req.kind == BROADCAST:
                    return DONE, board.copy_shared(req, size)
                if gather:
                    return DONE, board.gathered(req)
                return DONE, board.reduce_shared(req, size, out)
            # GO: the stripes, without the engine's lock (its thread watches the peers)
            board.reduce_stripe(req, size)
            if not board.wait_stripes(self.port.running, req.name):
                return STOPPED, None
            return DONE, board.result(req.dtype, size)
        except (CollectiveTimeoutError, TransportBrokenError) as e:
            # (a host round's send to rank 0 may find its connection gone)
            return self.broke(e), None
        finally:
            self.lock.release()

    def serve(self):
        """A board's rank 0, from every engine step while no call of its own is on the
        board: send the open posts to the engine when the engine is busy (collectives
        pending, requests at the coordinator, leaving) or when they waited PATIENCE_S; a
        leader of host rounds also serves the other leaders' posts
        (:meth:`.host_rounds.HostRounds.serve`)."""
        if self.in_call:
            return
        board = self.board
        posts = board.open_posts()
        if posts:
            board.answer(stale(posts, self.port.busy(), board.seen, self.port.clock()),
                         FALLBACK)
        if self.rounds is not None:
            self.rounds.serve()

    # -- rank 0 --------------------------------------------------------------------------------
    def _as_rank0(self, fn, *args):
        """``fn(*args)`` as rank 0's side of a board call: holding the engine's steps (it
        takes them itself while it waits), so that nothing else answers the posts
        meanwhile; ``passed("drive")`` when another thread's step does not end within
        DRIVE_WAIT_S."""
        drive = self.port.drive
        if not (drive.acquire(False) or drive.acquire(timeout=DRIVE_WAIT_S)):
            return passed("drive")
        self.in_call = True
        self.board.mark_in_call(True)       # (the ranks waiting on it need not nudge)
        try:
            got = fn(*args)
            if self.rounds is not None:
                self.rounds.after_call()
        finally:
            self.board.mark_in_call(False)
            self.in_call = False
            drive.release()
        return got

    def _rank0(self, req, arrays, sig, size, staged=False):
        """Rank 0's side of a board call: GO or SHARED (then every rank reduces), or what
        :meth:`settle` returns (a barrier: ``(DONE, None)``).  It waits for the other ranks'
        posts and answers them; in a job on several hosts every host's leader plays a host
        round instead.  ``staged``: rank 0's input is in its slot already (a lane)."""
        board, port = self.board, self.port
        if self.rounds is not None:
            return self.rounds.call(req, arrays, sig, size)
        clock = port.clock
        started = last_step = clock()
        workers = board.size - 1
        late = 0                        # who came last: rank 0, or one that posted after it
        what = round_answer(req.kind, size)
        if not staged and what != RESULT:
            board.stage(req, arrays, size)
        # (the ranks of an allgather may bring different numbers of rows)
        nbytes = None if req.kind == ALLGATHER else size
        while True:
            bell = board.bell()
            posts = board.open_posts()
            now = clock()
            verdict = rank0_verdict(port.busy(), len(posts) == workers,
                                    lambda: board.matches(posts, sig, nbytes), now - started)
            if verdict is True:
                board.answer(posts, what)
                self.count_wait(late, started)
                return (DONE, None) if what == RESULT else what
            if verdict is not None:
                return passed(verdict, board, posts)
            late = missing = board.missing      # (a rank that has not posted)
            if now - last_step > BOARD_STEP_S:     # hear the sockets
                last_step = now
                if port.step():
                    return passed("stopped", board, board.open_posts())
            board.pause(started, now, bell, missing)

    def _lane_rank0(self, lane, a):
        """Rank 0's side of :meth:`lane_call`: SHARED or GO (RESULT: a leader of host
        rounds), or what :meth:`settle` returns first (ENGINE, STOPPED).  Every other rank
        has often posted by the time rank 0 comes: one look settles it; otherwise, after a
        short wait for the posts, the general one (:meth:`_rank0`)."""
        if lane.hosts:
            return self._as_rank0(self.rounds.lane_call, lane, a)
        return self._as_rank0(self._lane_round, lane, a)

    def _lane_round(self, lane, a):
        """:meth:`_lane_rank0` on one host, holding the engine's steps."""
        lane.stage(a)
        what = SHARED if lane.stripe is None else GO
        if not self.port.busy() and self._lane_wait(lane, what):
            return what
        got = self._rank0(lane.req, [a], lane.sig, lane.nbytes, True)
        return got[0] if got.__class__ is tuple else got

    def _lane_wait(self, lane, what):
        """Rank 0 on a lane, its input staged: answer the posts with ``what`` once every
        other rank posted the lane's call, waiting for them at most BOARD_STEP_S (after which
        :meth:`_rank0`'s wait, which reads the sockets, takes over); False when that wait
        takes over (rank 0 got busy, a post is not the lane's call, or the time is up).
        Where the ranks outnumber the CPUs, each round that rank 0 comes first to costs two
        of its turns on its CPU."""
        board, port = self.board, self.port
        if lane.answer(what):
            # (rank 0 came last: nobody was waited for)
            stats.counters.lane_unwaited += 1
            self._hint()
            return True
        clock = port.clock
        started = clock()
        late = board.missing
        while late is not None:
            bell = board.bell()         # (before the look: a post after it rings anew)
            if port.busy():
                return False
            if lane.answer(what):
                self.count_wait(late, started)
                return True
            late = board.missing
            now = clock()
            if late is None or now - started > BOARD_STEP_S:
                return False
            board.pause(started, now, bell, late)
        return False

    def count_wait(self, late, started):
        """Rank 0 settled a board call that waited for rank ``late`` (0: for nobody) since
        ``started``: count it as the coordinator counts its negotiations, and tell the stall
        inspector now and then that every rank came."""
        now = self.port.clock()
        c = stats.counters
        c.waits += 1
        c.last[late] += 1
        if late:
            c.wait_s += now - started
        self._hint(now)

    def _hint(self, now=None):
        """Tell the stall inspector that every rank came, at most every HINT_S."""
        now = self.port.clock() if now is None else now
        if now - self._hinted > HINT_S:
            self._hinted = now
            self.port.every_rank_came(now)

    def broke(self, e):
        """A board call met ``e`` (a timeout, a broken connection): the job is broken, as a
        transfer's failure says; this host's posts still open go to the failed engine too.
        Returns STOPPED."""
        board = self.board
        if board.rank == 0:
            board.answer(board.open_posts(), FALLBACK)
        self.port.crashed(e)
        return STOPPED


def _alone(req, arrays):
    """A blocking call of a job of one rank: its flat result (None for a barrier)."""
    if req.kind == BARRIER:
        return None
    if req.kind in (BROADCAST, ALLGATHER):
        return arrays[0].reshape(-1).copy()
    acc = np.frombuffer(prescaled(req, arrays), dtype=np.dtype(req.dtype)).copy()
    scale(acc, req.postscale, 1)
    return acc


def settled(req, arrays, flat, inplace):
    """A call settled at once: its results, counted (``flat`` holds the reduced values of
    ``arrays`` in order; None: a barrier, which has none)."""
    if req.kind == ALLREDUCE:
        count_reduced(flat.nbytes, "board", req.name)
        return results_of(flat, arrays, inplace)
    if flat is None:                # a barrier
        count_collective(req.kind, req.name)
        return None
    count_collective(req.kind, req.name, arrays[0].nbytes)      # a broadcast, an allgather
    return flat.reshape(arrays[0].shape if req.kind == BROADCAST
                        else (-1,) + arrays[0].shape[1:])
