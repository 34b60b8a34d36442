"""Fault injection on real jobs: every scenario of tests/faults.py (the same ones
docs/reliability.md reports), with hand-started ranks, and under ``hora run`` those that
show the launcher something no other scenario shows it (:data:`LAUNCHER_SCENARIOS`).

A failing scenario prints what went wrong (wrong rank named, too slow, a hang, a process or
/dev/shm segment left behind) and rank 0's log.
"""
import dataclasses
import importlib.util

import pytest

from tests.faults import LIMIT_S, SCENARIOS, run_launcher, run_raw

# Under ``hora run`` the launcher sees a rank die of SIGKILL, names it and stops the rest of
# the job; what the survivors were doing matters to it only where they hold something it
# must clean up, or where it is itself in another state.  These show it each case once:
# "init" (a rank dies before the job has formed), "shm_allreduce" (the survivors hold
# shared-memory segments), "ring_allreduce" (survivors in the middle of TCP transfers when
# it stops them), "user_code" (survivors waiting in a collective), "user_code_idle"
# (survivors in user code, no collective in flight) and "coordinator" (rank 0 dies).
# Not again: "negotiation" and "broadcast" (survivors waiting in a collective, as in
# "user_code", or mid-transfer on TCP, as in "ring_allreduce": which op or phase it is the
# launcher does not see), "coordinator_allreduce" (rank 0 dies, as in "coordinator") and
# "optimizer_step" (torch in the ranks changes nothing the launcher sees, and its run
# imports torch in 3 more processes).  tools/reliability_report.py still runs every
# scenario both ways.
LAUNCHER_SCENARIOS = {"init", "shm_allreduce", "ring_allreduce", "user_code", "user_code_idle",
                      "coordinator"}


def _here(sc):
    """``sc`` as this test runs it: "optimizer_step" at 2 ranks, not 3 (one torch process
    fewer).  What it adds is torch's DistributedOptimizer surfacing the death as a
    HorovodInternalError from step(), which its one survivor shows; that every survivor of a
    3-rank TCP ring names the dead rank, not a neighbour, "ring_allreduce" shows.
    tools/reliability_report.py runs it at 3."""
    return dataclasses.replace(sc, np=2) if sc.name == "optimizer_step" else sc


_RUNS = [pytest.param(run_raw, _here(sc), id=f"{sc.name}-raw") for sc in SCENARIOS] + [
    pytest.param(run_launcher, sc, id=f"{sc.name}-hora_run") for sc in SCENARIOS
    if sc.launcher and sc.name in LAUNCHER_SCENARIOS]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("run,scenario", _RUNS)
def test_fault_is_detected_named_and_cleaned_up(run, scenario, tmp_path):
    if scenario.name == "optimizer_step" and importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")       # (found, not imported: the ranks do)
    outcome = run(scenario, tmp_path)
    assert outcome.ok, f"{scenario.what}: {outcome.problems}\n--- log ---\n{outcome.log[-3000:]}"
    assert not outcome.leftovers
    if scenario.expect == "fail":
        assert outcome.detection_s is not None and outcome.detection_s < LIMIT_S
