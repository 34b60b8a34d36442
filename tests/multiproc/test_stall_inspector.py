"""The stall inspector on real ranks: stacks of the missing ranks, hints, repetition."""
import time

import numpy as np
import pytest

import hora
from tests.helpers import RawJob


def _sleepy_input_pipeline():
    """rank 1 is 'stuck in its data loader' for a while; the others wait in an allreduce."""
    hora.init()
    hora.allreduce(np.ones(1), name="warmup")
    if hora.rank() == 1:
        _load_next_batch(4.5)
    out = hora.allreduce(np.ones(2), op=hora.Sum, name="grad.w")
    hora.shutdown()
    return out


def _load_next_batch(seconds):
    time.sleep(seconds)


@pytest.mark.timeout(60)
def test_warning_repeats_and_shows_the_missing_ranks_stack_and_a_hint(tmp_path):
    job = RawJob(_sleepy_input_pipeline, 3, tmp_path, env={"HORA_STALL_CHECK_TIME_SECONDS": "1"})
    for res in job.results(timeout_s=40):
        assert res[0] == "ok", res
        np.testing.assert_array_equal(res[1], [3.0, 3.0])
    err = job.stderr(0)
    assert "Missing ranks:\n1: [grad.w]" in err
    # repeated at the interval while the stall lasts (about 4.5 s at 1 s: at least 2)
    assert err.count("waiting for remainder of ranks") >= 2, err
    assert "Hint: rank 1 has submitted no collective for" in err and "hora.join()" in err
    # rank 1's main thread, as rank 1's engine reported it
    assert "where each missing rank's main thread is:\nrank 1:" in err, err
    assert "in _load_next_batch" in err and "time.sleep(seconds)" in err


def _rank_dependent_names():
    hora.init()
    name = "grad.y" if hora.rank() == 1 else "grad.x"
    h = hora.allreduce_async(np.ones(2), name=name)
    time.sleep(2.5)
    # the fix-up a user would make: every rank submits both names
    other = hora.allreduce_async(np.ones(2), name="grad.x" if name == "grad.y" else "grad.y")
    out = (hora.synchronize(h), hora.synchronize(other))
    hora.shutdown()
    return out


@pytest.mark.timeout(60)
def test_names_that_differ_between_ranks_get_a_hint(tmp_path):
    job = RawJob(_rank_dependent_names, 3, tmp_path, env={"HORA_STALL_CHECK_TIME_SECONDS": "1"})
    for res in job.results(timeout_s=40):
        assert res[0] == "ok", res
    err = job.stderr(0)
    assert ("Hint: names differ between ranks: ranks 0, 2 submitted [grad.x]; "
            "rank 1 submitted [grad.y]") in err, err
    assert "in _rank_dependent_names" in err     # the stacks show where each rank sleeps
