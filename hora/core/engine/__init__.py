"""The engine: one background thread per process that negotiates and runs every collective.

User threads call :meth:`Engine.submit`, which queues a request and returns a Handle.  The
engine thread sends new requests to the coordinator (rank 0), which answers with the ordered
list of collectives that every rank has submitted (see :mod:`hora.core.negotiation`); every
rank runs that list in that order on the transport.  That is what lets ranks submit in
different orders without deadlock, and what lets rank 0 fail a mismatched collective on every
rank with one message.  In the steady state of training, rank 0 answers the last rank to
submit before it asks (the offer, below), so that its collectives start without that round
trip.

When idle the thread sleeps in a ``poll`` over its wake-up pipe, its control connections and
every peer's data connection, so it uses no CPU and still notices a dead peer at once.  When
the job breaks, every pending and later collective fails with the same error, naming the rank.

Layer: core.
"""
import collections
import logging
import os
import pickle
import select
import struct
import threading
import time

import numpy as np

from ..backends import ring
from ..backends.group import SubsetTransport
from ..backends.tcp import watch_liveness
from ..errors import (CollectiveAbortedError, CollectiveMismatchError, DuplicateNameError,
                      HoraError, HoraInternalError, HoraRankFailedError, HoraShutdownError,
                      TransportBrokenError, TransportClosedError)
from .autotune import Autotuner
from .dataplane import spin_budget
from .handles import Handle
from .messages import (ADD_SET, ALLGATHER, ALLREDUCE, ALLTOALL, BARRIER, BROADCAST, JOIN,
                       KIND_NAMES, REDUCESCATTER, REMOVE_SET, Average, Max, Min, Product, Sum)
from . import stall
from .negotiation import Coordinator, nbytes
from ..rendezvous.safepickle import PayloadRefusedError, SafeDecoder
from .messages import Request as _Request

__all__ = ["Engine"]

log = logging.getLogger(__name__)

_LEN = struct.Struct("!I")
_SHUTDOWN = object()
_RELEASE_DELAY_S = 0.5  # after a failure, data connections close this much later
_IDLE_LOOK_S = 0.5      # an idle engine reads its control connections at least this often
_REDUCE = {Sum: np.add, Average: np.add, Min: np.minimum, Max: np.maximum,
           Product: np.multiply}


class _Conn:
    """A non-blocking, framed, pickled control connection (authenticated beforehand).

    ``plain_only``: decode frames as plain data and hora's ``Request`` only
    (:data:`_PLAIN`), for a job whose key is derivable from public values, where a peer that
    knows the key may be anyone; with a real secret only the job's own ranks can connect,
    and frames are unpickled as they are (about a microsecond less per small collective).
    """

    def __init__(self, sock, peer, timeout, plain_only=False):
        self.sock = sock
        self.peer = peer
        self.timeout = timeout
        self._decode = _PLAIN if plain_only else pickle.loads
        self._buf = bytearray()
        sock.setblocking(False)
        watch_liveness(sock)

    def fileno(self):
        return self.sock.fileno()

    def send(self, obj):
        data = memoryview(_frame(obj))
        deadline = time.monotonic() + self.timeout
        while data:
            try:
                data = data[self.sock.send(data):]
            except (BlockingIOError, InterruptedError):
                if time.monotonic() > deadline:
                    raise TransportBrokenError(f"rank {self.peer} stopped reading control "
                                               f"messages for {self.timeout:g} s", rank=self.peer)
                select.select([], [self.sock], [], 0.5)
            except OSError as e:
                raise TransportBrokenError(f"lost the control connection to rank {self.peer}: "
                                           f"{e}", rank=self.peer) from e

    def receive(self):
        """Every complete message that has arrived (never blocks).

        Messages that arrived before the peer closed are returned first; the close is
        reported (TransportBrokenError) by the call that finds nothing else to return.
        """
        eof = None
        while True:
            try:
                chunk = self.sock.recv(1 << 16)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:
                eof = TransportBrokenError(f"lost the control connection to rank {self.peer}: "
                                           f"{e}", rank=self.peer)
                break
            if not chunk:
                eof = TransportBrokenError(f"rank {self.peer} closed its control connection "
                                           f"(the process exited or was killed)", rank=self.peer)
                break
            self._buf += chunk
        out = []
        while len(self._buf) >= 4:
            (n,) = _LEN.unpack_from(self._buf)
            if len(self._buf) < 4 + n:
                break
            try:
                out.append(self._decode(bytes(self._buf[4:4 + n])))
            except PayloadRefusedError as e:
                log.error("rank %s sent a control message that is not plain data; dropping "
                          "its connection: %s", self.peer, e)
                raise TransportBrokenError(f"rank {self.peer} sent a control message hora "
                                           f"refuses: {e}", rank=self.peer) from e
            del self._buf[:4 + n]
        if eof is not None and not out:
            raise eof
        return out

    def send_nowait(self, obj):
        """Best effort, never blocks: for last words when the job is already broken."""
        try:
            self.sock.send(_frame(obj))
        except OSError:
            pass


# what a control message may hold when the job key is derivable: plain data, and requests
# (every field plain data too)
_PLAIN = SafeDecoder([_Request]).loads


def _frame(obj):
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _LEN.pack(len(payload)) + payload


class Engine:
    """The background thread of one process.

    Args:
        rank, size: this process's place in the job.
        transport: a connected transport (``rank``, ``size``, ``sendrecv``, ``watch``).
        ctrl: rank 0: ``{worker_rank: socket}``; other ranks: the socket to rank 0.
        settings: :class:`hora.config.Settings`.
        clock: monotonic clock (injectable for tests).
        plain_only: the job key is derivable: control messages are decoded as plain data
            only (see ``_Conn``).
    """

    def __init__(self, rank, size, transport, ctrl, settings, clock=time.monotonic,
                 local_size=1, plane=None, device_planes=None, plain_only=False):
        self.rank = rank
        self.size = size
        self._t = transport
        self._settings = settings
        self._clock = clock
        if rank == 0:
            self._coord = Coordinator(size, settings.fusion_threshold, settings.cache_capacity)
            self._workers = {r: _Conn(s, r, settings.transport_timeout, plain_only)
                             for r, s in ctrl.items()}
            self._ctrl_fds = [c.fileno() for c in self._workers.values()]
        else:
            self._coord = None
            self._to_coord = _Conn(ctrl, 0, settings.transport_timeout, plain_only)
            self._ctrl_fds = [self._to_coord.fileno()]
        self._lock = threading.Lock()
        self._queue = collections.deque()
        self._inflight = set()              # (set, name) submitted and not yet finished
        self._pending = {}                  # (set, name) -> (request, arrays, handle)
        self._failure = None
        self._closing = False
        self._done = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._last_stall_log = clock()
        self._stacks = stall.StackRequests()    # rank 0: stall stack questions
        self._scratch = {}
        self._fusion = {}
        self._unsent = []                   # requests held back to travel together
        self._hold_until = None
        self._last_send = float("-inf")
        self._cycle_s = settings.cycle_time_ms / 1000.0
        self._sets = {0: tuple(range(size))}     # process sets, as the coordinator decided
        self._payloads = {}                 # rank 0: (set, name) -> {rank: small input}
        self._cache_ids = {}                # request -> id in the coordinator's cache
        # the offer (rank 0 answers the last rank before it asks; see _make_offer):
        # rank 0: (worker, number, ids, responses) while one is out; a worker: (number, ids,
        # responses) while it may take it.  Both count the worker's messages that change
        # what rank 0 knows of it ("req", "accept", "bye"): an offer is good only if the
        # worker has sent none since rank 0 made it.
        self._offer = None
        self._offers_made = 0
        self._heard = dict.fromkeys(self._workers, 0) if rank == 0 else None
        self._offer_skip = 0                # rank 0: chances to let pass, after late offers
        self._offer_backoff = 0             # rank 0: what the next late offer doubles
        self._told = 0
        self.offers_taken = 0               # offers this worker ran (tests, benchmarks)
        self._tuner = self._make_tuner(settings) if rank == 0 and settings.autotune else None
        self._tuned_bytes = 0               # allreduce bytes this rank ran since the last look
        self._signalled = False             # a byte is (about to be) in the wake pipe
        self._caller = threading.local()    # will_wait: see submit_waiting()
        self._leaving = False
        self._stopped = False               # the job ended during a caller's drive()
        self._drive = threading.Lock()      # held by whoever runs _step: engine or caller
        self._spin_s = spin_budget(settings, local_size)
        transport.blame = self._blame
        # the data plane (shared memory, hierarchical: hora.core.dataplane) carries the
        # global set's large collectives; None: the TCP algorithms of hora.backends.ring
        self._plane = plane
        # device planes (hora.backends.nccl), by device type: collectives of device arrays
        # (Request.device) run there, on the framework's tensors where they live
        self.device_planes = device_planes or {}
        self._thread = threading.Thread(target=self._main, name=f"hora-engine-{rank}",
                                        daemon=True)

    def start(self):
        self._thread.start()
        return self

    # -- user side ------------------------------------------------------------------------
    @property
    def alive(self):
        return not self._done.is_set()

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
        with self._lock:
            if self._done.is_set() or self._closing:
                raise self.failure(f"{KIND_NAMES[request.kind]} {request.name!r}")
            key = (request.process_set, request.name)
            if key in self._inflight:
                raise DuplicateNameError(
                    f"a collective named {request.name!r} is already in flight on rank "
                    f"{self.rank}; names must be unique among outstanding collectives")
            self._inflight.add(key)
            handle = Handle(request.name, self, finish)
            handle.inplace = inplace
            self._queue.append((request, arrays, handle))
        if not getattr(self._caller, "will_wait", False):
            self._wake()
        return handle

    def abort(self, request):
        """This rank's call of a collective failed its argument checks, so it will never
        submit it: send ``request`` (which names it, with ``request.error`` saying what went
        wrong) in its place, so that the ranks that submit it fail at once, naming this rank
        and its error, instead of stalling.  Nobody waits for it here (the caller raises its
        own error); the name stays in flight until every member has submitted it."""
        with self._lock:
            key = (request.process_set, request.name)
            if self._done.is_set() or self._closing or key in self._inflight:
                return                  # in flight: that collective is a real one; let it be
            self._inflight.add(key)
            self._queue.append((request, [], Handle(request.name, self)))
        self._wake()

    def submit_waiting(self, start):
        """Run ``start()``, which submits collectives that this thread waits for at once (or
        soon) and then runs the engine itself (:meth:`drive`): the engine thread is not woken
        for them, which would only make the two threads contend; its periodic look sends them
        should the caller not come.  Returns what ``start`` returns."""
        if self._spin_s <= 0:
            return start()
        self._caller.will_wait = True
        try:
            return start()
        finally:
            self._caller.will_wait = False

    def shutdown(self, abort=False, timeout=None):
        """Leave the job: wait until every rank has called shutdown (unless ``abort``)."""
        with self._lock:
            if not self._closing:
                self._closing = True
                self._queue.append(_SHUTDOWN)
        if abort:
            self._fail(HoraShutdownError("hora was shut down on this rank"))
        self._wake()
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._fail(HoraShutdownError("hora was shut down on this rank"))
            self._thread.join(2.0)
        self._t.close()
        for plane in (self._plane, *self.device_planes.values()):
            if plane is not None:
                plane.close()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def _wake(self):
        if self._signalled:
            return                      # the engine has not read the last signal yet
        self._signalled = True
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass                        # already signalled, or closed at shutdown

    # -- engine thread --------------------------------------------------------------------
    def _main(self):
        try:
            self._loop()
        except Exception as e:
            self._crashed(e)
        finally:
            self._done.set()

    def _crashed(self, e):
        """Fail every pending and later collective after ``e`` stopped the engine."""
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

    def drive(self, handle, deadline=None):
        """Called by a thread about to wait for ``handle``: if the engine thread is asleep,
        make progress here instead until ``handle`` is done (or the monotonic ``deadline``).

        A thread hand-off costs tens of microseconds each way, and a process woken by a
        socket as much again; a caller that runs the engine's steps itself and polls its
        sockets without sleeping pays neither, which is what makes a small collective fast.
        It polls for the spin budget (renewed whenever it sends requests: the budget is for
        their answer), then sleeps where the engine thread would (its control connections
        and wake-up pipe), so that the answer wakes this thread alone rather than the
        engine thread, which would then have to wake this one.  The budget is zero when
        this host has more ranks than CPUs (spinning would take a CPU from a peer); the
        engine thread does the work then."""
        if self._spin_s <= 0 or not self._drive.acquire(blocking=False):
            self._ensure_progress(handle)
            return
        try:
            if self._done.is_set() or self._stopped:
                return
            spin_end = self._clock() + self._spin_s
            self._t.spin_until = spin_end
            while not handle.poll():
                sent = self._last_send
                if self._step()[0]:
                    self._stopped = True
                    break
                if handle.poll():
                    break
                now = self._clock()
                if self._last_send != sent:
                    spin_end = max(spin_end, now + self._spin_s)
                    self._t.spin_until = spin_end
                if now <= spin_end:
                    continue
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._t.spin_until = 0.0
                self._idle(left)
        except Exception as e:
            self._crashed(e)
        finally:
            self._t.spin_until = 0.0
            self._drive.release()
        if not handle.poll() or self._stopped:
            self._wake()            # the engine thread takes over from here

    def _ensure_progress(self, handle):
        """``handle`` was submitted without waking the engine thread and drive() could not
        run: wake it now."""
        if not handle.poll():
            self._wake()

    def _conns(self):
        return list(self._workers.values()) if self._coord is not None else [self._to_coord]

    def _tell_others(self, rank, message):
        """Spread the news of a dead rank over the control plane (rank 0 relays), so that
        ranks that see several peers vanish at once can name the one that died first."""
        if rank is None:
            return
        for conn in self._conns():
            if conn.peer != rank:
                conn.send_nowait(("dead", rank, message))

    def _blame(self, peers):
        """Which of ``peers`` died first, if the control plane has said so (else None).

        Rank 0 relays deaths; when rank 0 itself is gone without a word (its control
        connection closed with no "dead" message before the close), it is the one that died
        first: had another rank died before, rank 0 would have said so before failing.  That
        holds even when rank 0 is not among ``peers``: a rank starved of CPU may see a
        survivor that already gave up hang up before it sees rank 0's own hang-up."""
        deadline = self._clock() + 0.2
        closed = set()
        while True:
            for conn in self._conns():
                try:
                    messages = conn.receive()
                except TransportBrokenError:
                    closed.add(conn.peer)
                    continue
                for msg in messages:
                    if msg[0] == "dead":
                        return msg[1]
            if self._clock() >= deadline:
                if self._coord is None and 0 in closed:
                    return 0
                return None
            select.select([c.sock for c in self._conns()], [], [], 0.02)

    def _fail(self, error):
        with self._lock:
            if self._failure is None and not isinstance(error, HoraShutdownError):
                self._failure = error
            items = list(self._queue)
            self._queue.clear()
            self._inflight.clear()
            pending, self._pending = self._pending, {}
            self._done.set()
        for item in items:
            if item is not _SHUTDOWN:
                item[2]._set_error(self.failure(f"{KIND_NAMES[item[0].kind]} {item[0].name!r}"))
        for req, _, handle in pending.values():
            handle._set_error(self.failure(f"{KIND_NAMES[req.kind]} {req.name!r}"))

    def _loop(self):
        while not self._done.is_set():
            with self._drive:
                if self._done.is_set() or self._stopped:
                    return
                finished, busy = self._step()
            if finished:
                return
            if not busy:
                self._idle()

    def _step(self):
        """One pass that never waits for new work: take queued requests, send what is due to
        the coordinator, handle what arrived, run every collective that is ready.  Only the
        holder of ``_drive`` calls it.  Returns (the job is over, requests were queued)."""
        batch = self._drain_queue()
        for item in batch:
            if item is _SHUTDOWN:
                self._leaving = True
            else:
                self._pending[(item[0].process_set, item[0].name)] = item
                self._unsent.append(item[0])
        send = self._take_sendable(self._leaving)
        if self._coord is not None:
            finished = self._coordinate(send, _SHUTDOWN in batch)
        else:
            if send:
                if self._follow():          # first what came meanwhile, an offer among it
                    return True, bool(batch)
                self._request(send)
            if _SHUTDOWN in batch:
                self._to_coord.send(("bye",))
                self._told += 1
                self._offer = None
            finished = self._follow()
        return finished, bool(batch)

    def _request(self, send):
        """A worker: send ``send`` to the coordinator -- or, when they begin with exactly
        the collectives of rank 0's offer, accept it and run its answer at once."""
        ids = [self._cache_ids.get(q) for q in send]
        offer, self._offer = self._offer, None
        self._told += 1
        n = len(offer[1]) if offer is not None else 0
        if (n and tuple(ids[:n]) == offer[1]
                and all((q.process_set, q.name) in self._pending for q in send[:n])):
            rest, rest_ids = send[n:], ids[n:]
            self._to_coord.send(("accept", offer[0], [q for q, i in zip(rest, rest_ids)
                                                      if i is None],
                                 self._small_payloads(rest),
                                 [i for i in rest_ids if i is not None]))
            self.offers_taken += 1
            self._run_all(offer[2])         # "run" responses only: never the end of the job
            return
        self._to_coord.send(("req", [q for q, i in zip(send, ids) if i is None],
                             self._small_payloads(send), [i for i in ids if i is not None],
                             offer is not None))

    def _take_sendable(self, leaving):
        """The requests to send to the coordinator now.

        Requests go out at most once per cycle (HORA_CYCLE_TIME) while a burst lasts, that is
        while earlier requests of this rank are in flight or went out less than a cycle ago
        (gradients arriving during backward): the burst then travels, completes and is fused
        in fewer, larger collectives.  A request made while nothing is in flight and nothing
        was sent for a cycle goes at once, so a lone collective pays no delay.
        """
        if not self._unsent:
            return []
        now = self._clock()
        if self._cycle_s > 0 and not leaving:
            in_flight = len(self._pending) > len(self._unsent)
            if in_flight or now - self._last_send < self._cycle_s:
                if self._hold_until is None:
                    self._hold_until = max(now, self._last_send) + self._cycle_s
                if now < self._hold_until:
                    return []
        send, self._unsent, self._hold_until = self._unsent, [], None
        self._last_send = now
        return send

    def _drain_queue(self):
        if self._signalled:
            self._signalled = False     # cleared before reading: a later _wake writes again
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except (BlockingIOError, OSError):
                pass
        with self._lock:
            batch = list(self._queue)
            self._queue.clear()
        return batch

    def _idle(self, limit=None):
        """Sleep until a control message, a wake-up or the next look is due (at most
        ``limit`` s)."""
        timeout = limit
        s = self._settings
        if self._coord is not None and s.stall_check:
            look = max(0.5, min(s.stall_warning_s, s.stall_shutdown_s or s.stall_warning_s) / 4)
            timeout = look if timeout is None else min(timeout, look)
        if self._hold_until is not None:
            left = max(0.0, self._hold_until - self._clock())
            timeout = left if timeout is None else min(timeout, left)
        # Control messages wake the engine while this rank has collectives in flight (and
        # the coordinator while it serves process sets without rank 0).  Otherwise they wait
        # for the next step, which a caller of a blocking collective may run itself (an engine
        # thread woken by them would only fight that caller for the GIL and the CPU), or for
        # the periodic look below (stack questions of the stall inspector, aborts).  Peers'
        # deaths are still seen at once, on the data connections.
        listen = (self._pending or self._unsent or self._leaving
                  or (self._coord is not None and len(self._sets) > 1))
        fds = [self._wake_r, *self._ctrl_fds] if listen else [self._wake_r]
        # the periodic look also sends requests queued without a wake-up (submit_waiting)
        # whose caller has not run the engine itself yet
        timeout = _IDLE_LOOK_S if timeout is None else min(timeout, _IDLE_LOOK_S)
        if self._wake_r in self._t.watch(fds, timeout=timeout):
            self._signalled = True          # make sure the next step empties the pipe

    def _coordinate(self, new, leaving):
        now = self._clock()
        changed = bool(new or leaving)
        if new:
            self._coord.submit(0, new, now)
        if leaving:
            self._coord.depart(0)
        responses, ran = [], None
        for rank, conn in self._workers.items():
            for msg in conn.receive():
                if msg[0] in ("req", "accept", "bye"):
                    changed = True
                    self._heard[rank] += 1
                    offer = self._offer
                    if offer is not None and offer[0] == rank:
                        self._offer = None      # taken, declined, or crossed by the message
                        self._offer_outcome(crossed=msg[0] == "bye" or
                                            (msg[0] == "req" and not msg[4]))
                if msg[0] == "req":
                    self._take_request(rank, *msg[1:4], now)
                elif msg[0] == "accept":
                    if offer is None or offer[0] != rank or offer[1] != msg[1]:
                        raise HoraInternalError(f"rank {rank} accepted offer {msg[1]}, which "
                                                f"is not the one out ({offer and offer[1]})")
                    # rank's share of the offer, then the answer the worker has already
                    # run, which it must not get again
                    self._coord.submit(rank, (), now, offer[2])
                    got = [self._settle_small(r) for r in self._coord.take_responses()]
                    start = len(got) - len(offer[3])
                    if got[start:] != list(offer[3]):
                        raise HoraInternalError(f"offer {offer[1]} to rank {rank} was "
                                                f"{offer[3]}, and its acceptance gave {got}")
                    start += len(responses)
                    responses += got
                    ran = (rank, start, len(responses))     # responses[start:end]: run there
                    self._take_request(rank, *msg[2:], now)
                elif msg[0] == "bye":
                    self._coord.depart(rank)
                elif msg[0] == "dead":
                    raise HoraRankFailedError(msg[2], rank=msg[1])
                elif msg[0] == "stack":
                    self._got_stack(rank, msg[1], msg[2])
        responses += [self._settle_small(r) for r in self._coord.take_responses()]
        if responses:
            for rank, conn in self._workers.items():
                if ran is not None and ran[0] == rank:
                    mine = responses[:ran[1]] + responses[ran[2]:]
                    if mine:
                        conn.send(("resp", mine))
                else:
                    conn.send(("resp", responses))
        if changed and self._offer is None:
            self._make_offer()
        self._check_stalls(now)
        finished = self._run_all(responses)
        if self._tuner is not None and self._tuned_bytes:
            self._tune(self._tuned_bytes)
        self._tuned_bytes = 0
        return finished

    def _take_request(self, rank, full, small, ids, now):
        """Rank 0: ``rank`` submitted ``full`` requests and the cached ``ids`` (``small``: the
        inputs of its small allreduces)."""
        if small:
            reqs = {(q.process_set, q.name): q for q in full}
            reqs.update(((q.process_set, q.name), q) for q in
                        map(self._coord.cached_request, ids))
            for key, blob in small.items():
                self._payloads.setdefault(key, {})[rank] = (reqs[key], blob)
        self._coord.submit(rank, full, now, ids)

    # -- the offer ------------------------------------------------------------------------
    # In steady-state training each step's collectives are cached, and the last rank to
    # submit them waits for a round trip to rank 0 before it can run them.  When only one
    # worker is missing from everything pending, rank 0 sends it the answer in advance
    # (Coordinator.offer); if that worker's next requests begin with exactly those cached
    # collectives, it tells rank 0 it accepts and runs them at once, so the collectives
    # start without a round trip (rank 0 joins as soon as the acceptance arrives, while the
    # worker is already copying in).  Everything else goes the usual way: an offer is good
    # until the worker's next message, and rank 0 makes no other while one is out.  Small
    # allreduces are left out: their usual answer carries the result, which rank 0 cannot
    # compute before it has the last rank's input, and measured, offering them only made a
    # 4-byte allreduce slower (its ranks submit at nearly the same time, and an offer that
    # crosses the worker's request is work for nothing).
    def _make_offer(self):
        if self._tuner is not None or self.size < 2:
            return                  # autotune changes the fusion the offer was made with
        if self._offer_skip:
            self._offer_skip -= 1   # let this chance pass: recent offers came too late
            return
        got = self._coord.offer(SMALL_ALLREDUCE)
        if got is None:
            return
        rank, ids, responses = got
        self._offers_made += 1
        self._offer = (rank, self._offers_made, ids, responses)
        self._workers[rank].send(("offer", self._offers_made, self._heard[rank], ids,
                                  responses))

    def _offer_outcome(self, crossed):
        """An offer that crossed the worker's request (the ranks submit at nearly the same
        time, a tight loop) is work for nothing on both sides: after each such offer, let
        twice as many chances pass as the last time (up to 64 of the passes that could
        make one).  One that arrived in time resets that, taken or not (declined: the
        worker sends the step's requests in parts, and the next offer fits the rest)."""
        self._offer_backoff = min(64, max(1, 2 * self._offer_backoff)) if crossed else 0
        self._offer_skip = self._offer_backoff

    def _follow(self):
        for msg in self._to_coord.receive():
            if msg[0] == "offer":
                # good only if rank 0 made it after hearing everything this rank sent
                self._offer = (msg[1], tuple(msg[3]), msg[4]) if msg[2] == self._told else None
                continue
            if msg[0] == "dead":
                raise HoraRankFailedError(msg[2], rank=msg[1])
            if msg[0] == "abort":
                raise HoraInternalError(msg[1])
            if msg[0] == "stack?":
                self._answer_stack_request(msg[1])
                continue
            if self._run_all(msg[1]):
                return True
        return False

    def _run_all(self, responses):
        for resp in responses:
            if resp[0] == "shutdown":
                return True
            if resp[0] == "error":
                self._reject(*resp[1:])
            elif resp[0] == "value":
                self._take_values(*resp[1:])
            elif resp[0] == "cache":
                self._cache_ids[resp[2]] = resp[1]
            elif resp[0] == "tune":
                self._cycle_s = resp[1] / 1000.0
            else:
                self._execute(*resp[1:])
        return False

    # -- small allreduces, reduced by the coordinator ---------------------------------------
    # An allreduce of at most SMALL_ALLREDUCE bytes travels with its request: the coordinator
    # reduces every member's copy (in rank order, as the direct path does) and sends the
    # result with its answer, so the collective costs one round trip to rank 0 and no
    # data-plane step.  Everyone gets the coordinator's bytes: the result is identical.
    def _small_payloads(self, requests):
        """{name: this rank's prescaled bytes} for the small allreduces among ``requests``."""
        out = {}
        for req in requests:
            if (req.kind == ALLREDUCE and not req.device and req.error is None
                    and nbytes(req) <= SMALL_ALLREDUCE):
                key = (req.process_set, req.name)
                entry = self._pending.get(key)
                if entry is not None:   # None: already failed by another rank's error
                    out[key] = _prescaled(req, entry[1])
        return out

    def _settle_small(self, resp):
        """Rank 0: turn a ready allreduce whose every input came with its request into a
        ``("value", set, names, results)`` response."""
        if resp[0] not in ("run", "error"):
            return resp
        set_id, names = (resp[2], resp[3]) if resp[0] == "run" else (resp[1], resp[2])
        inputs = [self._payloads.pop((set_id, name), None) for name in names]
        if resp[0] != "run" or resp[1] != ALLREDUCE or resp[4] is not None:
            return resp
        members = self._coord.members(set_id)
        results = []
        for name, got in zip(names, inputs):
            got = dict(got or {})
            mine = self._pending.get((set_id, name)) if 0 in members else None
            if (mine is not None and not mine[0].device and mine[0].error is None
                    and nbytes(mine[0]) <= SMALL_ALLREDUCE):
                got[0] = (mine[0], _prescaled(mine[0], mine[1]))
            if any(r not in got for r in members):
                return resp                 # larger than SMALL_ALLREDUCE: the data plane
            req = got[members[0]][0]
            dtype = np.dtype(req.dtype)
            acc = np.frombuffer(got[members[0]][1], dtype=dtype).copy()
            for r in members[1:]:
                _REDUCE[req.op](acc, np.frombuffer(got[r][1], dtype=dtype), out=acc)
            _scale(acc, req.postscale, len(members) if req.op == Average else 1)
            results.append(acc.tobytes())
        return ("value", set_id, names, tuple(results))

    def _take_values(self, set_id, names, results):
        if self._tuner is not None:
            self._tuned_bytes += sum(len(b) for b in results)
        for name, blob in zip(names, results):
            entry = self._pending.pop((set_id, name), None)
            if entry is None:
                continue
            req, arrays, handle = entry
            flat = np.frombuffer(blob, dtype=np.dtype(req.dtype))
            outs, offset = [], 0
            for a in arrays:
                part = flat[offset:offset + a.size].reshape(a.shape)
                offset += a.size
                if handle.inplace:
                    a[...] = part
                    outs.append(a)
                else:
                    outs.append(part.copy())
            self._finish(req, handle, outs)

    # -- autotune (rank 0; hora.core.autotune) ----------------------------------------------
    def _make_tuner(self, settings):
        try:
            log_file = open(settings.autotune_log, "w") if settings.autotune_log else None
            tuner = Autotuner(settings.fusion_threshold, settings.cycle_time_ms, log_file,
                              settings.autotune_warmup_samples,
                              settings.autotune_steps_per_sample)
        except Exception as e:  # noqa: BLE001 - tuning must never fail the job
            log.warning("autotune disabled: %s", e)
            return None
        self._tune_log = log_file
        return tuner

    def _tune(self, nbytes):
        try:
            change = self._tuner.record(nbytes, self._clock())
        except Exception as e:  # noqa: BLE001 - tuning must never fail the job
            log.warning("autotune stopped: %r", e)
            self._tuner = None
            return
        if change is None:
            return
        fusion, cycle_ms = change
        self._coord.fusion_threshold = fusion
        self._cycle_s = cycle_ms / 1000.0
        for conn in self._workers.values():
            conn.send(("resp", [("tune", cycle_ms)]))
        if self._tuner.done:
            log.info("autotune chose HORA_FUSION_THRESHOLD=%d HORA_CYCLE_TIME=%g", fusion,
                     cycle_ms)
            if self._tune_log is not None:
                self._tune_log.close()
            self._tuner = None

    def _check_stalls(self, now):
        """Rank 0: warn about collectives some ranks have not submitted; past
        HORA_STALL_SHUTDOWN_TIME_SECONDS, fail the whole job naming them."""
        s = self._settings
        if not s.stall_check:
            return
        self._report_stacks(now)
        if s.stall_shutdown_s > 0:
            stuck = self._coord.stalled(now, s.stall_shutdown_s)
            if stuck:
                message = (f"collectives stalled for more than {s.stall_shutdown_s:g} s "
                           f"(HORA_STALL_SHUTDOWN_TIME_SECONDS); missing ranks:\n"
                           f"{_missing_lines(stuck)}")
                log.error("%s", message)
                for conn in self._workers.values():
                    conn.send_nowait(("abort", message))
                raise HoraInternalError(message)
        if now - self._last_stall_log < s.stall_warning_s:
            return
        missing = self._coord.stalled(now, s.stall_warning_s)
        if missing:
            self._last_stall_log = now
            self._warn_stall(now, missing)

    # -- running collectives --------------------------------------------------------------
    def _finish(self, req, handle, result=None, error=None):
        with self._lock:
            self._inflight.discard((req.process_set, req.name))
        if error is not None:
            handle._set_error(error)
        else:
            handle._set_result(result)

    def _reject(self, set_id, names, message, why, detail=None):
        for name in names:
            entry = self._pending.pop((set_id, name), None)
            if entry is None:
                continue
            if why == "aborted":
                error = CollectiveAbortedError(message, detail)
            elif why == "mismatch":
                error = CollectiveMismatchError(message)
            else:
                error = HoraShutdownError(message)
            self._finish(entry[0], entry[2], error=error)

    def _execute(self, kind, set_id, names, extra):
        if kind == ADD_SET:
            self._sets[extra[0]] = extra[1]
            results = [extra[0]]
        elif kind == REMOVE_SET:
            self._sets.pop(extra, None)
            results = [extra]
        elif kind == JOIN:
            results = [extra]
            set_id = 0
        members = self._sets.get(set_id, ())
        if self.rank not in members:
            return                          # a collective of a process set we are not in
        t = self._t if set_id == 0 else SubsetTransport(self._t, members)
        entries = [self._pending.pop((set_id, name), None) for name in names]
        if kind == ALLREDUCE:
            if entries[0] is None:          # this rank has joined: contribute zeros
                req = extra[1]
                if req.device:
                    zeros = self.device_planes[req.device].zeros(req.shapes, req.dtype)
                else:
                    zeros = [np.zeros(s, dtype=req.dtype) for s in req.shapes]
                self._allreduce(t, [(req, zeros, None)])
                return
            results = self._allreduce(t, entries)
        elif kind == BARRIER:
            results = [None]
        elif kind in (ALLGATHER, BROADCAST, ALLTOALL, REDUCESCATTER):
            req, arrays, _ = entries[0]
            run = {ALLGATHER: self._allgather, BROADCAST: self._broadcast,
                   ALLTOALL: self._alltoall, REDUCESCATTER: self._reducescatter}[kind]
            results = [run(t, req, arrays[0], extra)]
        for entry, result in zip(entries, results):
            if entry is not None:
                self._finish(entry[0], entry[2], result)

    def _allreduce(self, t, entries):
        req = entries[0][0]
        dtype = np.dtype(req.dtype)
        arrays = [a for _, arrs, _ in entries for a in arrs]
        # in place (``allreduce_``): results go back into the callers' arrays, so the buffer
        # can be the array itself or the reusable fusion buffer, never a fresh allocation
        inplace = all(h is not None and h.inplace for _, _, h in entries)
        if req.device:
            return self._device_allreduce(req, entries, arrays, inplace)
        total = sum(a.size for a in arrays)
        if len(arrays) == 1 and inplace and arrays[0].flags.c_contiguous:
            buf = arrays[0].reshape(-1)
        elif len(arrays) == 1:
            buf = np.array(arrays[0], dtype=dtype, copy=True, order="C").reshape(-1)
        else:
            buf = _reusable(self._fusion, dtype, total) if inplace else np.empty(total, dtype=dtype)
            np.concatenate([a.reshape(-1) for a in arrays], out=buf, casting="unsafe")
        _scale(buf, req.prescale, 1)
        if self._tuner is not None:
            self._tuned_bytes += buf.nbytes
        reduce_fn = _REDUCE[req.op]
        if total and not (self._use_plane(t, buf) and self._plane.allreduce(buf, reduce_fn)):
            ring.allreduce(t, buf, reduce_fn, _reusable(self._scratch, dtype, -(-total // t.size)))
        _scale(buf, req.postscale, t.size if req.op == Average else 1)
        # several arrays were packed into a buffer of their own: no array shares its memory
        fused = len(arrays) > 1
        results, offset = [], 0
        for _, arrs, _ in entries:
            outs = []
            for a in arrs:
                part = buf[offset:offset + a.size].reshape(a.shape)
                if inplace:
                    if fused or not np.shares_memory(a, buf):
                        np.copyto(a, part)
                    part = a
                outs.append(part)
                offset += a.size
            results.append(outs)
        return results

    def _use_plane(self, t, buf):
        return self._plane is not None and t is self._t and buf.nbytes > ring.SMALL

    def _device_allreduce(self, req, entries, arrays, inplace):
        """Device arrays (global set only): the device plane fuses, reduces and scales them
        where they live."""
        if self._tuner is not None:
            self._tuned_bytes += sum(a.size for a in arrays) * np.dtype(req.dtype).itemsize
        outs = self.device_planes[req.device].allreduce(
            arrays, _REDUCE[req.op], req.prescale, req.postscale,
            self.size if req.op == Average else 1, inplace)
        results, offset = [], 0
        for _, arrs, _ in entries:
            results.append(outs[offset:offset + len(arrs)])
            offset += len(arrs)
        return results

    def _allgather(self, t, req, array, dims):
        if req.device:
            return self.device_planes[req.device].allgather(array, dims)
        a = np.ascontiguousarray(array).reshape(-1)
        shape = array.shape if array.ndim else (1,)
        row = int(np.prod(shape[1:], dtype=np.int64))
        counts = [d * row for d in dims]
        bounds = ring.segment_bounds(counts)
        out = np.empty(bounds[-1], dtype=array.dtype)
        out[bounds[t.rank]:bounds[t.rank + 1]] = a
        if not (self._use_plane(t, out) and self._plane.allgather(out, counts)):
            ring.allgather(t, out, counts)
        return out.reshape((sum(dims),) + tuple(shape[1:]))

    def _broadcast(self, t, req, array, _):
        if req.device:
            return self.device_planes[req.device].broadcast(array, req.root)
        buf = np.array(array, copy=True, order="C").reshape(-1)
        root = req.root if t is self._t else self._sets[req.process_set].index(req.root)
        if not (self._use_plane(t, buf) and self._plane.broadcast(buf, root)):
            ring.broadcast(t, buf, root)
        return buf.reshape(array.shape)

    def _alltoall(self, t, req, array, splits):
        shape = array.shape if array.ndim else (1,)
        row = int(np.prod(shape[1:], dtype=np.int64))
        send = np.ascontiguousarray(array).reshape(-1)
        recv_rows = [splits[j][t.rank] for j in range(t.size)]
        send_counts = [s * row for s in splits[t.rank]]
        recv = np.empty(sum(recv_rows) * row, dtype=array.dtype)
        recv_counts = [s * row for s in recv_rows]
        plane_alltoall = getattr(self._plane, "alltoall", None) if t is self._t else None
        if not (plane_alltoall and plane_alltoall(send, send_counts, recv, recv_counts)):
            ring.alltoall(t, send, send_counts, recv, recv_counts)
        return (recv.reshape((sum(recv_rows),) + tuple(shape[1:])),
                np.array(recv_rows, dtype=np.int32))

    def _reducescatter(self, t, req, array, _):
        shape = array.shape if array.ndim else (1,)
        row = int(np.prod(shape[1:], dtype=np.int64))
        rows = ring.even_counts(shape[0], t.size)
        counts = [r * row for r in rows]
        buf = np.array(array, copy=True, order="C").reshape(-1)
        _scale(buf, req.prescale, 1)
        if self._tuner is not None:
            self._tuned_bytes += buf.nbytes
        reduce_fn = _REDUCE[req.op]
        if not (self._use_plane(t, buf) and self._plane.reducescatter(buf, counts, reduce_fn)):
            ring.reducescatter(t, buf, counts, reduce_fn,
                               _reusable(self._scratch, buf.dtype, max(counts)))
        bounds = ring.segment_bounds(counts)
        mine = buf[bounds[t.rank]:bounds[t.rank + 1]].copy()
        _scale(mine, req.postscale, t.size if req.op == Average else 1)
        return mine.reshape((rows[t.rank],) + tuple(shape[1:]))

    # -- stall inspector: where the missing ranks are (hora.core.stall) --------------------
    def _warn_stall(self, now, missing):
        """Rank 0: log Horovod's stall warning with hints, and ask the missing ranks where
        their main threads are; the answers are logged as they come, never waited for."""
        after = self._settings.stall_warning_s
        hints = stall.hints(self._coord.stalled_collectives(now, after),
                            self._coord.last_submit, now, after)
        log.warning("%s", stall.warning_text(missing, hints, after))
        token, ask = self._stacks.ask(missing, now)
        for rank in ask:
            if rank == 0:
                self._stacks.answer(0, token, stall.main_thread_stack(), now)
            elif rank in self._workers:
                self._workers[rank].send(("stack?", token))
        self._report_stacks(now)

    def _report_stacks(self, now):
        text = self._stacks.report(now)
        if text:
            log.warning("%s", text)

    def _got_stack(self, rank, token, text):
        late = self._stacks.answer(rank, token, text, self._clock())
        if late:
            log.warning("%s", late)

    def _answer_stack_request(self, token):
        """A worker: rank 0 asks where our main thread is (a stall); answer at once."""
        self._to_coord.send(("stack", token, stall.main_thread_stack()))

    def _release_peers(self):
        """After this engine failed: close its data connections shortly, so that a peer
        still blocked in a transfer with this process (alive: a broken connection, a stall
        shutdown) sees a hang-up at once instead of waiting for HORA_TRANSPORT_TIMEOUT.
        The delay lets every rank see the original failure first, so that it names it."""
        timer = threading.Timer(_RELEASE_DELAY_S, self._t.close)
        timer.daemon = True
        timer.start()


SMALL_ALLREDUCE = 8 << 10


def _prescaled(req, arrays):
    """The request's arrays, flattened into one buffer of its dtype, times its prescale."""
    if len(arrays) == 1 and req.prescale == 1:
        return np.ascontiguousarray(arrays[0], dtype=req.dtype).tobytes()
    if len(arrays) == 1:
        buf = np.array(arrays[0], dtype=req.dtype, copy=True, order="C").reshape(-1)
    else:
        buf = np.concatenate([np.asarray(a, dtype=req.dtype).reshape(-1) for a in arrays])
    _scale(buf, req.prescale, 1)
    return buf.tobytes()


def _reusable(pool, dtype, n):
    """``n`` elements of the buffer kept in ``pool`` for ``dtype``, grown when too small."""
    buf = pool.get(dtype)
    if buf is None or buf.size < n:
        buf = pool[dtype] = np.empty(max(n, 1), dtype=dtype)
    return buf[:n]


def _missing_lines(missing):
    """Horovod's listing: ``rank: [first names ...]`` per missing rank."""
    return "\n".join(f"{rank}: [{', '.join(names[:6])}{' ...' if len(names) > 6 else ''}]"
                     for rank, names in sorted(missing.items()))


def _scale(buf, factor, divisor):
    """buf *= factor / divisor, in place, rounded as Horovod's CPU scaling rounds.

    The two make one factor, computed in double precision (Horovod folds an average into
    the postscale factor the same way).  float16 is multiplied in float32 and rounded back
    to the nearest float16; float32 by the factor rounded to float32; float64 (and complex)
    in their own precision; integers in float64, truncated toward zero as a C cast does.
    So hora's scaled results equal Horovod's bit for bit, not only to the last place.
    """
    scale = float(factor) / divisor
    if scale == 1:
        return
    if buf.dtype == np.float16:
        buf[...] = np.multiply(buf, np.float32(scale), dtype=np.float32)
    elif buf.dtype == np.float32:
        np.multiply(buf, np.float32(scale), out=buf)
    elif buf.dtype.kind in "fc":
        np.multiply(buf, scale, out=buf, casting="unsafe")
    else:
        buf[...] = np.trunc(buf.astype(np.float64) * scale).astype(buf.dtype)
