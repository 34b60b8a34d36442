"""The stall inspector on real ranks: stacks of the missing ranks, hints, repetition."""
import time

import numpy as np
import pytest

import hora
from tests.helpers import RawJob, said, until

# what rank 0 must have said of rank 1's stall before rank 1 goes on (the test checks it)
_STALL_SHOWN = ("Missing ranks:\n1: [grad.w]", "Hint: rank 1 has submitted no collective for",
                "where each missing rank's main thread is:\nrank 1:", "in _load_next_batch",
                "time.sleep(seconds)")


def _sleepy_input_pipeline(tmp):
    """rank 1 is 'stuck in its data loader' until rank 0 has warned twice (at 1 s and 2 s)
    and shown its stack, at most 20 s; the others wait in an allreduce."""
    hora.init()
    hora.allreduce(np.ones(1), name="warmup")
    if hora.rank() == 1:
        def shown():
            err = said(tmp, 0)
            return (err.count("waiting for remainder of ranks") >= 2
                    and all(text in err for text in _STALL_SHOWN))
        _load_next_batch(0.1, shown)
    out = hora.allreduce(np.ones(2), op=hora.Sum, name="grad.w")
    hora.shutdown()
    return out


def _load_next_batch(seconds, done, within_s=20.0):
    deadline = time.monotonic() + within_s
    while not done() and time.monotonic() < deadline:
        time.sleep(seconds)


@pytest.mark.timeout(60)
def test_warning_repeats_and_shows_the_missing_ranks_stack_and_a_hint(tmp_path):
    job = RawJob(_sleepy_input_pipeline, 3, tmp_path, args=(str(tmp_path),),
                 env={"HORA_STALL_CHECK_TIME_SECONDS": "1"})
    for res in job.results(timeout_s=40):
        assert res[0] == "ok", res
        np.testing.assert_array_equal(res[1], [3.0, 3.0])
    err = job.stderr(0)
    assert "Missing ranks:\n1: [grad.w]" in err
    # repeated at the interval while the stall lasts (rank 1 stays until the second)
    assert err.count("waiting for remainder of ranks") >= 2, err
    assert "Hint: rank 1 has submitted no collective for" in err and "hora.join()" in err
    # rank 1's main thread, as rank 1's engine reported it
    assert "where each missing rank's main thread is:\nrank 1:" in err, err
    assert "in _load_next_batch" in err and "time.sleep(seconds)" in err


def _rank_dependent_names(tmp):
    hora.init()
    name = "grad.y" if hora.rank() == 1 else "grad.x"
    h = hora.allreduce_async(np.ones(2), name=name)
    # every rank waits (at most 20 s) until rank 0 has given the hint and shown the stacks
    until(lambda: all(text in said(tmp, 0) for text in (
        "Hint: names differ between ranks", "in _rank_dependent_names")), poll_s=0.1)
    # the fix-up a user would make: every rank submits both names
    other = hora.allreduce_async(np.ones(2), name="grad.x" if name == "grad.y" else "grad.y")
    out = (hora.synchronize(h), hora.synchronize(other))
    hora.shutdown()
    return out


@pytest.mark.timeout(60)
def test_names_that_differ_between_ranks_get_a_hint(tmp_path):
    job = RawJob(_rank_dependent_names, 3, tmp_path, args=(str(tmp_path),),
                 env={"HORA_STALL_CHECK_TIME_SECONDS": "1"})
    for res in job.results(timeout_s=40):
        assert res[0] == "ok", res
    err = job.stderr(0)
    assert ("Hint: names differ between ranks: ranks 0, 2 submitted [grad.x]; "
            "rank 1 submitted [grad.y]") in err, err
    assert "in _rank_dependent_names" in err     # the stacks show where each rank waits
