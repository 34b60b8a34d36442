"""Fault injection on real jobs: every scenario of tests/faults.py (the same ones
docs/reliability.md reports), with hand-started ranks and under ``hora run``.

A failing scenario prints what went wrong (wrong rank named, too slow, a hang, a process or
/dev/shm segment left behind) and rank 0's log.
"""
import pytest

from tests.faults import LIMIT_S, SCENARIOS, run_launcher, run_raw

_RUNS = [pytest.param(run_raw, sc, id=f"{sc.name}-raw") for sc in SCENARIOS] + [
    pytest.param(run_launcher, sc, id=f"{sc.name}-hora_run") for sc in SCENARIOS if sc.launcher]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("run,scenario", _RUNS)
def test_fault_is_detected_named_and_cleaned_up(run, scenario, tmp_path):
    if scenario.name == "optimizer_step":
        pytest.importorskip("torch")
    outcome = run(scenario, tmp_path)
    assert outcome.ok, f"{scenario.what}: {outcome.problems}\n--- log ---\n{outcome.log[-3000:]}"
    assert not outcome.leftovers
    if scenario.expect == "fail":
        assert outcome.detection_s is not None and outcome.detection_s < LIMIT_S
