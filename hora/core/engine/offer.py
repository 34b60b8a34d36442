"""The offer: rank 0 answers the last rank before it asks.  Pure state, no sockets.

In steady-state training each step's collectives are cached, and the last rank to submit
them waits for a round trip to rank 0 before it can run them.  When only one worker is
missing from everything pending, rank 0 sends it the answer in advance
(:meth:`hora.core.negotiation.Coordinator.offer`); if that worker's next requests begin with
exactly those cached collectives, it tells rank 0 it accepts (:class:`~hora.core.wire.Accept`)
and runs them at once, so the collectives start without a round trip (rank 0 joins as soon as
the acceptance arrives, while the worker is already copying in).  Everything else goes the
usual way.

The rules, which the two classes below keep:

- An offer is good only until the worker's next message that changes what rank 0 knows of
  it (a Req, Accept or Bye).  Both sides count those messages; the offer carries the count
  rank 0 had read when it made it (``heard``), and the worker drops an offer whose count is
  not the number it has sent: the offer crossed a message.
- Rank 0 makes no other offer while one is out.
- An offer that crossed the worker's request (the ranks submit at nearly the same time, a
  tight loop) is work for nothing on both sides: after each such offer, rank 0 lets twice as
  many chances pass as the last time (up to 64 of the passes that could make one).  One that
  arrived in time resets that, taken or not (declined: the worker sends the step's requests
  in parts, and the next offer fits the rest).
- Small allreduces are left out (``min_bytes``): their usual answer carries the result,
  which rank 0 cannot compute before it has the last rank's input, and their ranks submit
  at nearly the same time, so such an offer would mostly cross the worker's request and be
  work for nothing.

Layer: core.
"""
from typing import NamedTuple

from ..wire import Bye, Offer, Req

__all__ = ["OutOffer", "OfferDesk", "OfferSlot", "fits", "MAX_BACKOFF"]

MAX_BACKOFF = 64


class OutOffer(NamedTuple):
    """Rank 0's record of the offer it has out."""
    rank: int               # the worker it went to
    number: int             # its number (offers are numbered from 1)
    ids: tuple              # the cache ids the worker must send first to take it
    responses: tuple        # what taking it runs


class OfferDesk:
    """Rank 0's side: counts each worker's messages, makes offers, backs off late ones.

    Args:
        coordinator: the :class:`~hora.core.negotiation.Coordinator` asked for offers.
        workers: the workers' ranks.
        min_bytes: collectives of at most this many bytes are never offered.
    """

    def __init__(self, coordinator, workers, min_bytes):
        self.out = None                     # the OutOffer out, or None
        self._coord = coordinator
        self._min_bytes = min_bytes
        self._heard = dict.fromkeys(workers, 0)
        self._made = 0
        self._skip = 0                      # chances to let pass, after late offers
        self._backoff = 0                   # what the next late offer doubles

    def heard(self, rank, msg):
        """Rank 0 read ``msg`` (a Req, Accept or Bye) from worker ``rank``.

        Counts it, withdraws the offer out to ``rank`` (taken, declined, or crossed by
        ``msg``), and returns the offer that was out before (to any rank), or None."""
        self._heard[rank] += 1
        out = self.out
        if out is not None and out.rank == rank:
            self.out = None
            crossed = msg.__class__ is Bye or (msg.__class__ is Req and not msg.offered)
            self._backoff = min(MAX_BACKOFF, max(1, 2 * self._backoff)) if crossed else 0
            self._skip = self._backoff
        return out

    def make(self):
        """``(rank, Offer)`` to send now, or None (one is out, none is possible, or this
        chance is let pass)."""
        if self.out is not None:
            return None
        if self._skip:
            self._skip -= 1
            return None
        got = self._coord.offer(self._min_bytes)
        if got is None:
            return None
        rank, ids, responses = got
        self._made += 1
        self.out = OutOffer(rank, self._made, ids, responses)
        return rank, Offer(self._made, self._heard[rank], ids, responses)


class OfferSlot:
    """A worker's side: the offer it may take, and the count of what it told rank 0."""

    def __init__(self):
        self._offer = None
        self._told = 0                      # Req, Accept and Bye sent

    def received(self, offer):
        """Rank 0 sent ``offer``: keep it if rank 0 made it after reading everything this
        worker sent, else drop it (and any older one)."""
        self._offer = offer if offer.heard == self._told else None

    def withdraw(self):
        """The worker is about to send a Req, Accept or Bye: count it, and return the offer
        it may still take with that message (None if none), which is gone after it."""
        offer, self._offer = self._offer, None
        self._told += 1
        return offer


def fits(offer, ids):
    """Whether requests with cache ``ids`` (None: not cached) begin with exactly the
    offer's collectives, in its order."""
    n = len(offer.ids)
    return n > 0 and tuple(ids[:n]) == tuple(offer.ids)
