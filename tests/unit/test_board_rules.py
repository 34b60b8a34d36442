"""The board's decisions (hora.core.engine.board_rules), each rule on its own, without a
board or a process: which calls the board takes, how rank 0 answers, when posts go to the
engine, when a leader vetoes a host round."""
from types import SimpleNamespace

import pytest

from hora.backends.board_segment import GO, RESULT, SHARED, STRIPE_BYTES
from hora.core.engine.board_rules import (PATIENCE_S, declined, idle_verdict, leader_verdict,
                                          malformed, rank0_verdict, round_answer,
                                          round_outcome, stale, waited)
from hora.core.messages import ALLGATHER, ALLREDUCE, BARRIER, BROADCAST

CAP = 1 << 20


def _declined(kind, nbytes, root=0, size=4, rows=1, capacity=CAP, hosts=1, sig_len=40):
    return declined(kind, nbytes, root, size, rows, capacity, hosts, sig_len, 256)


def test_the_board_takes_what_it_can_settle_and_says_why_not_otherwise():
    assert _declined(ALLREDUCE, 4) is None
    assert _declined(ALLREDUCE, CAP) is None and _declined(ALLREDUCE, CAP + 1) == "size"
    assert _declined(BARRIER, 0) is None
    assert _declined(BROADCAST, 64, root=3) is None
    assert _declined(BROADCAST, 64, root=4) == "root"       # the engine names the error
    assert _declined(BROADCAST, 64, root=-1) == "root"
    assert _declined(ALLGATHER, 64, rows=0) == "empty rows"
    # broadcasts and allgathers take SHARED rounds only: small, on one host
    assert _declined(ALLGATHER, STRIPE_BYTES - 1) is None
    assert _declined(ALLGATHER, STRIPE_BYTES) == "size"
    assert _declined(BROADCAST, 64, hosts=2) == "size"
    assert _declined(ALLREDUCE, 64, hosts=2) is None
    assert _declined(ALLREDUCE, 64, sig_len=257) == "signature"


def test_a_malformed_call_goes_to_the_engine_whatever_its_size():
    assert malformed(BROADCAST, 1, 1, 1) == "root"
    assert malformed(BROADCAST, 0, 1, 1) is None
    assert malformed(ALLGATHER, 0, 1, 0) == "empty rows"
    assert malformed(ALLREDUCE, 7, 1, 0) is None


@pytest.mark.parametrize("kind,nbytes,want", [
    (BARRIER, 0, RESULT), (ALLREDUCE, 4, SHARED), (ALLREDUCE, STRIPE_BYTES - 1, SHARED),
    (ALLREDUCE, STRIPE_BYTES, GO), (BROADCAST, 64, SHARED), (ALLGATHER, 64, SHARED)])
def test_rank_0_answers_stripes_from_stripe_bytes_and_releases_a_barrier(kind, nbytes, want):
    assert round_answer(kind, nbytes) == want


def test_rank_0_answers_only_when_idle_and_every_post_matches():
    asked = []

    def matches(result):
        return lambda: asked.append(1) or result
    assert rank0_verdict(False, True, matches(True), 0.0) is True
    assert rank0_verdict(False, True, matches(False), 0.0) == "differ"
    assert rank0_verdict(True, True, matches(True), 0.0) == "busy"      # busy comes first
    n = len(asked)
    assert rank0_verdict(False, False, matches(True), PATIENCE_S - 1e-3) is None
    assert rank0_verdict(False, False, matches(True), PATIENCE_S + 1e-3) == "patience"
    assert len(asked) == n              # the signatures are read only once every rank posted


def test_stale_posts_are_all_of_them_when_busy_else_those_past_their_patience():
    seen = {}
    assert stale({1: 5, 2: 7}, False, seen, 10.0) == {}
    assert stale({1: 5, 2: 7}, True, seen, 10.0) == {1: 5, 2: 7}
    assert stale({1: 5, 2: 8}, False, seen, 10.0 + PATIENCE_S) == {1: 5}   # rank 2: a new post
    assert stale({2: 8}, False, seen, 10.0 + 2 * PATIENCE_S) == {2: 8}


def test_a_post_waits_from_when_it_was_first_seen():
    seen = {}
    assert waited(seen, 1, 3, 5.0) == 0.0
    assert waited(seen, 1, 3, 5.5) == 0.5
    assert waited(seen, 1, 4, 6.0) == 0.0           # the next post starts again


def test_a_leader_vetoes_for_the_first_reason_it_has_else_plays_or_waits():
    yes = lambda: True      # noqa: E731
    no = lambda: False      # noqa: E731
    assert leader_verdict(True, True, True, True, yes, 0.0) == "vetoed"
    assert leader_verdict(False, True, True, True, yes, 0.0) == "urged"
    assert leader_verdict(False, False, True, True, yes, 0.0) == "busy"
    assert leader_verdict(None, None, None, True, yes, 0.0) is True     # (not looked at)
    assert leader_verdict(None, None, None, True, no, 0.0) == "differ"
    assert leader_verdict(None, None, None, False, yes, PATIENCE_S / 2) is None
    assert leader_verdict(None, None, None, False, yes, PATIENCE_S * 2) == "patience"


def test_an_idle_leader_vetoes_a_round_it_cannot_play_soon():
    assert idle_verdict(True, False, False, 0.0) == "idle vetoed"
    assert idle_verdict(False, True, False, 0.0) == "idle busy"
    assert idle_verdict(False, False, True, 0.0) == "idle urged"
    assert idle_verdict(False, False, False, PATIENCE_S) == "idle patience"
    assert idle_verdict(False, False, False, PATIENCE_S / 2) is None


def test_a_round_is_played_only_when_every_leader_posted_the_same_call():
    def post(sig, data=b"abcd"):
        return SimpleNamespace(sig=sig, data=data)
    assert round_outcome({1: post(b"s"), 2: post(b"s")}, b"s", 4) is True
    assert round_outcome({1: post(b"s"), 2: post(b"t")}, b"s", 4) == "differ"
    assert round_outcome({1: post(b"s"), 2: post(b"s", b"ab")}, b"s", 4) == "differ"
    assert round_outcome({1: post(b"s"), 2: post(b"", b"")}, b"s", 4) == "vetoed"
