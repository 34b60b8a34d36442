"""A worker's side of the engine (every rank but 0): request, then follow rank 0's answers.

Each step the engine hands :meth:`WorkerSide.step` the requests due to go out; the worker
sends them to rank 0 (in full, or as cache ids, with the inputs of its small allreduces),
and runs the responses rank 0 sends back, in order.  When rank 0 has sent an offer that the
requests fit, the worker accepts it and runs its answer at once (:mod:`.offer`).  Rank 0 may
also ask where the main thread is (the stall inspector), say that a rank died, or abort the
job; each of those is answered or raised here.

Layer: core.
"""
from ...errors import HoraInternalError, HoraRankFailedError
from .. import stall, stats, timeline
from ..wire import (Abort, Accept, Bye, Dead, HostPost, Offer, Req, Resp, Stack,
                    StackQuestion, Stats, Trace)
from .offer import OfferSlot, fits
from .small import payloads

__all__ = ["WorkerSide"]


class WorkerSide:
    """The control connection to rank 0, and what travels on it.

    Args:
        conn: the :class:`~hora.core.engine.conn.Conn` to rank 0.
        executor: this rank's :class:`~hora.core.engine.executor.Executor`.
    """

    def __init__(self, conn, executor):
        self.conn = conn
        self.parent = conn.peer             # rank 0, or this host's leader (a LeaderSide)
        self.conns = [conn]                 # the control connections (one)
        self._exec = executor
        self._offers = OfferSlot()
        self.offers_taken = 0               # offers this worker ran (tests, benchmarks)
        self.host_msgs = {}                 # a host leader: (leader, round) -> HostPost

    def idle(self):
        """A worker has no coordinator: nothing under way there."""
        return True

    def step(self, send, leaving):
        """Send ``send`` (requests); say goodbye if this rank has just ``leaving``; run what
        arrived.  Returns True when the job is over."""
        if send:
            if self._follow():              # first what came meanwhile, an offer among it
                return True
            self._request(send)
        rec = timeline._recorder
        if rec is not None and (leaving or rec.due()):
            self.conn.send(Trace(rec.take()))
        if stats.due(leaving):
            self.conn.send(Stats(stats.metrics()))
        if leaving:
            self._offers.withdraw()
            self._up(Bye())
        return self._follow()

    def _up(self, msg):
        """Send rank 0 ``msg``, one of this rank's requests or its goodbye."""
        self.conn.send(msg)

    def _request(self, send):
        """Send ``send`` to the coordinator -- or, when they begin with exactly the
        collectives of rank 0's offer, accept it and run its answer at once."""
        ex = self._exec
        ids = [ex.cache_ids.get(q) for q in send]
        hits = sum(1 for i in ids if i is not None)
        stats.counters.cache_hits += hits
        stats.counters.cache_misses += len(ids) - hits
        offer = self._offers.withdraw()
        if (offer is not None and fits(offer, ids)
                and all((q.process_set, q.name) in ex.pending for q in send[:len(offer.ids)])):
            n = len(offer.ids)
            rest, rest_ids = send[n:], ids[n:]
            self.conn.send(Accept(offer.number, [q for q, i in zip(rest, rest_ids) if i is None],
                                  payloads(rest, ex.pending),
                                  [i for i in rest_ids if i is not None]))
            self.offers_taken += 1
            ex.run_all(offer.responses)     # Run responses only: never the end of the job
            return
        self._up(Req([q for q, i in zip(send, ids) if i is None], payloads(send, ex.pending),
                     [i for i in ids if i is not None], offer is not None))

    def hear_rounds(self):
        """A leader waiting in a host round: take the host posts that have arrived (rank 0's
        and those it relayed); whatever else came waits in the connection for the next
        step.  Returns whether something waits so."""
        posts, held = self.conn.receive_only(HostPost)
        for msg in posts:
            self.host_msgs[(msg.src, msg.seq)] = msg
        return held

    def _follow(self):
        """Handle every message rank 0 has sent; True when the job is over."""
        for msg in self.conn.receive():
            if self._take(msg):
                return True
        return False

    def _take(self, msg):
        """Act on one message from rank 0; True when the job is over."""
        cls = msg.__class__
        if cls is Resp:
            return self._exec.run_all(msg.responses)
        if cls is Offer:
            self._offers.received(msg)
        elif cls is HostPost:           # a host leader's: rank 0's or relayed
            self.host_msgs[(msg.src, msg.seq)] = msg
        elif cls is Dead:
            raise HoraRankFailedError(msg.text, rank=msg.rank)
        elif cls is Abort:
            raise HoraInternalError(msg.text)
        elif cls is StackQuestion:
            # a stall: rank 0 asks where our main thread is and what it is doing
            self.conn.send(Stack(msg.token, stall.main_thread_stack(),
                                 stall.current_activity(), stall.main_thread_waits()))
        return False
