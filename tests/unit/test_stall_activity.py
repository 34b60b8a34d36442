"""What a rank declares it is doing (stall.set_activity) in the stall inspector's words,
and on the wire with its stack."""
import pickle

import pytest

from hora.core import stall, wire
from hora.core.engine.conn import _PLAIN, frame
from hora.core.messages import ALLREDUCE, Request
from hora.core.negotiation import Coordinator

VALIDATING = ("running validation inside fit()", "validate on every rank or on none")


def _req(name):
    return Request(name, ALLREDUCE, "float32", ((2,),), 1, 0, 1.0, 1.0, None)


@pytest.fixture(autouse=True)
def _no_activity():
    yield
    stall.set_activity(None)


def test_set_activity_and_the_context_manager_restore_what_was_declared():
    assert stall.current_activity() is None
    stall.set_activity(*VALIDATING)
    assert stall.current_activity() == VALIDATING
    with stall.activity("saving a checkpoint"):
        assert stall.current_activity() == ("saving a checkpoint", "")
    assert stall.current_activity() == VALIDATING
    with pytest.raises(KeyError), stall.activity("x"):
        raise KeyError
    assert stall.current_activity() == VALIDATING
    stall.set_activity(None)
    assert stall.current_activity() is None


def _stalled_on(busy, n=3):
    """Every rank but ``busy`` submitted grad.a and grad.b long ago."""
    coord = Coordinator(n)
    for r in range(n):
        coord.submit(r, [_req("warmup")], now=-20.0)
    coord.take_responses()
    for r in range(n):
        if r != busy:
            coord.submit(r, [_req("grad.a"), _req("grad.b")], now=0.0)
    return coord


def test_the_hint_says_what_the_missing_rank_does_who_waits_where_and_the_advice():
    coord = _stalled_on(0)
    stalled = coord.stalled_collectives(10.0, 5.0)
    lines = stall.hints(stalled, coord.last_submit, 10.0, 5.0, {0: VALIDATING})
    # the declared activity replaces the guess (out of data, input pipeline)
    assert lines == ["Hint: rank 0 is running validation inside fit() while ranks 1, 2 wait "
                     "for it in [grad.a, grad.b]: validate on every rank or on none."]
    two = _stalled_on(1, n=2)
    assert stall.activity_hints(two.stalled_collectives(10.0, 5.0),
                                {1: ("saving a checkpoint", "")}) == [
        "Hint: rank 1 is saving a checkpoint while rank 0 waits for it in [grad.a, grad.b]."]
    # without one, the guess as before
    assert "has submitted no collective for 30 s" in stall.hints(
        stalled, coord.last_submit, 10.0, 5.0)[0]
    # a rank that is not missing gets no hint for what it does
    assert stall.activity_hints(stalled, {1: VALIDATING}) == []


def test_a_stack_answer_carries_the_activity_into_the_report():
    sr = stall.StackRequests(wait_s=1.0)
    token, ask = sr.ask({1: ["x"], 2: ["x"]}, now=0.0)
    sr.answer(1, token, "  File a.py\n", now=0.1, doing=VALIDATING)
    sr.answer(2, token, "  File b.py\n", now=0.1)
    text = sr.report(0.2)
    assert "rank 1, running validation inside fit():\n      File a.py" in text
    assert "rank 2:\n      File b.py" in text
    token, _ = sr.ask({1: ["x"]}, now=2.0)
    sr.report(3.5)
    late = sr.answer(1, token, "  File c.py\n", now=4.0, doing=VALIDATING)
    assert "it is running validation inside fit(); its main thread is at:" in late


@pytest.mark.parametrize("loads", [pickle.loads, _PLAIN], ids=["pickle", "restricted"])
def test_the_stack_message_carries_the_activity(loads):
    for msg in (wire.Stack(3, "  File a.py\n", VALIDATING), wire.Stack(4, "  File b.py\n")):
        got = wire.decode(loads(frame(msg)[4:]))
        assert got == msg and type(got) is wire.Stack
    assert wire.Stack(4, "t").doing is None
