"""The coordinator's bookkeeping: which ranks submitted which collective, in what order.

Pure logic, no sockets and no clock of its own (callers pass ``now``).  Rank 0's engine feeds
it every rank's requests; it answers with the ordered list of responses every rank executes
(:mod:`hora.core.wire` defines them: :class:`~hora.core.wire.Run`, ``Error``, ``Cache``,
``Shutdown``, and what each ``Run``'s ``extra`` holds for each kind).

The response cache (HORA_CACHE_CAPACITY entries): a request that every member sent identically
twice (a training step's gradients, its metrics) gets a small integer id; ranks then submit
the id, which the coordinator accepts without comparing anything.  Entries are never evicted
(so an id never changes meaning); once the cache is full, new requests are sent in full.
When every rank but one has submitted everything pending, all of it cached, the coordinator
can say in advance what that rank's submission will yield (:meth:`Coordinator.offer`), and
the engine sends it the answer before it asks.

Collectives belong to a process set (0: every rank); each set has its own namespace and
completes when all its members have submitted.  Everything is ordered globally, so a rank in
several sets runs their collectives in the one order every other rank also follows.

Layer: core.
"""
import collections
import collections.abc
import math

import numpy as np

from . import stats
from .messages import (ADD_SET, ALLGATHER, AMONG, ALLREDUCE, ALLTOALL, BARRIER, BROADCAST, JOIN,
                       KIND_NAMES, OP_NAMES, REDUCESCATTER, REMOVE_SET)
from .wire import Cache, Error, Joined, NewSet, Run, Shutdown

__all__ = ["Coordinator", "nbytes", "validate"]

_CACHED = (ALLREDUCE, BARRIER)      # the kinds the response cache holds (Coordinator._remember)


def _by_value(values):
    """'ranks 0, 2: x; rank 1: y' for the ranks' differing values."""
    groups = collections.defaultdict(list)
    for rank, value in values.items():
        groups[repr(value)].append(rank)
    return "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {v}"
                     for v, r in groups.items())


def _differs(reqs, key, label, what):
    values = {rank: key(req) for rank, req in sorted(reqs.items())}
    if len(set(map(repr, values.values()))) > 1:
        return f"Mismatched {label} for {what}: {_by_value(values)}"
    return None


def validate(reqs, members):
    """Return an error message if the ranks' requests for one name disagree, else None.

    ``members`` are the global ranks of the collective's process set.
    """
    size = len(members)
    first = reqs[min(reqs)]
    what = f"{KIND_NAMES.get(first.kind, 'collective')} {first.name!r}"
    err = _differs(reqs, lambda q: KIND_NAMES[q.kind], "collective kinds", f"{first.name!r}")
    if err or first.kind in (BARRIER, JOIN):
        return err
    checks = [(lambda q: q.dtype, "data types"), (lambda q: q.device or "host", "devices")]
    if first.kind in (ALLREDUCE, REDUCESCATTER):
        checks += [(lambda q: q.shapes if len(q.shapes) > 1 else q.shapes[0], "shapes"),
                   (lambda q: OP_NAMES.get(q.op, q.op), "reduce ops"),
                   (lambda q: (q.prescale, q.postscale), "prescale and/or postscale factors")]
    elif first.kind == BROADCAST:
        checks += [(lambda q: q.root, "root ranks"), (lambda q: q.shapes[0], "shapes")]
    elif first.kind in (ALLGATHER, ALLTOALL):
        checks += [(lambda q: len(q.shapes[0]), "ranks (number of dimensions)"),
                   (lambda q: q.shapes[0][1:], "shapes beyond the first dimension")]
    elif first.kind in (ADD_SET, REMOVE_SET):
        checks = [(lambda q: q.shapes[0], "process sets")]
    for key, label in checks:
        err = _differs(reqs, key, label, what)
        if err:
            return err
    if first.kind == BROADCAST and first.root not in members:
        return (f"Invalid root rank {first.root} for {what}: not a rank of its process set "
                f"{list(members) if len(members) < 64 else f'({size} ranks)'}")
    if first.kind == ALLTOALL:
        for rank, q in sorted(reqs.items()):
            if q.splits is not None and len(q.splits) != size:
                return (f"Invalid splits for {what} on rank {rank}: {len(q.splits)} entries "
                        f"for {size} ranks")
        # without splits every rank sends the same number of rows to each (Horovod's rule)
        uneven = {rank: _rows(q) for rank, q in sorted(reqs.items())
                  if q.splits is None and _rows(q) % size}
        if uneven:
            return (f"Invalid first dimension for {what} without splits: it must divide "
                    f"evenly among the {size} ranks, but {_by_value(uneven)} rows; pass "
                    f"splits= to send uneven parts")
    return None


def _rows(req):
    return req.shapes[0][0] if req.shapes[0] else 1


def _aborted_message(reqs):
    """The error for a collective that some ranks' calls failed to submit, or None."""
    failed = {rank: q.error for rank, q in sorted(reqs.items()) if q.error is not None}
    if not failed:
        return None, None
    first = reqs[min(reqs)]
    what = f"{KIND_NAMES.get(first.kind, 'collective')} {first.name!r}"
    ranks = sorted(failed)
    who = (f"rank {ranks[0]}" if len(ranks) == 1
           else f"ranks {', '.join(map(str, ranks))}")
    errors = (failed[ranks[0]] if len(set(failed.values())) == 1 else _by_value(failed))
    return (f"{what} cannot run: the call on {who} failed before submitting it: {errors}",
            failed)


class _Arrivals(collections.abc.Mapping):
    """Who has submitted one collective, read as ``{rank: Request}``.

    A host's ranks submitted together (:meth:`Coordinator.submit_host`) are one entry, not
    one a rank, so that what a collective costs rank 0 grows with the messages it read, not
    with the ranks behind them; the whole dict is built only where a rarer path reads a
    rank's request.  ``uniform`` is the Request when every rank's is that one object (a
    cached request: nothing to compare), else None; ``rank_sum`` the sum of the ranks.
    A rank's engine refuses a name already in flight, and a host's desk sends each of its
    ranks once; a rank that comes one by one again all the same replaces its request."""

    __slots__ = ("_one", "_hosts", "_grouped", "rank_sum", "uniform", "_flat")

    def __init__(self, req):
        self._one = {}                  # rank -> Request, of the ranks that came one by one
        self._hosts = None              # [(ranks, Request)] of the hosts that came whole
        self._grouped = self.rank_sum = 0
        self.uniform = req
        self._flat = None

    def add(self, rank, req):
        if rank not in self._one:
            self.rank_sum += rank
        self._one[rank] = req
        if self._hosts:
            self._flat = None
        if req is not self.uniform:
            self.uniform = None

    def add_host(self, ranks, req, rank_sum):
        """``ranks`` (a tuple; ``rank_sum`` their sum) submitted ``req`` together."""
        if self._hosts is None:
            self._hosts = []
        self._hosts.append((ranks, req))
        self._grouped += len(ranks)
        self.rank_sum += rank_sum
        self._flat = None
        if req is not self.uniform:
            self.uniform = None

    def _dict(self):
        if not self._hosts:
            return self._one
        if self._flat is None:
            self._flat = {}
            for ranks, req in self._hosts:
                self._flat.update(dict.fromkeys(ranks, req))
            self._flat.update(self._one)
        return self._flat

    def __len__(self):
        return len(self._one) + self._grouped

    def __getitem__(self, rank):
        return self._dict()[rank]

    def __iter__(self):
        return iter(self._dict())

    def __contains__(self, rank):
        return rank in self._dict()


class Coordinator:
    """Collects requests from every rank and decides what runs, in one global order.

    Args:
        size: number of ranks.
        fusion_threshold: allreduces of the same set, dtype, op and scaling that become ready
            together are fused into one response while their total bytes stay within this.
    """

    def __init__(self, size, fusion_threshold=128 << 20, cache_capacity=1024):
        self.size = size
        self.fusion_threshold = fusion_threshold
        self.cache_capacity = cache_capacity
        self._cache = {}                         # request -> cache id
        self._cached = []                        # cache id -> request
        self._seen_once = set()                  # identical requests completed once
        self._sets = {0: tuple(range(size))}
        self._next_set = 1
        self._among = {}                         # (0, name) -> ranks: a set its members add
        self._pending = {}                       # (set, name) -> _Arrivals
        self._first_seen = {}                    # (set, name) -> time of the first submission
        self._ready = []                         # allreduce Requests ready to run, in order
        self._out = []                           # responses not yet taken
        self._departed = set()                   # ranks that called shutdown()
        self._joined = []                        # ranks that called join(), in order
        self._shutdown_sent = False
        self.last_submit = {}                    # rank -> time of its latest submission
        # the timeline's (None: off): (set, name) -> {rank: arrival}, and the collectives
        # completed since it was last emptied, with their arrivals
        self.arrivals = None
        self.negotiated = []

    # -- input ----------------------------------------------------------------------------
    def idle(self):
        """Whether nothing is under way: no request waits for its partners or to run, no
        response waits to be taken, no rank has joined or left."""
        return not (self._pending or self._ready or self._out or self._joined
                    or self._departed)

    def cached_request(self, cache_id):
        """The request behind ``cache_id`` (ids only ever come from this object)."""
        return self._cached[cache_id]

    def submit(self, rank, requests, now, cache_ids=()):
        """``rank`` submitted ``requests`` and the cached requests ``cache_ids``."""
        cache = self._cache
        if cache and requests:
            # a cached request sent in full (rank 0's own: its engine sends itself no ids)
            # as the cached object, so that a collective whose every rank sent that object
            # is complete without comparing them (_Arrivals.uniform), at any size
            requests = [self._cached[cache[q]] if q.kind in _CACHED and q in cache else q
                        for q in requests]
        if cache_ids:
            requests = [*requests, *(self._cached[i] for i in cache_ids)]
        if requests:
            self.last_submit[rank] = now
        for req in requests:
            if req.kind == JOIN:
                self._join(rank)
                continue
            among = req.kind == ADD_SET and req.root == AMONG   # (a set its members add)
            members = tuple(req.shapes[0]) if among else self._sets.get(req.process_set)
            if members is None or rank not in members:
                # the members' own collective of that name (if any) is not concerned
                message = (f"{KIND_NAMES[req.kind]} {req.name!r}: rank {rank} is not a member "
                           f"of process set {req.process_set}"
                           + ("" if members is not None else " (no such process set)"))
                self._error(req, message, "nonmember", {rank: message})
                continue
            key = (req.process_set, req.name)
            # members that shut down before submitting it (one that submitted first still
            # runs it: a rank's engine serves its collectives until the whole job ends)
            gone = self._departed and sorted(
                (self._departed - {rank} - set(self._pending.get(key, ()))) & set(members))
            if gone:
                self._error(req, _shutdown_message(req, gone), "shutdown")
                continue
            entry = self._pending.get(key)
            if entry is None:
                entry = self._pending[key] = _Arrivals(req)
                self._first_seen[key] = now
                if among:
                    self._among[key] = members
            entry.add(rank, req)
            if self.arrivals is not None:
                self.arrivals.setdefault(key, {})[rank] = now
            first = self._first_seen[key]
            self._try_complete(key)
            if key not in self._pending and len(entry) > 1:
                _count_wait(first, now, rank)

    def submit_host(self, ranks, cache_ids, now):
        """Every rank of ``ranks`` (a host's, or those whose messages rank 0 read in one
        step: :mod:`hora.core.engine.coordinator`) submitted the cached requests
        ``cache_ids``: what :meth:`submit` of each would do, at the cost of one submission
        per request (rank 0 reads one message a host: :mod:`hora.core.engine.relay`).  The
        timeline's arrivals and the stall inspector see the ranks arrive together; the
        first of them stands for them in the count of who came last."""
        if self._departed or self._joined or self.arrivals is not None or any(
                self._cached[i].process_set != 0 for i in cache_ids):
            for rank in ranks:              # the rare cases: as the ranks' own submissions
                self.submit(rank, (), now, cache_ids)
            return
        self.last_submit.update(dict.fromkeys(ranks, now))
        ranks = tuple(ranks)
        total = sum(ranks)
        for i in cache_ids:
            req = self._cached[i]
            key = (0, req.name)
            entry = self._pending.get(key)
            if entry is None:
                entry = self._pending[key] = _Arrivals(req)
                self._first_seen[key] = now
            entry.add_host(ranks, req, total)
            first = self._first_seen[key]
            self._try_complete(key)
            if key not in self._pending and len(entry) > len(ranks):
                _count_wait(first, now, ranks[0])

    def depart(self, rank):
        """``rank`` called shutdown(): fail what can no longer complete."""
        self._departed.add(rank)
        for key in list(self._pending):
            entry = self._pending[key]
            missing = set(self._members(key)) - set(entry)
            if missing & self._departed:
                self._drop(key)
                self._error(next(iter(entry.values())),
                            _shutdown_message(next(iter(entry.values())),
                                              sorted(missing & self._departed)), "shutdown")

    def _join(self, rank):
        if rank not in self._joined:
            self._joined.append(rank)
        # first what waited for ``rank`` alone: every collective pending when the last rank
        # joins is settled before the join, so nothing of before outlives it
        for key in list(self._pending):
            self._try_complete(key)
        if len(self._joined) == self.size:
            self._flush_ready()
            self._out.append(Run(JOIN, 0, ("join",), self._joined[-1]))
            self._joined = []

    def _error(self, req, message, why, detail=None):
        self._flush_ready()
        self._out.append(Error(req.process_set, (req.name,), message, why, detail))

    def _members(self, key):
        """The ranks that must submit the collective ``key`` (its set's, or for a set that
        its members add, theirs)."""
        return self._among.get(key) or self._sets[key[0]]

    def _drop(self, key):
        del self._first_seen[key]
        self._among.pop(key, None)
        if self.arrivals is not None:
            arrived = self.arrivals.pop(key, None)
            if arrived and len(arrived) > 1:
                self.negotiated.append((key, arrived))
        return self._pending.pop(key)

    def _try_complete(self, key):
        entry = self._pending[key]
        members = self._members(key)
        if len(entry) == len(members):      # (entries are members only: no scan of them)
            self._complete(key, ())
            return
        if not self._joined:
            return      # partners still to come
        missing = [r for r in members if r not in entry]
        if set(missing) <= set(self._joined):
            if next(iter(entry.values())).kind == ALLREDUCE:
                self._complete(key, tuple(missing))
            else:
                req = next(iter(entry.values()))
                self._drop(key)
                self._error(req, f"{KIND_NAMES[req.kind]} {req.name!r} cannot run: rank"
                                 f"{'s' if len(missing) > 1 else ''} "
                                 f"{', '.join(map(str, missing))} called join(); only allreduce "
                                 f"runs until every rank has joined", "mismatch")

    def _complete(self, key, joined):
        members = self._members(key)
        reqs = self._drop(key)
        first = reqs.uniform if reqs.uniform is not None else reqs[min(reqs)]
        # the steady state: every rank sent the same request (nothing to compare)
        same = first.kind in _CACHED and (
            reqs.uniform is not None or all(q == first for q in reqs.values()))
        if not same or first.error is not None:
            aborted, failed = _aborted_message(reqs)
            if aborted:
                self._error(first, aborted, "aborted", failed)
                return
        err = None if same else validate(reqs, members)
        if same and not joined:
            self._remember(first)
        if err:
            self._error(first, err, "mismatch")
            return
        if first.kind == ALLREDUCE and not joined:
            self._ready.append(first)
            return
        self._flush_ready()
        extra = None
        if first.kind == ALLREDUCE:
            extra = Joined(joined, first)
        elif first.kind == ALLGATHER:
            extra = tuple(reqs[r].shapes[0][0] if reqs[r].shapes[0] else 1 for r in members)
        elif first.kind == ALLTOALL:
            extra = tuple(reqs[r].splits if reqs[r].splits is not None else
                          (_rows(reqs[r]) // len(members),) * len(members) for r in members)
        elif first.kind == ADD_SET:
            ranks = tuple(first.shapes[0])
            bad = [r for r in ranks if not 0 <= r < self.size]
            if bad or not ranks or len(set(ranks)) != len(ranks):
                self._error(first, f"invalid process set {list(ranks)} for a job of "
                                   f"{self.size} ranks", "mismatch")
                return
            extra = NewSet(self._next_set, ranks)
            self._sets[self._next_set] = ranks
            self._next_set += 1
        elif first.kind == REMOVE_SET:
            set_id = first.shapes[0][0]
            if set_id == 0 or set_id not in self._sets:
                self._error(first, f"cannot remove process set {set_id}: "
                                   f"{'the global set' if set_id == 0 else 'no such set'}",
                            "mismatch")
                return
            if any(k[0] == set_id for k in self._pending):
                self._error(first, f"cannot remove process set {set_id}: it has collectives "
                                   f"in flight", "mismatch")
                return
            del self._sets[set_id]
            extra = set_id
        self._out.append(Run(first.kind, key[0], (first.name,), extra))

    def _remember(self, req):
        """Cache ``req`` the second time every member sends it identically."""
        if req in self._cache or len(self._cached) >= self.cache_capacity:
            return
        if req not in self._seen_once:
            if len(self._seen_once) < 4 * self.cache_capacity:
                self._seen_once.add(req)        # one-off names (auto-named) stop here
            return
        self._seen_once.discard(req)
        self._cache[req] = len(self._cached)
        self._cached.append(req)
        self._out.append(Cache(self._cache[req], req))

    def _flush_ready(self):
        """Turn ready allreduces into responses, fusing neighbours that can share a buffer."""
        self._out.extend(_fuse(self._ready, self.fusion_threshold))
        self._ready = []

    def members(self, set_id):
        """The global ranks of process set ``set_id``, as of the responses taken so far."""
        return self._sets.get(set_id, ())

    def offer(self, min_bytes=0):
        """The answer to the last rank, decided before it asks: ``(rank, cache_ids,
        responses)`` when every pending collective is a cached allreduce of the global set,
        larger than ``min_bytes``, that every rank but ``rank`` (the same one, not rank 0) has
        submitted, with no rank joined or departed; else None.

        Submitting exactly ``cache_ids``, in this order, is all that ``rank`` has left to do
        for them, and nothing any other rank sends can change what that submission yields
        (the others have nothing left to submit for these collectives, and whatever else
        they send needs ``rank`` too), so ``rank`` may run ``responses`` at once instead of
        asking and waiting for the answer: the engine's offer (hora.core.engine.offer)."""
        if self._joined or self._departed or self._ready or self._out or not self._pending:
            return None
        everyone = self.size * (self.size - 1) // 2
        last, reqs = None, []
        for (set_id, _), entry in self._pending.items():
            if set_id != 0 or len(entry) != self.size - 1:
                return None
            missing = everyone - entry.rank_sum      # (the one rank that has not come)
            if missing == 0:
                return None
            first = entry.uniform if entry.uniform is not None else entry[0]
            if (first.kind != ALLREDUCE or first not in self._cache
                    or nbytes(first) <= min_bytes
                    or (entry.uniform is None and any(q != first for q in entry.values()))):
                return None
            if last is None:
                last = missing
            elif missing != last:
                return None
            reqs.append(first)
        return last, tuple(self._cache[q] for q in reqs), tuple(_fuse(reqs, self.fusion_threshold))

    # -- output ---------------------------------------------------------------------------
    def take_responses(self):
        """The responses decided since the last call, in the order every rank must run them."""
        self._flush_ready()
        if len(self._departed) == self.size and not self._pending and not self._shutdown_sent:
            self._out.append(Shutdown())
            self._shutdown_sent = True
        out, self._out = self._out, []
        return out

    def deadlock(self, waits):
        """Fail the collectives that every rank waits for when none can complete: ``waits``
        is ``{rank: the name its main thread waits for}``; when every rank that has neither
        joined nor left waits for a collective it submitted that another rank has not, each
        of those collectives fails on every rank with one message naming what each rank
        waits for (names that differ between ranks, which no time will bring together).
        Returns that message, or None (nothing is changed)."""
        live = [r for r in range(self.size) if r not in self._departed and r not in self._joined]
        blocked = {}
        for rank in live:
            keys = [k for k, entry in self._pending.items()
                    if k[1] == waits.get(rank) and rank in entry]
            if len(keys) != 1:
                return None
            blocked[rank] = keys[0]
        if not blocked:
            return None
        lines = []
        for rank, key in blocked.items():
            entry = self._pending[key]
            missing = [r for r in self._members(key) if r not in entry and r not in self._joined]
            if not missing:
                return None
            kind = KIND_NAMES.get(next(iter(entry.values())).kind, "collective")
            lines.append(f"rank {rank} waits for {kind} {key[1]!r}, which rank"
                         f"{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} "
                         f"did not submit")
        message = ("collectives deadlocked: every rank waits for a collective that another "
                   "rank did not submit (names that differ between ranks: rank-dependent "
                   "control flow, or automatic names drawn by calls some ranks did not "
                   "make; name such collectives explicitly): " + "; ".join(lines))
        for key in dict.fromkeys(blocked.values()):
            req = next(iter(self._drop(key).values()))
            self._error(req, message, "mismatch")
        return message

    def stalled(self, now, after):
        """``{rank: [names]}`` of ranks missing from collectives older than ``after`` s."""
        missing = collections.defaultdict(list)
        for key, entry in self._pending.items():
            if now - self._first_seen[key] >= after:
                for rank in self._members(key):
                    if rank not in entry and rank not in self._joined:
                        missing[rank].append(key[1])
        return dict(missing)

    def stalled_collectives(self, now, after):
        """``[(name, submitted ranks, missing ranks)]`` of collectives older than ``after`` s
        (joined ranks are not missing): what the stall inspector's hints reason about."""
        out = []
        for key, entry in self._pending.items():
            if now - self._first_seen[key] >= after:
                lack = [r for r in self._members(key) if r not in entry and r not in self._joined]
                if lack:
                    out.append((key[1], sorted(entry), lack))
        return out


def _count_wait(first, now, last):
    """A collective completed: ``last`` came last, ``now - first`` after the first."""
    c = stats.counters
    c.waits += 1
    c.wait_s += now - first
    c.last[last] += 1


def nbytes(req):
    """The bytes of a request's tensors (all of them, for a grouped allreduce)."""
    return np.dtype(req.dtype).itemsize * sum(math.prod(s) for s in req.shapes)


def _fuse(ready, threshold):
    """The responses that run the allreduces ``ready`` (in this order), neighbours of the
    same set, dtype, device, op and scaling fused while their bytes stay within ``threshold``."""
    out, group, group_key, group_bytes = [], [], None, 0
    for req in ready:
        size = nbytes(req)
        key = (req.process_set, req.dtype, req.device, req.op, req.prescale, req.postscale)
        if group and (key != group_key or group_bytes + size > threshold):
            out.append(Run(ALLREDUCE, group_key[0], tuple(q.name for q in group)))
            group, group_bytes = [], 0
        group.append(req)
        group_key = key
        group_bytes += size
    if group:
        out.append(Run(ALLREDUCE, group_key[0], tuple(q.name for q in group)))
    return out


def _shutdown_message(req, gone):
    ranks = ", ".join(map(str, gone))
    return (f"{KIND_NAMES.get(req.kind, 'collective')} {req.name!r} cannot complete: rank"
            f"{'s' if len(gone) > 1 else ''} {ranks} ha{'ve' if len(gone) > 1 else 's'} "
            f"shut down (hora.shutdown() or the end of its script) before submitting it")
