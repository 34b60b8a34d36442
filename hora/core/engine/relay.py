"""A host leader's desk: its host's requests, gathered into one message for rank 0.  Pure: no
sockets, no clock of its own (callers pass ``now``).

In a job on several hosts the ranks of each host but rank 0's send their control messages to
their host's leader (:func:`hora.core.links.ctrl_parent`), which alone talks to rank 0.  In
steady-state training every rank submits the same cached requests (a step's gradients, by
cache id); the leader holds each rank's ids until every rank of its host has submitted them,
then sends them once for the whole host (:class:`~hora.core.wire.HostIds`), so rank 0 reads
one message a host instead of one a rank.  The inputs of small allreduces (:mod:`.small`) go
with them as the host's partial result (its ranks' inputs reduced in rank order), so that
rank 0 reduces one input a host too; every rank still gets rank 0's bytes.

Everything else goes up as it came, wrapped in a :class:`~hora.core.wire.Fwd` naming its
rank: full requests, ids of process sets other than the global one, goodbyes, stack answers,
metrics.  A rank's held ids go up (in a Fwd of its own, in order) before any such message of
that rank, so rank 0 sees each rank's submissions in the rank's order (a join or a goodbye
after an allreduce stays after it), and after ``hold_s`` at most (a rank of the host that
never submits them: rank 0's stall inspector must see who did).  While a rank of the host
has joined or left, nothing is held.

Layer: core.
"""
import numpy as np

from ..messages import JOIN
from ..wire import Fwd, HostIds, Req
from .folds import REDUCE

__all__ = ["HOLD_S", "HostDesk"]

HOLD_S = 1.0        # ids some of the host's ranks submitted wait this long for the others


class HostDesk:
    """Gathers the requests of ``ranks`` (a host's, its leader's among them).

    Args:
        ranks: the host's global ranks.
        hold_s: how long a rank's submitted ids wait at most for the host's other ranks.
    """

    def __init__(self, ranks, hold_s=HOLD_S):
        self.ranks = tuple(sorted(ranks))
        self._hold_s = hold_s
        self._global = {}           # cache id of the global set -> its request
        self._waiting = {}          # cache id -> {rank: its small input or None}
        self._held = {r: {} for r in self.ranks}    # rank -> {id: since}, in its order
        self._joined = set()        # ranks of this host in a join (or gone): nothing held
        self.sent_host = 0          # HostIds sent (tests, the scale model)
        self.sent_fwd = 0           # Fwd sent

    # -- what rank 0 said -------------------------------------------------------------------
    def heard(self, responses):
        """Learn from rank 0's ``responses`` (which the leader passes down): the global
        set's cache ids, and the end of a join."""
        for r in responses:
            tag = r.tag
            if tag == "cache":
                q = r.request
                if q.process_set == 0:
                    self._global[r.cache_id] = q
            elif tag == "run" and r.kind == JOIN:
                self._joined.clear()

    # -- what the host's ranks said ---------------------------------------------------------
    def request(self, rank, msg, now):
        """``rank``'s :class:`~hora.core.wire.Req`; returns the messages for rank 0.  Its
        ids of the global set are held; the rest of it (new requests, other sets' ids) goes
        up at once."""
        glob = self._global
        if any(q.kind == JOIN for q in msg.full):
            self._joined.add(rank)
        if self._joined:
            return self.other(rank, msg)
        ids = [i for i in msg.ids if i in glob]
        out = []
        if msg.full or len(ids) < len(msg.ids):
            held_keys = {(0, glob[i].name) for i in ids}
            rest = Req(msg.full, {k: v for k, v in msg.small.items() if k not in held_keys},
                       [i for i in msg.ids if i not in glob], False)
            out = self.other(rank, rest)
            if not ids:
                return out
        small = msg.small
        held = self._held[rank]
        done = []
        for i in ids:
            got = self._waiting.setdefault(i, {})
            got[rank] = small.get((0, glob[i].name)) if small else None
            if len(got) == len(self.ranks):
                done.append(i)
            else:
                held[i] = now
        return out + self._complete(done)

    def other(self, rank, msg):
        """Any other message of ``rank`` (a goodbye, a stack answer, a request that is not
        all global ids): its held ids first, then the message itself."""
        if msg.tag == "bye":
            self._joined.add(rank)          # gone: the others' ids wait for it no more
        out = self._release(rank)
        out.append(Fwd(rank, msg))
        self.sent_fwd += 1
        if self._joined:
            for r in self.ranks:
                out.extend(self._release(r))
        return out

    def due(self, now):
        """The ids held longer than ``hold_s``, sent up rank by rank."""
        out = []
        for rank, held in self._held.items():
            if held and now - next(iter(held.values())) >= self._hold_s:
                out.extend(self._release(rank))
        return out

    def holding(self):
        """Whether some rank's ids wait here."""
        return any(self._held.values())

    # -- inside -----------------------------------------------------------------------------
    def _complete(self, done):
        if not done:
            return []
        small = {}
        for i in done:
            got = self._waiting.pop(i)
            blobs = [got[r] for r in self.ranks]
            if None not in blobs:           # (else some went larger: the data plane runs it)
                req = self._global[i]
                small[(0, req.name)] = _partial(req, blobs)
            for r in self.ranks:
                self._held[r].pop(i, None)
        self.sent_host += 1
        return [HostIds(self.ranks, done, small)]

    def _release(self, rank):
        """``rank``'s held ids, as its own request to rank 0 (empty: none held)."""
        held, self._held[rank] = self._held[rank], {}
        if not held:
            return []
        ids, small = [], {}
        for i in held:
            blob = self._waiting[i].pop(rank)
            if not self._waiting[i]:
                del self._waiting[i]
            ids.append(i)
            if blob is not None:
                small[(0, self._global[i].name)] = blob
        self.sent_fwd += 1
        return [Fwd(rank, Req([], small, ids, False))]


def _partial(req, blobs):
    """The host's ranks' small inputs (prescaled bytes) reduced in rank order."""
    if len(blobs) == 1:
        return blobs[0]
    dtype = np.dtype(req.dtype)
    acc = np.frombuffer(blobs[0], dtype=dtype).copy()
    for blob in blobs[1:]:
        REDUCE[req.op](acc, np.frombuffer(blob, dtype=dtype), out=acc)
    return acc.tobytes()
