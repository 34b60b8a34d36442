"""Rank 0's side of the engine reading its workers (hora.core.engine.coordinator): ranks
that sent the same cached ids in one step become one entry of each collective, and other
messages keep their order around them.  Real control connections (socket pairs framed by
:class:`~hora.core.engine.conn.Conn`) and the real Coordinator."""
import socket
import types

import pytest

from hora.config import Settings
from hora.core.engine.conn import Conn
from hora.core.engine.coordinator import CoordinatorSide
from hora.core.messages import ALLREDUCE, Request, Sum
from hora.core.wire import Bye, Req

pytestmark = pytest.mark.timeout(30)

N = 5


def ar(name):
    return Request(name, ALLREDUCE, "<f4", ((4,),), Sum, -1, 1.0, 1.0, None)


@pytest.fixture
def job():
    """Rank 0's side of a job of N ranks on one host, and ``{rank: Conn}`` that the workers
    write to."""
    mine, theirs = {}, {}
    for r in range(1, N):
        a, b = socket.socketpair()
        mine[r], theirs[r] = Conn(a, r, 5.0), Conn(b, 0, 5.0)
    executor = types.SimpleNamespace(pending={}, tuning=False)
    s = CoordinatorSide(N, mine, executor, Settings(), lambda: 0.0, lambda ms: None)
    yield s, theirs
    for conn in (*mine.values(), *theirs.values()):
        conn.sock.close()


def _cache(side, reqs):
    """Every rank submits ``reqs`` twice, so that they are cached; their ids."""
    coord = side.coord
    for _ in range(2):
        for r in range(N):
            coord.submit(r, reqs, 0.0)
        coord.take_responses()
    return [coord._cache[q] for q in reqs]


def test_ranks_that_sent_the_same_ids_in_one_step_are_one_entry(job):
    side, workers = job
    ids = _cache(side, [ar("a"), ar("b")])
    for r in range(1, N):
        workers[r].send(Req([], {}, ids, False))
    side._hear_workers(0.0, None)
    for name in ("a", "b"):
        entry = side.coord._pending[(0, name)]
        req = side.coord.cached_request(ids[0 if name == "a" else 1])
        assert len(entry) == N - 1 and entry._hosts == [((1, 2, 3, 4), req)]
        assert not entry._one
    side.coord.submit(0, [ar("a"), ar("b")], 0.0)
    assert side.coord.take_responses() == [("run", ALLREDUCE, 0, ("a", "b"), None)]


def test_other_messages_are_taken_after_the_ids_read_before_them(job):
    """A rank's cached ids and then its goodbye, read in one step: the ids count first (the
    collective completes), the goodbye after; and ids that differ are entries of their
    own."""
    side, workers = job
    ids = _cache(side, [ar("a"), ar("b")])
    side.coord.submit(0, [ar("a")], 0.0)
    for r in (1, 2):
        workers[r].send(Req([], {}, ids[:1], False))
    workers[3].send(Req([], {}, ids[:1], False))
    workers[3].send(Bye())
    workers[4].send(Req([], {}, ids, False))
    side._hear_workers(0.0, None)
    got = side.coord.take_responses()
    assert got[0] == ("run", ALLREDUCE, 0, ("a",), None)
    # b: rank 4 sent it after rank 3 had left without it
    [(tag, _, names, message, why, _)] = got[1:]
    assert (tag, names, why) == ("error", ("b",), "shutdown") and "rank 3" in message
