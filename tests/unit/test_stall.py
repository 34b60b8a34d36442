"""The stall inspector's text and bookkeeping, without processes (hora.core.stall)."""
import threading
import time

from hora.core.messages import ALLREDUCE, Request
from hora.core.negotiation import Coordinator
from hora.core.stall import StackRequests, hints, main_thread_stack, warning_text


def _req(name):
    return Request(name, ALLREDUCE, "float32", ((2,),), 1, 0, 1.0, 1.0, None)


def test_hint_names_differ_between_ranks():
    coord = Coordinator(3)
    coord.submit(0, [_req("grad.x")], now=0.0)
    coord.submit(2, [_req("grad.x")], now=0.0)
    coord.submit(1, [_req("grad.y")], now=0.5)
    lines = hints(coord.stalled_collectives(10.0, 5.0), coord.last_submit, 10.0, 5.0)
    assert len(lines) == 1
    assert "names differ" in lines[0]
    assert "ranks 0, 2 submitted [grad.x]; rank 1 submitted [grad.y]" in lines[0]


def test_hint_rank_that_submitted_nothing_suggests_join():
    coord = Coordinator(3)
    for r in range(3):
        coord.submit(r, [_req("warmup")], now=-20.0)
    coord.take_responses()
    coord.submit(0, [_req("a")], now=0.0)
    coord.submit(1, [_req("a")], now=0.0)
    lines = hints(coord.stalled_collectives(10.0, 5.0), coord.last_submit, 10.0, 5.0)
    assert lines == [l for l in lines if "rank 2 has submitted no collective for 30 s" in l]
    assert "join" in lines[0]
    fresh = Coordinator(2)
    fresh.submit(0, [_req("a")], now=0.0)
    lines = hints(fresh.stalled_collectives(9.0, 5.0), fresh.last_submit, 9.0, 5.0)
    assert "rank 1 has not submitted any collective yet" in lines[0]


def test_no_hint_for_a_rank_that_is_busy_with_other_collectives():
    coord = Coordinator(2)
    coord.submit(0, [_req("a")], now=0.0)
    coord.submit(1, [_req("b"), _req("b2")], now=9.0)    # recent, and not yet stalled
    stalled = coord.stalled_collectives(10.0, 5.0)
    assert stalled == [("a", [0], [1])]
    assert hints(stalled, coord.last_submit, 10.0, 5.0) == []


def test_warning_keeps_horovods_shape_and_appends_hints():
    text = warning_text({1: ["grad.x"], 2: [f"t{i}" for i in range(9)]}, ["Hint: h"], 60.0)
    assert text.startswith("One or more tensors were submitted to be reduced, gathered or "
                           "broadcasted by subset of ranks and are waiting for remainder of "
                           "ranks for more than 60 seconds.")
    assert "\nMissing ranks:\n1: [grad.x]\n2: [t0, t1, t2, t3, t4, t5 ...]\nHint: h" in text


def test_main_thread_stack_shows_where_the_main_thread_is():
    out = []
    done = threading.Event()

    def look():
        for _ in range(500):            # until the main thread has reached its wait
            text = main_thread_stack()
            if "done.wait(10)" in text:
                break
            time.sleep(0.01)
        out.append(text)
        done.set()

    def waiting_here():
        threading.Thread(target=look).start()
        done.wait(10)

    waiting_here()
    assert "in waiting_here" in out[0] and "done.wait(10)" in out[0]


def test_stack_requests_round_late_answers_and_silent_ranks():
    sr = StackRequests(wait_s=1.0)
    token, ask = sr.ask({1: ["x"], 2: ["x"]}, now=0.0)
    assert ask == [1, 2]
    assert sr.answer(1, token, "  File a.py\n", now=0.1) is None
    assert sr.report(0.2) is None                       # rank 2 may still answer
    text = sr.report(1.5)
    assert "rank 1:\n      File a.py" in text
    assert "rank 2: no answer after 1.5 s" in text
    assert sr.report(1.6) is None                       # reported once
    token2, ask2 = sr.ask({2: ["x"]}, now=2.0)
    assert ask2 == []                                   # still silent: not asked twice
    late = sr.answer(2, token, "  File b.py\n", now=5.0)
    assert late is None                                 # part of the open round
    assert "rank 2:\n      File b.py" in sr.report(5.0)
    token3, ask3 = sr.ask({2: ["x"]}, now=6.0)
    assert ask3 == [2]
    sr.report(8.0)                                       # round closes without it
    late = sr.answer(2, token3, "  File c.py\n", now=9.0)
    assert "rank 2 answered 3.0 s after it was asked" in late and "File c.py" in late
