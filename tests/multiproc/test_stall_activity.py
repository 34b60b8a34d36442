"""The stall inspector names what a missing rank declared it is doing
(hora.core.stall.set_activity), whether it is the coordinator (rank 0: read locally) or a
worker (its engine sends it with its stack), and passes on the advice that came with it."""
import numpy as np
import pytest

import hora
from hora.core import stall
from tests.helpers import RawJob, said, until


def _one_rank_validates(validating, tmp):
    hora.init()
    hora.allreduce(np.ones(1), name="warmup")
    if hora.rank() == validating:
        # "validates" until rank 0 has named the activity and shown the stack under it (a
        # worker's: at the second warning, 2 s in), at most 20 s
        shown = ("Give every rank validation data",
                 f"rank {validating}, running validation inside fit():\n")
        with stall.activity("running validation inside fit()", stall.VALIDATION_ADVICE):
            until(lambda: all(text in said(tmp, 0) for text in shown), poll_s=0.1)
    out = hora.allreduce(np.ones(2), op=hora.Sum, name="grad.w")
    assert stall.current_activity() is None
    hora.shutdown()
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("validating", [0, 1])
def test_the_hint_says_what_the_missing_rank_is_doing_and_what_to_do(tmp_path, validating):
    job = RawJob(_one_rank_validates, 3, tmp_path, env={"HORA_STALL_CHECK_TIME_SECONDS": "1"},
                 args=(validating, str(tmp_path)))
    for res in job.results(timeout_s=40):
        assert res[0] == "ok", res
        np.testing.assert_array_equal(res[1], [3.0, 3.0])
    err = job.stderr(0)
    waiting = "ranks 1, 2 wait" if validating == 0 else "ranks 0, 2 wait"
    hint = (f"Hint: rank {validating} is running validation inside fit() while {waiting} for "
            f"it in [grad.w]: only the ranks given validation data validate")
    assert hint in err, err
    assert "Give every rank validation data (its own shard or channel" in err
    # its stack, labelled with the same activity
    assert f"rank {validating}, running validation inside fit():\n" in err, err
    # a declared activity replaces the guess (out of data? stuck in the input pipeline?);
    # a worker's comes with its stack, after the first warning, which has only the guess
    guesses = err.count(f"Hint: rank {validating} has submitted no collective")
    assert guesses == (0 if validating == 0 else 1), err
