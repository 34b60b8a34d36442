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

The package holds one idea a file (docs/architecture.md's table names each): this facade
(submit, drive, shutdown, the life cycle, failures), the control plane (:mod:`.coordinator` on
rank 0, :mod:`.worker`, :mod:`.leader` and :mod:`.relay` for a host's leader, :mod:`.conn`),
the board's small collectives in shared memory (:mod:`.board` and its companions), and the
executor that runs what was agreed (:mod:`.executor`).

Layer: core.
"""
import enum
import logging
import os
import threading
import time

from ...errors import (DuplicateNameError, HoraError, HoraInternalError, HoraRankFailedError,
                       HoraShutdownError, TransportBrokenError, TransportClosedError)
from .. import stats, timeline
from ..dataplane import spin_budget
from ..handles import Handle
from ..messages import ALLGATHER, ALLREDUCE, BARRIER, BROADCAST, KIND_NAMES
from ..wire import Abort, Nudge
from .board import BOARD_BYTES
from .board_calls import BoardCalls, settled
from . import board_port
from .board_port import Port
from .conn import first_dead, heard, tell_dead
from .executor import Executor
from .pacing import Pacer
from .queue import SubmissionQueue
from .sides import control_side

__all__ = ["Engine", "Life"]

log = logging.getLogger(__name__)

_SHUTDOWN = object()        # queued by shutdown(): this rank leaves
_QUICK_KINDS = (ALLREDUCE, BROADCAST, ALLGATHER)    # and barriers: what the board may take
_RELEASE_DELAY_S = 0.5      # after a failure, data connections close this much later
_IDLE_LOOK_S = 0.5          # an idle engine reads its control connections at least this often


def _first(results):
    return results[0]


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
        ctrl: the :class:`hora.core.bootstrap.Ctrl`: the control connection up (to rank 0 or
            this host's leader; None on rank 0) and those that come to this rank.
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
        board: this host's :class:`~hora.core.engine.board.Board` (the job's, on one
            host), or None.
    """

    def __init__(self, rank, size, transport, ctrl, settings, clock=time.monotonic,
                 crowded=False, plane=None, device_planes=None, plain_only=False, board=None,
                 hosts=None):
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
        self._kept = False      # a data read kept control messages (_keep): no sleep before a step
        self._side, down = control_side(rank, size, ctrl, self._exec, settings, clock,
                                        self._set_cycle, hosts, plain_only, self._keep,
                                        board is not None and board.rank != 0)
        self._ctrl_fds = [c.fileno() for c in self._side.conns]
        self._serves = bool(down)           # rank 0, a host's leader: others' requests come
        # a host's leader passes its host's messages on as they come, whatever it does itself
        self._relay_fds = [c.fileno() for c in down.values()] if rank else []
        # whether the coordinator has nothing under way (_busy: a step less than _side.idle)
        self._coord_idle = self._side.coord.idle if rank == 0 else self._side.idle
        self._pacer = Pacer(settings.cycle_time_ms / 1000.0, clock)
        self._caller = threading.local()    # will_wait, blocking: see submit_waiting()
        self._board = board
        self._standins = {}                 # key in flight -> the Handle of abort()'s stand-in
        self._drive = threading.Lock()      # held by whoever runs _step: engine or caller
        self._spin_s = spin_budget(settings)
        self._crowded = crowded
        self._policy = transport.policy     # hora.backends.base.WaitPolicy, shared with the planes
        self._policy.blame = self._blame
        # the calls that may settle at once (the board's, a one-rank job's), and what they
        # may touch of this engine
        self._calls = BoardCalls(board, Port(
            taking=self._taking, running=self._running, busy=self._busy,
            step=self._stepped_to_end, idle=self._idle, crashed=self._crashed,
            nudge=self._nudge, drive=self._drive, inflight=self._queue.inflight,
            take_name=self._take_name, release=self._queue.release,
            to_engine=self._to_engine, every_rank_came=self._every_rank_came,
            side=self._side, clock=clock, spin_s=self._spin_s, crowded=crowded), size, rank)
        self.lanes = self._calls.lanes      # name -> the Lane made last for it (ops._repeated)
        # the blocking allreduce of one numpy array, and its repetition through a lane
        # (hora.core.engine.board_calls)
        self.allreduce_now = self._calls.allreduce
        self.lane_now = self._calls.lane_call
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
            outcome, flat = self._calls.settle(request, arrays, _nbytes(arrays))
            if outcome is board_port.DONE:
                timeline.board_span(rec, request, started, _nbytes(arrays))
                outs = settled(request, arrays, flat, inplace)
                self._queue.release(key)
                handle._set_result(outs)
                return handle
            if outcome is board_port.STOPPED:
                self._stopped(request, handle)
                return handle
        self._enqueue(request, arrays, handle, key,
                      getattr(self._caller, "will_wait", False), rec)
        return handle

    def quick_fits(self, nbytes):
        """Whether a blocking allreduce of ``nbytes`` of host memory (or a barrier: 0) on the
        global set may settle at once, without the engine (a one-rank job, or the board's):
        ``allreduce_now`` (:meth:`.board_calls.BoardCalls.allreduce`), or :meth:`submit`'s
        own try."""
        return (self._board is not None or self.size == 1) and nbytes <= BOARD_BYTES

    def _to_engine(self, request, arrays, inplace, stopped):
        """A blocking call that did not settle at once (its name in flight): its failure when
        the engine ``stopped`` meanwhile, else its turn in the engine; waits for its result."""
        handle = Handle(request.name, self, _first)
        handle.inplace = inplace
        if stopped:
            self._stopped(request, handle)
        else:
            self._enqueue(request, arrays, handle, (request.process_set, request.name),
                          self._spin_s > 0, timeline._recorder)
        return handle.wait()

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
        if not handle.poll() or stopped or self._kept:
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
        if board is not None and board.rank == 0:
            self._calls.serve()         # (posts rank 0 does not settle in a call of its own)
        return finished, bool(batch)

    # -- what the board's calls may touch (board_port.Port) ----------------------------------
    def _taking(self):
        return self._state is RUNNING

    def _busy(self):
        """Rank 0: whether the engine has anything under way, which a board call must not
        overtake (the collective may be among it, or ranks may be waiting on it)."""
        return not (self._state is RUNNING and not self._exec.pending and not self._queue.items
                    and not self._pacer.unsent and self._coord_idle())

    def _stepped_to_end(self):
        """One engine step from a board call (to hear the sockets); True when the job ended
        or broke meanwhile."""
        try:
            finished = self._step()[0]
        except Exception as e:      # as drive() does: every waiter gets the failure
            self._crashed(e)
            finished = True
        if self._kept:
            self._queue.wake()      # (the call may end before its next step)
        if finished:
            self._advance(STOPPED)
        return finished

    def _every_rank_came(self, now):
        """Tell the stall inspector that every rank came (at ``now``): rank 0's board call
        settled a round."""
        seen = self._side.coord.last_submit
        for r in range(self.size):
            seen[r] = now

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

    def _idle(self, limit=None, listen=False):
        """Sleep until a control message, a wake-up or the next look is due (at most
        ``limit`` s, and at most _IDLE_LOOK_S: often enough for the stall inspector, whose
        looks are at least that far apart).  ``listen``: a control message wakes it in any
        case (a board call across hosts waits for one)."""
        timeout = limit
        if self._kept:              # control messages wait in a connection's keep
            self._kept = False
            timeout = 0.0
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
                  or (self._serves and len(self._exec.sets) > 1))
        q = self._queue
        fds = [q.wake_fd, *self._ctrl_fds] if listen else [q.wake_fd, *self._relay_fds]
        # the periodic look also sends requests queued without a wake-up (submit_waiting)
        # whose caller has not run the engine itself yet
        timeout = _IDLE_LOOK_S if timeout is None else min(timeout, _IDLE_LOOK_S)
        if q.wake_fd in self._t.watch(fds, timeout=timeout):
            q.seen()                        # make sure the next step empties the pipe

    def _keep(self):
        """A data read kept control messages for the next step (hora.backends.mux)."""
        self._kept = True

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
        return first_dead(self._side.conns, self._clock, self._side.parent)

    def _release_peers(self):
        """After this engine failed: close its data connections shortly, so that a peer
        still blocked in a transfer with this process (alive: a broken connection, a stall
        shutdown) sees a hang-up at once instead of waiting for HORA_TRANSPORT_TIMEOUT.
        The delay lets every rank see the original failure first, so that it names it."""
        timer = threading.Timer(_RELEASE_DELAY_S, self._t.close)
        timer.daemon = True
        timer.start()
