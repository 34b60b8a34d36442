"""A leader's side of the engine (hora.core.engine.leader) on its real control connections
(socket pairs framed by :class:`~hora.core.engine.conn.Conn`): in a job with one board, whose
posts rank 0 answers (one host led in groups), a nudge from a rank below goes up to rank 0;
where the leader leads its host's board, the nudge has done its work by waking it."""
import select
import socket
import types

import pytest

from hora.config import Settings
from hora.core.engine.conn import Conn
from hora.core.engine.leader import LeaderSide
from hora.core.links import ctrl_parents
from hora.core.wire import Nudge

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def leader():
    """``make(nudges_up)``: leader 2 of one host of 7 ranks in groups of 2 (rank 3 and
    leader 6 below it), and the far ends: its parent's (rank 0) and its ranks'."""
    socks = []

    def make(nudges_up):
        ends = {}
        for r in (0, 3, 6):
            a, b = socket.socketpair()
            socks.extend((a, b))
            ends[r] = (Conn(a, r, 5.0), Conn(b, 2, 5.0))
        executor = types.SimpleNamespace(pending={}, tuning=False)
        side = LeaderSide(2, ends[0][0], {3: ends[3][0], 6: ends[6][0]}, executor,
                          lambda: 0.0, Settings(), ctrl_parents(("a",) * 7, 2), nudges_up)
        return side, {r: far for r, (_, far) in ends.items()}
    yield make
    for s in socks:
        s.close()


def _heard(conn, wait_s):
    select.select([conn], [], [], wait_s)
    return conn.receive()


@pytest.mark.parametrize("nudges_up", [True, False])
def test_a_nudge_from_below_goes_up_only_where_rank_0_answers_the_board(leader, nudges_up):
    side, far = leader(nudges_up)
    far[6].send(Nudge())
    select.select([side.children[6]], [], [], 5.0)
    side._hear_host()
    assert _heard(far[0], 1.0 if nudges_up else 0.2) == ([Nudge()] if nudges_up else [])
    assert not side._going              # (nothing else for rank 0)
