"""The engine: one background thread per process that negotiates and runs every collective.

User threads call :meth:`Engine.submit`, which queues a request and returns a Handle.  The
engine thread sends new requests to the coordinator (rank 0), which answers with the ordered
list of collectives that every rank has submitted (see :mod:`hora.core.negotiation`); every
rank runs that list in that order on the transport.  That is what lets ranks submit in
different orders without deadlock, and what lets rank 0 fail a mismatched collective on every
rank with one message.  In the steady state of training, rank 0 answers the last rank to
submit before it asks (the offer), so that its collectives start without that round trip.

When idle the thread sleeps in a ``poll`` over its wake-up pipe, its control connections and
every peer's data connection, so it uses no CPU and still notices a dead peer at once.  When
the job breaks, every pending and later collective fails with the same error, naming the rank.

The package, one idea a file:

- ``__init__``: :class:`Engine`, the facade: submit, drive, shutdown; its life cycle
  (:class:`Life`); the step every thread that runs the engine takes; failures.
- :mod:`.queue`: the submission queue and its wake-up pipe.
- :mod:`.pacing`: when requests go to the coordinator (HORA_CYCLE_TIME).
- :mod:`.conn`: a control connection carrying the typed messages of :mod:`hora.core.wire`.
- :mod:`.coordinator`: rank 0's side: requests, responses, stall inspector, autotune.
- :mod:`.worker`: every other rank's side: request, then follow rank 0's answers.
- :mod:`.offer`: the offer protocol, as pure state.
- :mod:`.small`: small allreduces, reduced by rank 0.
- :mod:`.board`: blocking small allreduces of a one-host job, through shared memory.
- :mod:`.folds`: the board's arithmetic: reductions in rank order, copies in and out.
- :mod:`.executor`: runs the agreed collectives on the transport and the data planes.

Layer: core.
"""
import enum
import logging
import os
import select
import threading
import time

import numpy as np

from ...errors import (CollectiveTimeoutError, DuplicateNameError, HoraError,
                       HoraInternalError, HoraRankFailedError, HoraShutdownError,
                       TransportBrokenError, TransportClosedError)
from .. import stats, timeline
from ..dataplane import spin_budget
from ..handles import Handle
from ..fusion import scale
from ..messages import ALLGATHER, ALLREDUCE, BARRIER, BROADCAST, KIND_NAMES, Request
from ..wire import Abort, HostPost, Nudge
from .board import (BOARD_BYTES, GO, PATIENCE_S, RESULT, SHARED, STRIPE_BYTES, copy_out,
                    waited)
from .conn import Conn, first_dead, heard, tell_dead
from .coordinator import CoordinatorSide
from .executor import Executor, count_collective, count_reduced, results_of
from .pacing import Pacer
from .queue import SubmissionQueue
from .small import prescaled
from .worker import WorkerSide

__all__ = ["Engine", "Life"]

log = logging.getLogger(__name__)

_SHUTDOWN = object()        # queued by shutdown(): this rank leaves
_QUICK_KINDS = (ALLREDUCE, BROADCAST, ALLGATHER)    # and barriers: what the board may take
_RELEASE_DELAY_S = 0.5      # after a failure, data connections close this much later
_IDLE_LOOK_S = 0.5          # an idle engine reads its control connections at least this often
_BOARD_STEP_S = 50e-6       # rank 0 waiting on the board reads its sockets this often
_HINT_S = 10e-3             # and tells the stall inspector that every rank came this often
_NAP_S = 2e-3               # a board call waiting for a control message sleeps this long at most
_DONE, _STOPPED, _ENGINE = "done", "stopped", "engine"      # how _settle ended


def _first(results):
    return results[0]


def _passed(why, board=None, posts=None):
    """A board call goes to the engine (``why``: counted in the metrics' board_fallbacks);
    ``board``: its open ``posts`` go too."""
    stats.counters.fallbacks[why] += 1
    if board is not None:
        board.fall_back(posts)
    return _ENGINE, None


def _row_items(shape):
    """The elements of one row of an allgather's input of ``shape`` (a 0-d array: one)."""
    return int(np.prod(shape[1:], dtype=np.int64))


def _nbytes(arrays):
    """The bytes of a collective's (host) arrays."""
    if len(arrays) == 1:
        return arrays[0].nbytes
    return sum(a.nbytes for a in arrays)


class Life(enum.IntEnum):
    """Where an engine is in its life; it only ever moves down this list."""
    RUNNING = 0     # takes collectives
    CLOSING = 1     # shutdown() was called: takes no more; the engine has not seen it yet
    LEAVING = 2     # the engine told the coordinator; it serves what is in flight until
                    # every rank has left
    STOPPED = 3     # the job is over (every rank left): the engine thread ends
    FAILED = 4      # an error stopped the engine (``failure``), or shutdown cut it short:
                    # every pending collective failed, and every later one fails


RUNNING, CLOSING, LEAVING, STOPPED, FAILED = Life


class Engine:
    """The background thread of one process.

    Args:
        rank, size: this process's place in the job.
        transport: a connected transport (``rank``, ``size``, ``sendrecv``, ``watch``).
        ctrl: rank 0: ``{worker_rank: socket}``; other ranks: the socket to rank 0.
        settings: :class:`hora.config.Settings`.
        clock: monotonic clock (injectable for tests).
        crowded: more ranks than CPUs share this rank's CPUs (Topology.crowded): the
            waits of :meth:`drive` yield the CPU between their looks.
        plane: the data plane of the global set's large collectives (hora.core.dataplane);
            None: the TCP algorithms of hora.backends.ring.
        device_planes: ``{device type: plane}`` (hora.backends.nccl): collectives of device
            arrays (``Request.device``) run there, on the framework's tensors where they live.
        plain_only: the job key is derivable: control messages are decoded as plain data
            only (see :class:`~hora.core.engine.conn.Conn`).
        board: the :class:`~hora.core.engine.board.Board` of a one-host job, or None.
    """

    def __init__(self, rank, size, transport, ctrl, settings, clock=time.monotonic,
                 crowded=False, plane=None, device_planes=None, plain_only=False, board=None):
        self.rank = rank
        self.size = size
        self._t = transport
        self._clock = clock
        self._state = RUNNING
        self._failure = None
        self._queue = SubmissionQueue()
        self._plane = plane
        self.device_planes = device_planes or {}
        self._exec = Executor(rank, size, transport, self._queue.release, plane,
                              self.device_planes, self._set_cycle)
        timeout = settings.transport_timeout
        if rank == 0:
            self._side = CoordinatorSide(
                size, {r: Conn(s, r, timeout, plain_only) for r, s in ctrl.items()},
                self._exec, settings, clock, self._set_cycle)
        else:
            self._side = WorkerSide(Conn(ctrl, 0, timeout, plain_only), self._exec)
        self._ctrl_fds = [c.fileno() for c in self._side.conns]
        # whether the coordinator has nothing under way (_busy: a step less than _side.idle)
        self._coord_idle = self._side.coord.idle if rank == 0 else self._side.idle
        self._pacer = Pacer(settings.cycle_time_ms / 1000.0, clock)
        self._caller = threading.local()    # will_wait, blocking: see submit_waiting()
        self._board = board
        self._hinted = 0.0                  # rank 0: when a board call last told the inspector
        self._in_board = False              # rank 0: a caller is in a board call (holds _drive)
        self._board_lock = threading.Lock()  # one board call at a time in this process
        self._quick = {}                    # allreduce_now's requests, by their arguments
        self.lanes = {}                     # name -> the Lane that allreduce_now made last
        self._standins = {}                 # key in flight -> the Handle of abort()'s stand-in
        self._board_timeout = settings.transport_timeout
        # a host's leader, in a job on several hosts: the other leaders, in host order, and
        # the host rounds played so far (_board_hosts)
        self._leaders = (tuple(r for r in board.leaders if r != rank)
                         if board is not None and board.rank == 0 else ())
        self._round = 0
        self._round_seen = {}               # when the next round was first seen posted
        self._round_ended = 0.0             # when the last one ended
        self._retreats = set()              # signatures the other hosts sent to the engine
        self._held_back = False             # a board call left messages in a connection
        if self._leaders and rank == 0:
            self._side.relay = self._leaders
        # the control sockets a leader hears the other leaders' host posts on
        self._leader_fds = ({self._side.workers[r].fileno() for r in self._leaders} if rank == 0
                            else set(self._ctrl_fds))
        self._drive = threading.Lock()      # held by whoever runs _step: engine or caller
        self._spin_s = spin_budget(settings)
        self._crowded = crowded
        self._policy = transport.policy     # hora.backends.base.WaitPolicy, shared with the planes
        self._policy.blame = self._blame
        self._thread = threading.Thread(target=self._main, name=f"hora-engine-{rank}",
                                        daemon=True)

    def start(self):
        self._thread.start()
        return self

    @property
    def life(self):
        """The engine's :class:`Life`."""
        return self._state

    @property
    def offers_taken(self):
        """Offers this worker ran (tests, benchmarks); 0 on rank 0."""
        return getattr(self._side, "offers_taken", 0)

    # -- user side ------------------------------------------------------------------------
    @property
    def alive(self):
        return self._state < STOPPED

    def failure(self, what="this collective"):
        """The error to raise for ``what`` now that the engine is not running."""
        if self._failure is not None:
            err = type(self._failure)(f"{what} failed: {self._failure}")
            if isinstance(self._failure, HoraRankFailedError):
                err.rank = self._failure.rank
            return err
        return HoraShutdownError(f"{what}: hora has been shut down on this rank")

    def submit(self, request, arrays, finish=None, inplace=False):
        """Queue one collective; return its Handle.  Called from any user thread.

        ``inplace``: an allreduce writes its results into ``arrays`` (which must be writable).
        """
        rec = timeline._recorder
        quick = (getattr(self._caller, "blocking", False) and not request.device
                 and request.process_set == 0 and request.error is None
                 and (request.kind == BARRIER and self.quick_fits(0)
                      or request.kind in _QUICK_KINDS and self.quick_fits(_nbytes(arrays))))
        key = self._take_name(request)
        handle = Handle(request.name, self, finish)
        handle.inplace = inplace
        if quick:
            started = time.monotonic() if rec is not None else 0.0
            outcome, flat = self._settle(request, arrays, _nbytes(arrays))
            if outcome is _DONE:
                timeline.board_span(rec, request, started, _nbytes(arrays))
                handle._set_result(self._results(request, arrays, flat, inplace))
                return handle
            if outcome is _STOPPED:
                self._stopped(request, handle)
                return handle
        self._enqueue(request, arrays, handle, key,
                      getattr(self._caller, "will_wait", False), rec)
        return handle

    def quick_fits(self, nbytes):
        """Whether a blocking allreduce of ``nbytes`` of host memory (or a barrier: 0) on the
        global set may settle at once, without the engine (a one-rank job, or the board's):
        :meth:`allreduce_now`, or :meth:`submit`'s own try."""
        return (self._board is not None or self.size == 1) and nbytes <= BOARD_BYTES

    def allreduce_now(self, a, op, name, prescale, postscale, inplace):
        """The blocking allreduce of the numpy array ``a`` (a number dtype; ``op`` a plain
        op, ``name`` drawn) on the global set, for a caller that :meth:`quick_fits` allows:
        :meth:`submit` and the wait, without the handle and the thread-local flags while the
        board settles it.  Returns the result (``a`` itself when ``inplace``)."""
        quick = self._quick
        tkey = (name, op, a.dtype, a.shape, prescale, postscale)
        got = quick.get(tkey)
        if got is None:
            if len(quick) > 4096:
                quick.clear()
                self.lanes.clear()
            request = Request(name, ALLREDUCE, a.dtype.str, (a.shape,), op, -1,
                              float(prescale), float(postscale), None, 0, "")
            board = self._board
            sig = board and board.signature(request)
            lane = board and board.lane(request, sig, a.nbytes, a.dtype, a.shape)
            if lane is not None and lane.stripe is None:   # (a call of its own: see lane_now)
                if board.rank:
                    lane.call = board.lane_caller(lane, self, RUNNING)
                elif not lane.hosts:
                    lane.call = board.lane_caller0(lane, self, RUNNING, _HINT_S)
            got = quick[tkey] = (request, sig, (0, name), lane)
        request, sig, key, lane = got
        if lane is not None:            # (the callers' next look, ops._repeated: lane_now)
            self.lanes[name] = lane
            done = self.lane_now(lane, a, inplace)
            if done is not None:
                return done
        arrays = [a]
        q = self._queue
        mark = object()             # _take_name's check, without its call and its key
        taken = self._state is RUNNING and q.inflight.setdefault(key, mark) is mark
        if not taken:
            self._take_name(request)    # raises the refusal (or takes it: freed meanwhile)
        if inplace:             # where the board may put the result: a flat view of a
            out = a if a.ndim == 1 else a.reshape(-1) if a.flags.c_contiguous else None
        else:
            out = np.empty(a.size, a.dtype)
        rec = timeline._recorder
        started = time.monotonic() if rec is not None else 0.0
        outcome, flat = self._settle(request, arrays, a.nbytes, sig, out)
        if outcome is _DONE:        # _results, for one array
            timeline.board_span(rec, request, started, a.nbytes)
            count_reduced(flat.nbytes, "board", name)
            if flat is not out:     # a buffer of the board's, or of a one-rank job
                if out is None:     # (a not contiguous)
                    np.copyto(a, flat.reshape(a.shape))
                else:
                    np.copyto(out, flat)
            if not inplace:
                a = out.reshape(a.shape)
            self._queue.release(key)
            return a
        handle = Handle(name, self, _first)
        handle.inplace = inplace
        if outcome is _STOPPED:
            self._stopped(request, handle)
        else:
            self._enqueue(request, arrays, handle, key, self._spin_s > 0, rec)
        return handle.wait()

    def lane_now(self, lane, a, inplace):
        """The blocking allreduce of ``a`` through ``lane``: a :class:`~.board.Lane` (a SHARED
        round, a striped one, or a host round) of :attr:`lanes`, whose dtype and shape ``a``
        has (and writable when ``inplace``).  :meth:`_settle`'s board call in the fewest
        steps, since where the ranks outnumber the CPUs each step costs every round about
        twice over.  Returns what :meth:`allreduce_now` returns, or None before anything was
        taken: the caller takes the general path (``a`` is neither flat nor contiguous (of
        a striped lane: not contiguous), the name is in flight, the engine is not running,
        or another thread is on the board).
        Once posted, whatever the board does not settle goes on as :meth:`_settle` would.
        A call below STRIPE_BYTES is the lane's own (``lane.call``), which the callers take
        directly: a worker's (:meth:`~.board.Board.lane_caller`), and rank 0's on one host
        (:meth:`~.board.Board.lane_caller0`)."""
        if lane.call is not None:
            return lane.call(a, inplace)
        rec = timeline._recorder
        started = time.monotonic() if rec is not None else 0.0
        if lane.stripe is not None and not a.flags.c_contiguous:
            return None
        if not inplace:
            out = None              # (made by the reduction, or a copy of the result area)
        elif lane.flat:             # (``a`` has the lane's shape)
            out = a
        else:                       # (a contiguous array)
            out = a.reshape(-1) if a.flags.c_contiguous else None
            if out is None:
                return None
        lock = self._board_lock
        if self._state is not RUNNING or not lock.acquire(False):
            return None
        # the name in flight (_take_name's check, without its call): while this call holds
        # the board, the lane itself marks it, since no other call of this process can be
        # in the lane meanwhile; the engine's turn takes a mark of its own
        key = lane.key
        inflight = self._queue.inflight
        if inflight.setdefault(key, lane) is not lane:
            lock.release()
            return None
        board = self._board
        got = None
        try:
            if board.rank:          # (a striped lane's post)
                seq = board.lane_post(lane, a)
                got = board.wait_reply(seq, self._running, self._nudge, lane.req.name)
            else:
                got = self._lane_rank0(lane, a, board)
                if got == SHARED:
                    out = board.lane_fold(lane, out)
            if got == GO:             # (a striped lane: this rank's stripe, then the others')
                board.lane_stripe(lane, a)
                got = RESULT if board.wait_stripes(self._running, lane.req.name) else None
                if got:
                    out = copy_out(out, lane.result)
            elif got == RESULT:         # (a host round: the result is in the result area)
                out = copy_out(out, lane.result)
        except (CollectiveTimeoutError, TransportBrokenError) as e:
            got = self._board_broke(board, e)
        finally:
            if got == SHARED or got == RESULT:
                inflight.pop(key, None)
            elif inflight.get(key) is lane:     # (not cleared by a failure meanwhile)
                inflight[key] = object()
            lock.release()
        # (a call below STRIPE_BYTES takes the same steps in Board.lane_caller's closure, or
        # rank 0's on one host in Board.lane_caller0's, in one frame: a change of these is a
        # change of those too)
        if got == SHARED or got == RESULT:
            timeline.board_span(rec, lane.req, started, lane.nbytes)
            c = stats.counters      # (count_reduced's counts, in stats.Counters' lane_*)
            c.lane_calls += 1
            c.lane_bytes += lane.nbytes
            c.last_op = lane.named
            c.plane = "board"
            return a if inplace else out if lane.flat else out.reshape(lane.shape)
        return self._lane_tail(lane, a, inplace, got)

    def _lane_tail(self, lane, a, inplace, got):
        """After a lane's call that the board did not settle (``got``: rank 0's answer to
        fall back, or what :meth:`_settle` returns first, _ENGINE, _STOPPED, or None: the
        engine stopped): its failure, or the engine's result."""
        handle = Handle(lane.req.name, self, _first)
        handle.inplace = inplace
        if got is None or got is _STOPPED:
            self._stopped(lane.req, handle)
        else:                       # (a worker told to fall back: counted here)
            if self._board.rank and got != _ENGINE:
                _passed("told")
            self._enqueue(lane.req, [a], handle, lane.key, self._spin_s > 0,
                          timeline._recorder)
        return handle.wait()

    def _lane_rank0(self, lane, a, board):
        """Rank 0's side of :meth:`lane_now`: SHARED (RESULT: a host round's leader), or what
        :meth:`_settle` returns first (_ENGINE, _STOPPED).  Every other rank has often posted
        by the time rank 0 comes: one look settles it; otherwise the general wait
        (:meth:`_board_rank0`).  Rank 0's call below STRIPE_BYTES on one host takes the same
        steps in :meth:`~.board.Board.lane_caller0`'s closure: a change of these is a change of
        that too."""
        drive = self._drive
        if not (drive.acquire(False) or drive.acquire(timeout=1.0)):
            return _passed("drive")[0]
        self._in_board = True
        try:
            if lane.hosts:              # a leader of host rounds
                got = self._lane_hosts(lane, a, board)
            else:
                board.lane_stage(lane, a)
                got = SHARED if lane.stripe is None else GO
                busy = self._busy()
                if not busy and board.lane_answer(lane, got):
                    # (rank 0 came last: nobody was waited for; _count_wait, in fewer steps)
                    stats.counters.lane_unwaited += 1
                    now = self._clock()
                    if now - self._hinted > _HINT_S:
                        self._hint(now)
                elif busy or board.missing is None or not self._lane_wait(lane, board, got):
                    got = self._board_rank0(lane.req, [a], board, lane.sig, lane.nbytes, True)
                    if got is not SHARED and got is not GO:
                        got = got[0]
            if self._held_back:         # (see _heard_rounds)
                self._held_back = False
                self._stepped_to_end()
        finally:
            self._in_board = False
            drive.release()
        return got

    def _lane_wait(self, lane, board, what):
        """Rank 0 on a lane (its input staged) before every other rank posted: wait for
        their posts as :meth:`_board_rank0` does, in fewer steps, for at most
        :data:`_BOARD_STEP_S` (after which that wait reads the sockets); True when it
        answered them with ``what`` (:meth:`~.board.Board.lane_answer`), False when that
        wait takes over (rank 0 got busy, a post is not the lane's call, or the time is up).
        Where the ranks outnumber the CPUs, rank 0 comes first in a run of rounds now and
        then, and each of those rounds costs two of rank 0's turns on its CPU."""
        clock = self._clock
        started = clock()
        late = board.missing
        while True:
            bell = board.bell()
            if self._busy():
                return False
            if board.lane_answer(lane, what):
                self._count_wait(late, started)
                return True
            late = board.missing
            now = clock()
            if late is None or now - started > _BOARD_STEP_S:
                return False
            board.pause(started, now, bell, late)

    def _lane_hosts(self, lane, a, board):
        """A host leader's side of :meth:`lane_now`: RESULT, or what :meth:`_settle` returns
        first.  When every post of its host is in and is the lane's call, and nothing but
        the other leaders' posts of the next round was heard meanwhile, it plays that round
        at once: :meth:`_board_hosts` would find nothing to wait for and nothing to veto.
        Otherwise :meth:`_board_hosts`."""
        k = self._round + 1
        now = self._clock()
        posts = board.lane_posts(lane)
        if (posts is not None and now - self._round_ended <= PATIENCE_S / 2
                and lane.sig not in self._retreats and not self._busy()
                and all(key[1] == k and m.sig for key, m in self._side.host_msgs.items())):
            got = self._host_round(lane.req, [a], board, posts, lane.sig, lane.nbytes, k, now)
        else:
            got = self._board_hosts(lane.req, [a], board, lane.sig, lane.nbytes)
        return RESULT if got[0] is _DONE else got[0]

    def _board_broke(self, board, e):
        """A board call met ``e`` (a timeout, a broken connection): the job is broken, as a
        transfer's failure says; this host's posts still open go to the failed engine too.
        Returns _STOPPED."""
        if board.rank == 0:
            board.fall_back(board.open_posts())
        self._crashed(e)
        return _STOPPED

    def _take_name(self, request):
        """Mark ``request``'s name in flight (refused while the engine is not running, or
        while the name is already in flight); returns its key.  A name that this rank's
        stand-in for a refused call holds (:meth:`abort`) is waited for instead: it is let
        go once every rank has submitted the name, and a program that caught the refusal
        may well make the call again at once, as every other rank does."""
        q = self._queue
        key = (request.process_set, request.name)
        while True:
            with q.lock:
                if self._state is not RUNNING:
                    raise self.failure(f"{KIND_NAMES[request.kind]} {request.name!r}")
                mark = object()
                if q.inflight.setdefault(key, mark) is mark:
                    self._standins.pop(key, None)
                    return key
                standin = self._standins.get(key)
                if standin is None or standin.poll():
                    raise DuplicateNameError(
                        f"a collective named {request.name!r} is already in flight on rank "
                        f"{self.rank}; names must be unique among outstanding collectives")
            try:
                standin.wait()          # (its name goes before its handle is done)
            except HoraError:
                pass                    # the stand-in's answer: the refusal, or the job's end

    def _enqueue(self, request, arrays, handle, key, will_wait, rec):
        """The engine's turn for ``request`` (its name already in flight)."""
        q = self._queue
        with q.lock:
            if self._state is not RUNNING:
                q.inflight.pop(key, None)
                raise self.failure(f"{KIND_NAMES[request.kind]} {request.name!r}")
            q.items.append((request, arrays, handle))
        if rec is not None:
            rec.submitted[key] = time.monotonic()
        if not will_wait:
            q.wake()

    def abort(self, request):
        """This rank's call of a collective failed its argument checks, so it will never
        submit it: send ``request`` (which names it, with ``request.error`` saying what went
        wrong) in its place, so that the ranks that submit it fail at once, naming this rank
        and its error, instead of stalling.  Nobody waits for it here (the caller raises its
        own error); the name stays in flight until every member has submitted it."""
        q = self._queue
        with q.lock:
            key = (request.process_set, request.name)
            mark = object()
            if self._state is not RUNNING or q.inflight.setdefault(key, mark) is not mark:
                return                  # in flight: that collective is a real one; let it be
            handle = Handle(request.name, self)
            q.items.append((request, [], handle))
            standins = self._standins
            if len(standins) > 64:      # (those let go and never called again)
                for k in [k for k, h in standins.items() if h.poll()]:
                    del standins[k]
            standins[key] = handle      # (see _take_name)
        q.wake()

    def stop_job(self, reason):
        """Rank 0, from any thread, without waiting: end the job on every rank (as a stall
        shutdown does), each failing its collectives with HoraInternalError(``reason``)."""
        if self.rank != 0:
            raise ValueError(f"stop_job() is rank 0's; this is rank {self.rank}")
        self._side.stop_reason = reason
        self._queue.wake()

    def submit_waiting(self, start):
        """Run ``start()``, which submits collectives that this thread waits for at once (or
        soon) and then runs the engine itself (:meth:`drive`): the engine thread is not woken
        for them, which would only make the two threads contend; its periodic look sends them
        should the caller not come.  Returns what ``start`` returns."""
        caller = self._caller
        caller.blocking = True          # small allreduces may settle on the board at once
        caller.will_wait = self._spin_s > 0
        try:
            return start()
        finally:
            caller.will_wait = caller.blocking = False

    def shutdown(self, abort=False, timeout=None):
        """Leave the job: wait until every rank has called shutdown (unless ``abort``)."""
        q = self._queue
        with q.lock:
            if self._state is RUNNING:
                self._state = CLOSING
                q.items.append(_SHUTDOWN)
        if abort:
            self._fail(HoraShutdownError("hora was shut down on this rank"))
        q.wake()
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._fail(HoraShutdownError("hora was shut down on this rank"))
            self._thread.join(2.0)
        self._t.close()
        for plane in (self._plane, *self.device_planes.values()):
            if plane is not None:
                plane.close()
        self._exec.close()
        q.close()

    def _advance(self, state):
        """Move the life cycle on to ``state`` (never back)."""
        with self._queue.lock:
            if state > self._state:
                self._state = state

    def _set_cycle(self, cycle_ms):
        self._pacer.cycle_s = cycle_ms / 1000.0

    # -- running the engine: the engine thread, or a waiting caller -------------------------
    def _main(self):
        try:
            self._loop()
        except Exception as e:
            self._crashed(e)
        finally:
            self._advance(STOPPED)

    def _loop(self):
        while self._state < STOPPED:
            with self._drive:
                if self._state >= STOPPED:
                    return
                finished, busy = self._step()
            if finished:
                return
            if not busy:
                self._idle()

    def drive(self, handle, deadline=None):
        """Called by a thread about to wait for ``handle``: if the engine thread is asleep,
        make progress here instead until ``handle`` is done (or the monotonic ``deadline``).

        A thread hand-off costs tens of microseconds each way, and a process woken by a
        socket as much again; a caller that runs the engine's steps itself and polls its
        sockets without sleeping pays neither, which is what makes a small collective fast.
        It polls for the spin budget (renewed whenever it sends requests: the budget is for
        their answer), then sleeps where the engine thread would (its control connections
        and wake-up pipe), so that the answer wakes this thread alone rather than the
        engine thread, which would then have to wake this one.  Where more ranks than CPUs
        share this rank's CPUs, each look is followed by a yield of the CPU (MPI's ranks do
        the same when oversubscribed): the peer awaited may need it.  With no budget
        (HORA_SPIN_TIME_US=0) the engine thread does the work."""
        if self._spin_s <= 0 or not self._drive.acquire(blocking=False):
            self._ensure_progress(handle)
            return
        stopped = False
        pacer = self._pacer
        try:
            if self._state >= STOPPED:
                return
            spin_end = self._clock() + self._spin_s
            self._policy.spin_until = spin_end
            while not handle.poll():
                sent = pacer.last_send
                if self._step()[0]:
                    stopped = True
                    self._advance(STOPPED)
                    break
                if handle.poll():
                    break
                now = self._clock()
                if pacer.last_send != sent:
                    spin_end = max(spin_end, now + self._spin_s)
                    self._policy.spin_until = spin_end
                if now <= spin_end:
                    if self._crowded:   # a peer sharing this CPU may be the one awaited
                        os.sched_yield()
                    continue
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._policy.spin_until = 0.0
                self._idle(left)
        except Exception as e:
            self._crashed(e)
        finally:
            self._policy.spin_until = 0.0
            self._drive.release()
        if not handle.poll() or stopped:
            self._queue.wake()          # the engine thread takes over from here

    def _ensure_progress(self, handle):
        """``handle`` was submitted without waking the engine thread and drive() could not
        run: wake it now."""
        if not handle.poll():
            self._queue.wake()

    def _step(self):
        """One pass that never waits for new work: take queued requests, send what is due to
        the coordinator, handle what arrived, run every collective that is ready.  Only the
        holder of ``_drive`` calls it.  Returns (the job is over, requests were queued)."""
        batch = self._queue.take()
        leaving = False
        pending = self._exec.pending
        for item in batch:
            if item is _SHUTDOWN:
                leaving = True
                self._advance(LEAVING)
            else:
                pending[(item[0].process_set, item[0].name)] = item
                self._pacer.unsent.append(item[0])
        send = self._pacer.take(pending, self._state is LEAVING)
        if send:
            now = time.monotonic()
            sent = stats.counters.sent
            for req in send:
                sent[(req.process_set, req.name)] = now
            rec = timeline._recorder
            if rec is not None:
                for req in send:
                    rec.queued((req.process_set, req.name), now)
                if rec.mark_cycles:
                    rec.instant("CYCLE", now)
        finished = self._side.step(send, leaving)
        board = self._board
        if board is not None and board.rank == 0 and not self._in_board:
            board.serve(self._busy, self._clock)
            if self._leaders:
                self._serve_round(board)
        return finished, bool(batch)

    # -- the board (hora.core.engine.board) ---------------------------------------------------
    def _busy(self):
        """Rank 0: whether the engine has anything under way, which a board call must not
        overtake (the collective may be among it, or ranks may be waiting on it)."""
        return not (self._state is RUNNING and not self._exec.pending and not self._queue.items
                    and not self._pacer.unsent and self._coord_idle())

    def _settle(self, req, arrays, size, sig=None, out=None):
        """Try to settle the blocking allreduce or barrier ``req`` (of ``size`` bytes) at once:
        alone, or on the board (``sig``: the board's signature of ``req``, when known).
        Returns ``(_DONE, flat)`` (``flat``: the reduced values, either ``out`` (a flat array
        of the request's dtype, which this call may write the result into) or a buffer to
        copy out before the next board call; None for a barrier), ``(_STOPPED, None)`` (the
        engine stopped meanwhile: raise its failure) or ``(_ENGINE, None)``: submit it to the
        engine."""
        bcast = gather = False
        if req.kind != ALLREDUCE:
            bcast, gather = req.kind == BROADCAST, req.kind == ALLGATHER
            if (bcast and not 0 <= req.root < self.size     # (the engine names the error)
                    or gather and not _row_items(req.shapes[0])):
                # (an allgather's row of no elements would not tell its rows from its bytes)
                return _ENGINE, None
        if self.size == 1:
            if req.kind == BARRIER:
                return _DONE, None
            if bcast or gather:
                return _DONE, arrays[0].reshape(-1).copy()
            acc = np.frombuffer(prescaled(req, arrays), dtype=np.dtype(req.dtype)).copy()
            scale(acc, req.postscale, 1)
            return _DONE, acc
        board = self._board
        if (bcast or gather) and (size >= STRIPE_BYTES or len(board.leaders) > 1):
            return _ENGINE, None    # (they take a SHARED round: small, on one host)
        if size > board.capacity or not self._board_lock.acquire(False):
            return _ENGINE, None    # (across hosts the capacity stops short of the stripes)
        try:
            if sig is None:
                sig = board.signature(req)
            if len(sig) > board.sig_max:
                return _ENGINE, None
            if board.rank != 0:         # a worker of its host's board
                seq = board.post(sig, req, arrays, size)
                got = board.wait_reply(seq, self._running, self._nudge, req.name)
                if got is None:     # the engine stopped: a peer died, or the job is over
                    return _STOPPED, None
                if got == RESULT:
                    return _DONE, (None if req.kind == BARRIER
                                   else board.result(req.dtype, size))
                if got != GO and got != SHARED:
                    return _passed("told")
            else:                       # rank 0, or another host's leader
                if not (self._drive.acquire(False)   # (cheaper than with a timeout)
                        or self._drive.acquire(timeout=1.0)):
                    return _passed("drive")
                self._in_board = True
                try:
                    got = self._board_rank0(req, arrays, board, sig, size)
                    if self._held_back:     # (see _heard_rounds)
                        self._held_back = False
                        self._stepped_to_end()
                finally:
                    self._in_board = False
                    self._drive.release()
                if got is not GO and got is not SHARED:
                    return got
            if got == SHARED:
                if bcast:
                    return _DONE, board.copy_shared(req, size)
                if gather:
                    return _DONE, board.gathered(req)
                return _DONE, board.reduce_shared(req, size, out)
            # GO: the stripes, without the engine's lock (its thread watches the peers)
            board.reduce_stripe(req, size)
            if not board.wait_stripes(self._running, req.name):
                return _STOPPED, None
            return _DONE, board.result(req.dtype, size)
        except (CollectiveTimeoutError, TransportBrokenError) as e:
            # (a host round's send to rank 0 may find its connection gone)
            return self._board_broke(board, e), None
        finally:
            self._board_lock.release()

    def _board_rank0(self, req, arrays, board, sig, size, staged=False):
        """The side of a board call of the board's rank 0: what :meth:`_settle` returns, GO
        (stripes) or SHARED (every rank reduces every input, below STRIPE_BYTES).  Rank 0
        waits for the other ranks' posts and answers them; in a job on several hosts every
        host's leader plays a host round instead (:meth:`_board_hosts`).  ``staged``: rank
        0's input is in its slot already (:meth:`_lane_rank0`)."""
        if len(board.leaders) > 1:
            return self._board_hosts(req, arrays, board, sig, size)
        clock = self._clock
        started = last_step = clock()
        workers = board.size - 1
        late = 0                        # who came last: rank 0, or one that posted after it
        striped = size >= STRIPE_BYTES
        shared = not striped and req.kind != BARRIER
        if not staged and (striped or shared):
            board.stage(req, arrays, size)
        while True:
            bell = board.bell()
            posts = board.open_posts()
            if self._busy():
                return _passed("busy", board, posts)
            if len(posts) == workers:
                # (the ranks of an allgather may bring different numbers of rows)
                if not board.matches(posts, sig, None if req.kind == ALLGATHER else size):
                    return _passed("differ", board, posts)
                if striped:
                    board.go(posts)
                elif shared:
                    board.share(posts)
                else:                           # a barrier
                    board.release(posts)
                self._count_wait(late, started)
                return GO if striped else SHARED if shared else (_DONE, None)
            late = missing = board.missing      # (a rank that has not posted)
            now = clock()
            if now - started > PATIENCE_S:
                return _passed("patience", board, posts)
            if now - last_step > _BOARD_STEP_S:     # hear the sockets
                last_step = now
                if self._stepped_to_end():
                    return _passed("stopped", board, board.open_posts())
            board.pause(started, now, bell, missing)

    def _count_wait(self, late, started):
        """Rank 0 settled a board call that waited for rank ``late`` (0: for nobody) since
        ``started``: count it as the coordinator counts its negotiations, and tell the stall
        inspector now and then that every rank came."""
        now = self._clock()
        c = stats.counters
        c.waits += 1
        c.last[late] += 1
        if late:
            c.wait_s += now - started
        if now - self._hinted > _HINT_S:
            self._hint(now)

    def _hint(self, now):
        """Tell the stall inspector that every rank came (at ``now``)."""
        self._hinted = now
        seen = self._side.coord.last_submit
        for r in range(self.size):
            seen[r] = now

    # -- host rounds: the boards of a job on several hosts -------------------------------------
    def _board_hosts(self, req, arrays, board, sig, size):
        """A host's leader in a board call (global rank 0 leads the first host): wait for
        the host's posts, then play host round ``k`` (:meth:`_host_round`).  Before it posts
        the round, the leader vetoes it instead (and sends the host's posts to the engine)
        when another leader already has, when it is busy, when its host's posts differ, or
        when they did not all come within PATIENCE_S."""
        clock = self._clock
        started = last_step = clock()
        workers = board.size - 1
        k = self._round + 1
        # after a pause, read what came meanwhile first: a leader that has waited for this
        # round longer than PATIENCE_S asks for its veto (:meth:`_urged`)
        if started - self._round_ended > PATIENCE_S / 2 and self._stepped_to_end():
            return _passed("stopped")
        if sig in self._retreats:       # the other hosts sent it to the engine meanwhile
            self._retreats.discard(sig)
            return _passed("retreat", board, board.open_posts())
        heard = True                    # the sockets were read since the last look at them
        while True:
            bell = board.bell()
            posts = board.open_posts()
            if heard:                   # (only a step changes what was heard, or _busy())
                heard = False
                if self._side.host_msgs:    # (empty when the others have not gone ahead)
                    if self._vetoed(self._round_msgs(k)):   # another host went to the engine
                        return self._veto(board, posts, k, "vetoed", send=False)
                    if self._urged(k):
                        return self._veto(board, posts, k, "urged", sig)
                if self._busy():
                    return self._veto(board, posts, k, "busy", sig)
            if len(posts) == workers:
                if not board.matches(posts, sig, size):
                    return self._veto(board, posts, k, "differ", sig)
                return self._host_round(req, arrays, board, posts, sig, size, k, started)
            missing = board.missing
            now = clock()
            if now - started > PATIENCE_S:
                return self._veto(board, posts, k, "patience", sig)
            if now - last_step > _BOARD_STEP_S:     # hear the sockets (the other leaders)
                last_step, heard = now, True
                if self._stepped_to_end():
                    return _passed("stopped", board, board.open_posts())
            board.pause(started, now, bell, missing)

    def _host_round(self, req, arrays, board, posts, sig, size, k, started):
        """Host round ``k`` of a leader whose host has posted ``sig``: send every other
        leader this host's partial result (a :class:`HostPost`; rank 0 relays a leader's to
        the others), wait for theirs, and, when every leader posted ``sig``, add the hosts'
        partials in host order, the same bits on every host, into the host's result area;
        otherwise (a veto, another collective) every leader sends its host to the engine."""
        mine = b"" if req.kind == BARRIER else board.partial(req, arrays, size)
        self._send_round(k, sig, mine)
        need = len(self._leaders)
        # (steps from now on: the wait for the host's posts before took its own, and a step
        # there made at once would cost several microseconds on most rounds)
        last_step = self._clock()
        urged = False
        late = None                     # a leader this one waited for, if any
        # the others' posts of round k: often already here (read them without a select)
        if not self._heard_rounds():
            return _passed("stopped", board, posts)
        msgs = self._round_msgs(k)
        while not (len(msgs) == need or self._vetoed(msgs)):
            if late is None:
                late = next(r for r in self._leaders if r not in msgs)
            now = self._clock()
            if now - started > self._board_timeout:     # (_settle sends the posts on)
                self._end_round(k)
                late = [r for r in self._leaders if r not in msgs]
                raise CollectiveTimeoutError(
                    f"rank {self.rank}: the leaders of the other hosts (rank(s) {late}) did "
                    f"not post {req.name!r} on their boards within {self._board_timeout:g} s "
                    f"while their engines lived (HORA_TRANSPORT_TIMEOUT); are they stopped?")
            if not urged and now - started > PATIENCE_S:
                urged = True            # the leaders yet to post this round should veto it
                self._send_round(-k, b"", b"")
            # an engine step to watch the peers' lives, or when another rank than a leader
            # sent something; when only leaders did, just their posts are read: a step of
            # rank 0 costs several microseconds of a CPU the other ranks may need
            ready = select.select(self._ctrl_fds, (), (), 0)[0]
            if now - last_step > _BOARD_STEP_S or not self._leader_fds.issuperset(ready):
                last_step = now
                if self._stepped_to_end():
                    return _passed("stopped", board, posts)
                if not urged and self.rank == 0 and self._busy():
                    urged = True        # (rank 0's engine has work: see _urged)
                    self._send_round(-k, b"", b"")
                msgs = self._round_msgs(k)
                continue
            if ready:
                if not self._heard_rounds():
                    return _passed("stopped", board, posts)
                msgs = self._round_msgs(k)
                continue
            if not self._wait_socket(started, now):
                return _passed("stopped", board, posts)
        self._end_round(k)
        want = len(mine)
        if not all(m.sig == sig and len(m.data) == want for m in msgs.values()):
            return _passed("vetoed" if self._vetoed(msgs) else "differ", board, posts)
        out = None
        if req.kind != BARRIER:         # (in host order)
            out = board.combine(req, [mine if r == self.rank else msgs[r].data
                                      for r in board.leaders], size)
        board.release(posts)
        if self.rank == 0:
            self._count_wait(late or 0, started)
        return _DONE, out

    def _round_msgs(self, k):
        """``{leader: HostPost}``: the other leaders' posts (or vetoes) of host round ``k``
        heard so far."""
        msgs = self._side.host_msgs
        return {r: msgs[(r, k)] for r in self._leaders if (r, k) in msgs}

    def _urged(self, k):
        """Whether a leader that posted host round ``k`` asked those that have not to veto
        it: it waited PATIENCE_S for them, or (rank 0) its engine has work under way: a rank
        submitted a collective to the engine (perhaps this one, asynchronously, which this
        host's posts then wait for in vain), joined, or leaves."""
        msgs = self._side.host_msgs
        return any((r, -k) in msgs for r in self._leaders)

    @staticmethod
    def _vetoed(msgs):
        return any(not m.sig for m in msgs.values())

    def _send_round(self, k, sig, data):
        """This leader's post (``sig``, ``data``) of host round ``k``, or its veto (empty
        ``sig``): rank 0 sends it to every other leader, a leader to rank 0, which relays it."""
        msg = HostPost(self.rank, k, sig, data)
        if self.rank == 0:
            for r in self._leaders:
                self._side.workers[r].send(msg)
        else:
            self._side.conn.send(msg)

    def _veto(self, board, posts, k, why, sig=b"", send=True):
        """Veto host round ``k`` (``why``: the reason counted in the metrics): this host's
        ``posts`` go to the engine, and so do every other host's posts of that round
        (``send``: say so; not when another leader has).  ``sig``: the signature of this
        leader's own call, when it is in one: a leader that hears of the veto before it comes
        to that call sends the call to the engine at once, as the others did, rather than
        play the next round alone."""
        _passed(why, board, posts)
        if send:
            self._send_round(k, b"", sig)
        self._end_round(k)
        return _ENGINE, None

    def _end_round(self, k):
        """Host round ``k`` is decided here: forget what was heard of it (and before)."""
        self._round = k
        self._round_ended = self._clock()
        msgs = self._side.host_msgs
        for r in self._leaders:         # the round's own posts (often all there is)
            msgs.pop((r, k), None)
        if msgs:                        # pleas to veto it, older rounds (later ones stay)
            for key in [key for key in msgs if abs(key[1]) <= k]:
                del msgs[key]

    def _serve_round(self, board):
        """A leader outside a board call (every engine step): veto the next host round when
        another leader has posted it and this one is busy (the host's ranks may wait on the
        engine) or has not posted it within PATIENCE_S (they are elsewhere in the program);
        a round another leader vetoed meanwhile is over here too (the others wait for no
        post of it), so that the next board call plays the round the others play next."""
        while True:
            k = self._round + 1
            msgs = self._round_msgs(k)
            if not msgs:
                return
            vetoed = self._vetoed(msgs)
            why = ("idle vetoed" if vetoed else "idle busy" if self._busy()
                   else "idle urged" if self._urged(k)
                   else "idle patience" if waited(self._round_seen, 0, k,
                                                  self._clock()) >= PATIENCE_S else None)
            if why is None:
                return
            # the other hosts go to the engine with the round's collective: this host's
            # ranks should too, when they come to it
            if len(self._retreats) > 64:
                self._retreats.clear()
            # (a veto names the vetoing leader's call, when it was in one)
            self._retreats.update(m.sig or m.data for m in msgs.values() if m.sig or m.data)
            if vetoed:                  # a round this host did not play: it is over
                self._end_round(k)
                _passed(why)
            else:
                self._veto(board, board.open_posts(), k, why)

    def _stepped_to_end(self):
        """One engine step from a board call (to hear the sockets); True when the job ended
        or broke meanwhile."""
        try:
            finished = self._step()[0]
        except Exception as e:      # as drive() does: every waiter gets the failure
            self._crashed(e)
            finished = True
        if finished:
            self._advance(STOPPED)
        return finished

    def _heard_rounds(self):
        """Read the host posts that came (:meth:`WorkerSide.hear_rounds`); False when the
        control connections broke meanwhile (every waiter gets the failure).  Messages of
        other kinds held back meanwhile get an engine step before the board call ends: no
        socket would wake the engine for them (their bytes have been read)."""
        try:
            if self._side.hear_rounds():
                self._held_back = True
            return True
        except Exception as e:      # as drive() does
            self._crashed(e)
            return False

    def _wait_socket(self, started, now):
        """Between two looks of a board call that waits for a control message: poll for
        the spin budget (yielding the CPU where it is crowded), then sleep on the sockets.
        False when a peer's death was seen meanwhile (every waiter gets the failure): the
        call is over, and the news it may have taken off the control connections (another
        rank's Dead message, read to name the rank that died first) comes no more."""
        if now - started < self._spin_s:
            if self._crowded:
                os.sched_yield()
            return True
        try:
            self._idle(_NAP_S, listen=True)
        except Exception as e:      # as drive() does: a peer died; every waiter gets it
            self._crashed(e)
            return False
        return True

    def _running(self):
        return self._state < STOPPED

    def _stopped(self, req, handle):
        """A board call's engine stopped while it waited: ``handle`` gets the failure."""
        self._queue.release((req.process_set, req.name))
        handle._set_error(self.failure(f"{KIND_NAMES[req.kind]} {req.name!r}"))

    def _nudge(self):
        """A worker's post waits: wake rank 0's engine, which may be asleep."""
        if self._drive.acquire(timeout=0.1):
            try:
                self._side.conn.send(Nudge())
            except Exception:       # noqa: BLE001 - the engine thread sees a broken connection
                pass
            finally:
                self._drive.release()

    def _results(self, req, arrays, flat, inplace):
        """A settled call's results: ``flat`` holds the reduced values of ``arrays`` in order
        (None: a barrier, which has none); counts it and lets its name go."""
        if req.kind == ALLREDUCE:
            count_reduced(flat.nbytes, "board", req.name)
            outs = results_of(flat, arrays, inplace)
        elif flat is None:              # a barrier
            count_collective(req.kind, req.name)
            outs = None
        else:                           # a broadcast, an allgather
            count_collective(req.kind, req.name, arrays[0].nbytes)
            outs = flat.reshape(arrays[0].shape if req.kind == BROADCAST
                                else (-1,) + arrays[0].shape[1:])
        self._queue.release((req.process_set, req.name))
        return outs

    def _idle(self, limit=None, listen=False):
        """Sleep until a control message, a wake-up or the next look is due (at most
        ``limit`` s, and at most _IDLE_LOOK_S: often enough for the stall inspector, whose
        looks are at least that far apart).  ``listen``: a control message wakes it in any
        case (a board call across hosts waits for one)."""
        timeout = limit
        pacer = self._pacer
        if pacer.hold_until is not None:
            left = max(0.0, pacer.hold_until - self._clock())
            timeout = left if timeout is None else min(timeout, left)
        # Control messages wake the engine while this rank has collectives in flight (and
        # the coordinator while it serves process sets without rank 0).  Otherwise they wait
        # for the next step, which a caller of a blocking collective may run itself (an engine
        # thread woken by them would only fight that caller for the GIL and the CPU), or for
        # the periodic look below (stack questions of the stall inspector, aborts).  Peers'
        # deaths are still seen at once, on the data connections.
        listen = (listen or self._exec.pending or pacer.unsent or self._state is LEAVING
                  or (self.rank == 0 and len(self._exec.sets) > 1))
        q = self._queue
        fds = [q.wake_fd, *self._ctrl_fds] if listen else [q.wake_fd]
        # the periodic look also sends requests queued without a wake-up (submit_waiting)
        # whose caller has not run the engine itself yet
        timeout = _IDLE_LOOK_S if timeout is None else min(timeout, _IDLE_LOOK_S)
        if q.wake_fd in self._t.watch(fds, timeout=timeout):
            q.seen()                        # make sure the next step empties the pipe

    # -- failures ---------------------------------------------------------------------------
    def _crashed(self, e):
        """Fail every pending and later collective after ``e`` stopped the engine.  A hang-up
        that follows rank 0's ``Abort`` (a stall shutdown: every rank closes its connections
        soon after it fails) fails it as the Abort does, when the Abort has arrived: a rank
        short of CPU may see the hang-ups before it reads its control connection."""
        if isinstance(e, (TransportBrokenError, HoraRankFailedError)):
            said = self._abort_heard()
            if said is not None:
                e = HoraInternalError(said)
        if isinstance(e, (TransportBrokenError, HoraRankFailedError)):
            rank = getattr(e, "rank", None)
            self._tell_others(rank, str(e))
            self._fail(HoraRankFailedError(str(e), rank=rank))
        elif isinstance(e, TransportClosedError):
            self._fail(HoraShutdownError(str(e)))
        elif isinstance(e, HoraError):
            self._fail(e)
        else:                   # a bug: still fail every waiter rather than hang them
            log.error("hora engine on rank %s crashed", self.rank, exc_info=e)
            self._fail(HoraInternalError(f"the hora engine crashed: {e!r}"))
        if not isinstance(e, TransportClosedError):
            self._release_peers()

    def _abort_heard(self):
        """The text of rank 0's ``Abort``, when one has arrived (read or not), else None."""
        try:
            return next((m.text for m in heard(self._side.conns) if m.__class__ is Abort), None)
        except Exception:   # noqa: BLE001 - a failure is being handled: it stays the failure
            return None

    def _fail(self, error):
        q = self._queue
        with q.lock:
            if self._failure is None and not isinstance(error, HoraShutdownError):
                self._failure = error
            items = list(q.items)
            q.items.clear()
            q.inflight.clear()
            pending, self._exec.pending = self._exec.pending, {}
            self._state = FAILED
        for item in items:
            if item is not _SHUTDOWN:
                item[2]._set_error(self.failure(f"{KIND_NAMES[item[0].kind]} {item[0].name!r}"))
        for req, _, handle in pending.values():
            handle._set_error(self.failure(f"{KIND_NAMES[req.kind]} {req.name!r}"))

    def _tell_others(self, rank, message):
        """Spread the news of a dead rank over the control plane (rank 0 relays), so that
        ranks that see several peers vanish at once can name the one that died first."""
        if rank is not None:
            tell_dead(self._side.conns, rank, message)

    def _blame(self, peers):
        """Which of ``peers`` died first, if the control plane has said so (else None):
        the transport asks when several peers hang up at once (see :func:`.conn.first_dead`)."""
        return first_dead(self._side.conns, self._clock, self.rank != 0)

    def _release_peers(self):
        """After this engine failed: close its data connections shortly, so that a peer
        still blocked in a transfer with this process (alive: a broken connection, a stall
        shutdown) sees a hang-up at once instead of waiting for HORA_TRANSPORT_TIMEOUT.
        The delay lets every rank see the original failure first, so that it names it."""
        timer = threading.Timer(_RELEASE_DELAY_S, self._t.close)
        timer.daemon = True
        timer.start()
