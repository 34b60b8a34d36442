"""A host leader's desk: the requests of the ranks below it, gathered into one message for
rank 0.  Pure: no sockets, no clock of its own (callers pass ``now``).

In a job on several hosts the ranks of each host but rank 0's send their control messages to
their host's leader (:func:`hora.core.links.ctrl_parents`), which alone talks to rank 0, or,
in a job of more hosts than HORA_CONTROL_FANOUT + 1, to a leader above it (a tree).  In
steady-state training every rank submits the same cached requests (a step's gradients, by
cache id); a leader holds each rank's ids until every rank of its host, and every leader
below it, has submitted them, then sends them once for all those ranks
(:class:`~hora.core.wire.HostIds`), so rank 0 reads one message a leader connected to it
instead of one a rank.  The inputs of small allreduces (:mod:`.small`) go with them as the
partial result (the inputs reduced in rank order, a leader below's partial as its ranks'), so
that rank 0 reduces one input a leader too; every rank still gets rank 0's bytes.

Everything else goes up as it came, wrapped in a :class:`~hora.core.wire.Fwd` naming its
rank: full requests, ids of process sets other than the global one, goodbyes, stack answers,
metrics.  A rank of the host's held ids go up (in a Fwd of its own, in order) before any such
message of that rank, so rank 0 sees each rank's submissions in the rank's order (a join or a
goodbye after an allreduce stays after it); a leader below's before a join or goodbye it
passes on; all after ``hold_s`` at most (a rank that never submits them: rank 0's stall
inspector must see who did not).  While a rank below has joined or left, nothing is held.

Layer: core.
"""
import numpy as np

from ...errors import HoraInternalError
from ..messages import JOIN
from ..wire import Fwd, HostIds, Req
from .folds import REDUCE

__all__ = ["HOLD_S", "HostDesk"]

HOLD_S = 1.0        # ids some of the host's ranks submitted wait this long for the others


class HostDesk:
    """Gathers the requests of the ranks below a leader: its host's (``ranks``, its own
    among them), and, in a tree of leaders (:func:`hora.core.links.ctrl_parents`), those of
    the leaders below it (``below``), each of which sends what its own desk made.

    Each of these is a *member*: a rank of the host, or a leader below with every rank it
    gathers.  A member's cached ids of the global set wait until every member has submitted
    them, then go up once as the :class:`~hora.core.wire.HostIds` of every rank here.

    Args:
        ranks: the host's global ranks.
        hold_s: how long a member's submitted ids wait at most for the others.
        below: ``{leader: its ranks}`` of the leaders whose control connections come here.
    """

    def __init__(self, ranks, hold_s=HOLD_S, below=None):
        below = {leader: tuple(sorted(rs)) for leader, rs in (below or {}).items()}
        self._cover = {**{r: (r,) for r in ranks}, **below}     # member -> its ranks
        self._below = {leader: frozenset(rs) for leader, rs in below.items()}  # (checks)
        self.members = tuple(sorted(self._cover))
        self.ranks = tuple(sorted(r for rs in self._cover.values() for r in rs))
        self._hold_s = hold_s
        self._global = {}           # cache id of the global set -> its request
        self._waiting = {}          # cache id -> {member: its small input or None}
        self._held = {m: {} for m in self.members}      # member -> {id: since}, in order
        self._joined = set()        # members in a join (or gone): nothing is held
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
        return out + self._hold(rank, ids, lambda i: small.get((0, glob[i].name))
                                if small else None, now)

    def other(self, rank, msg):
        """Any other message of ``rank`` (a goodbye, a stack answer, a request that is not
        all global ids): its held ids first, then the message itself."""
        if msg.tag == "bye":
            self._joined.add(rank)          # gone: the others' ids wait for it no more
        return self._pass(rank, Fwd(rank, msg))

    # -- what the leaders below said ---------------------------------------------------------
    def host(self, leader, msg, now):
        """A leader below sent :class:`~hora.core.wire.HostIds`: held when they are its
        every rank's (then its partials are its small inputs), else passed on, as are all
        while a member is in a join."""
        if leader not in self._below or not self._below[leader].issuperset(msg.ranks):
            raise HoraInternalError(f"rank {leader} passed on the requests of ranks "
                                    f"{list(msg.ranks)[:8]}, which are not below it")
        if msg.ranks != self._cover[leader] or self._joined:
            self.sent_host += 1
            return self._release(leader) + [msg]
        small, glob = msg.small, self._global
        return self._hold(leader, msg.ids, lambda i: small.get((0, glob[i].name)), now)

    def forwarded(self, leader, msg):
        """A leader below passed on a rank's message (a :class:`~hora.core.wire.Fwd`): on
        at once, unless it is a goodbye or a join, which must reach rank 0 after every id
        the rank submitted before it: then after that leader's held ids.  (Rank 0 settles
        each collective when its every rank has submitted it, in whatever order they come;
        holding a leader's ids back for each message of one of its ranks would undo the
        gathering.)"""
        body = msg.body
        if body.tag == "bye" or (body.tag == "req" and any(q.kind == JOIN for q in body.full)):
            self._joined.add(leader)
            return self._pass(leader, msg)
        self.sent_fwd += 1
        return [msg]

    def due(self, now):
        """The ids held longer than ``hold_s``, sent up member by member."""
        out = []
        for member, held in self._held.items():
            if held and now - next(iter(held.values())) >= self._hold_s:
                out.extend(self._release(member))
        return out

    def holding(self):
        """Whether some member's ids wait here."""
        return any(self._held.values())

    # -- inside -----------------------------------------------------------------------------
    def _hold(self, member, ids, blob, now):
        """``member`` submitted ``ids`` (``blob(id)``: its small input of one): hold them,
        and send up those every member has submitted."""
        held, done, count = self._held[member], [], len(self.members)
        for i in ids:
            got = self._waiting.setdefault(i, {})
            got[member] = blob(i)
            if len(got) == count:
                done.append(i)
            else:
                held[i] = now
        return self._complete(done)

    def _pass(self, member, msg):
        """``member``'s held ids, then ``msg``; while a member is in a join, every held id."""
        out = self._release(member)
        out.append(msg)
        self.sent_fwd += 1
        if self._joined:
            for m in self.members:
                out.extend(self._release(m))
        return out

    def _complete(self, done):
        if not done:
            return []
        small = {}
        for i in done:
            got = self._waiting.pop(i)
            blobs = [got[m] for m in self.members]
            if None not in blobs:           # (else some went larger: the data plane runs it)
                req = self._global[i]
                small[(0, req.name)] = _partial(req, blobs)
            for m in self.members:
                self._held[m].pop(i, None)
        self.sent_host += 1
        return [HostIds(self.ranks, done, small)]

    def _release(self, member):
        """``member``'s held ids, as its own request (a rank's) or its HostIds (a leader's
        below) to rank 0 (empty: none held)."""
        held, self._held[member] = self._held[member], {}
        if not held:
            return []
        ids, small = [], {}
        for i in held:
            blob = self._waiting[i].pop(member)
            if not self._waiting[i]:
                del self._waiting[i]
            ids.append(i)
            if blob is not None:
                small[(0, self._global[i].name)] = blob
        cover = self._cover[member]
        if len(cover) > 1:
            self.sent_host += 1
            return [HostIds(cover, ids, small)]
        self.sent_fwd += 1
        return [Fwd(member, Req([], small, ids, False))]


def _partial(req, blobs):
    """The host's ranks' small inputs (prescaled bytes) reduced in rank order."""
    if len(blobs) == 1:
        return blobs[0]
    dtype = np.dtype(req.dtype)
    acc = np.frombuffer(blobs[0], dtype=dtype).copy()
    for blob in blobs[1:]:
        REDUCE[req.op](acc, np.frombuffer(blob, dtype=dtype), out=acc)
    return acc.tobytes()
