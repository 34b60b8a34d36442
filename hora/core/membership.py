"""Elastic membership: which job an elastic worker joins, and whether a newer one is coming.

Under an elastic ``hora run`` (:mod:`hora.runner.elastic`) a worker is started with a name
(``HORA_ELASTIC_ID``) and no rank.  The launcher forms the job in *rounds*: round ``n`` is
the list of its members in rank order, written to the launcher's rendezvous store
(:mod:`hora.rendezvous.rounds`).  A worker's ``init()`` waits
for the first round newer than the last one it was in that names it, and takes its rank,
its size and its host's share from it; the round's number keys that job's registrations in
the store, so that ranks of different rounds never meet.

The launcher writes a new round when a worker fails (the survivors) or when workers are
added or removed (discovery); rank 0 learns of it at the next ``State.commit()``
(:func:`pending_change`), and every rank re-forms at the same commit.

Layer: core.  Reads HORA_* through hora.config only.
"""
import dataclasses
import logging
import time

from .. import config
from ..errors import HoraError, HoraInternalError, RendezvousTimeoutError
from ..rendezvous.rounds import LATEST_KEY, READY_PREFIX, ROUND_PREFIX, round_record

__all__ = ["ROUND_PREFIX", "READY_PREFIX", "LATEST_KEY", "is_elastic", "current_round",
           "join_next", "pending_change", "newer_round", "round_record", "JobSupersededError"]

log = logging.getLogger(__name__)

_WAIT_SLICE_S = 1.0                 # a waiting worker re-asks the store this often

_round = -1                         # the round this process joined last (-1: none yet)


class JobSupersededError(HoraInternalError):
    """The launcher formed a newer job while this worker was joining one (a member died,
    or workers came): join the newer one instead."""


def is_elastic():
    """Whether this process was started as a worker of an elastic ``hora run``."""
    return bool(config.env_value("ELASTIC")) and config.env_value("ELASTIC_ID") is not None


def current_round():
    """The round this process joined last, or None outside an elastic job."""
    return _round if _round >= 0 else None


def join_next(placement, settings, client_factory):
    """Wait for the first round newer than this process's last that names this worker;
    return ``(placement, client)``: ``placement`` with that round's rank, size, host share
    and number, and the open client (the caller's to close; :func:`pending_change` asks
    through it).

    Args:
        placement: what the environment says (rendezvous, secret, host, ``elastic_id``).
        settings: the :class:`~hora.config.Settings` (start timeout, for the first contact).
        client_factory: ``client_factory()`` opens a RendezvousClient to the launcher.

    Raises:
        RendezvousTimeoutError: no round named this worker within HORA_ELASTIC_TIMEOUT.
    """
    global _round
    wid = placement.elastic_id
    timeout = config.env_value("ELASTIC_TIMEOUT")
    deadline = time.monotonic() + timeout
    client = client_factory()
    ok = False
    try:
        client.put(f"{READY_PREFIX}{wid}", _round)
        seen = _round
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RendezvousTimeoutError(
                    f"elastic worker {wid}: the launcher placed it in no job within "
                    f"{timeout:g} s (HORA_ELASTIC_TIMEOUT)")
            record = _newest(client, seen, min(left, _WAIT_SLICE_S))
            if record is None:
                continue
            seen = record["round"]
            members = [tuple(m) for m in record["members"]]
            ids = [m[0] for m in members]
            if wid not in ids:
                log.debug("elastic worker %s: not in round %d; waiting for the next", wid, seen)
                continue
            rank = ids.index(wid)
            host = members[rank][1]
            same_host = [w for w, h in members if h == host]
            _round = seen
            ok = True
            return dataclasses.replace(
                placement, rank=rank, size=len(members), local_rank=same_host.index(wid),
                local_size=len(same_host), hostname=host, round=seen), client
    finally:
        if not ok:
            client.close()


def _newest(client, after, timeout):
    """The record of the newest round after round ``after``, waiting up to ``timeout``
    seconds for one; None if none came."""
    _, found = client.wait_prefix(ROUND_PREFIX, after + 2, timeout)
    records = [v for k, v in found.items() if _round_number(k) > after]
    if not records:
        return None
    record = max(records, key=lambda r: r["round"])
    if (type(record) is not dict or type(record.get("members")) is not list
            or type(record.get("round")) is not int):
        raise HoraError(f"the elastic launcher's store holds a malformed round: {record!r:.200}")
    return record


def _round_number(key):
    try:
        return int(key[len(ROUND_PREFIX):])
    except ValueError:
        return -1


def newer_round(client):
    """The newest round's number if it is newer than this process's, else None (one cheap
    question to the launcher's store)."""
    try:
        latest = client.get(LATEST_KEY, 0.0)
    except RendezvousTimeoutError:
        return None
    return latest if type(latest) is int and latest > _round else None


def pending_change(client):
    """``{"time": ..., "change": ...}`` when the launcher has formed a round newer than this
    process's (hosts added: ``"added"``; only removed: ``"removed"``; both: ``"mixed"``),
    else None."""
    latest = newer_round(client)
    if latest is None:
        return None
    changes, when = set(), 0.0
    for n in range(_round + 1, latest + 1):
        try:
            record = client.get(f"{ROUND_PREFIX}{n}", 0.0)
        except RendezvousTimeoutError:
            continue
        changes.add(record["change"])
        when = max(when, record["time"])
    change = changes.pop() if len(changes) == 1 else "mixed"
    return {"time": when, "change": change}
