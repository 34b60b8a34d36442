"""Elastic jobs whose discovery script misbehaves, end to end (``hora run`` with real
workers): a host list that is empty for a moment, and a script that hangs.

- every host leaves the discovery output for 2.5 s: the workers are stopped, the job waits
  (``--elastic-timeout``) instead of ending, and new workers start once the hosts are back;
  they train from the initial state, so the final weights equal one process training on
  the same global batches (tests/elastic_main.py's reference).  Two workers: every worker
  is stopped and replaced alike, so a third would check nothing more;
- a discovery script that starts a child that sleeps: the run is killed at its timeout
  (HORA_DISCOVERY_TIMEOUT: 2 s here, not the 10 s default, so the test need not wait
  10 s), its child too, the job keeps its hosts and finishes, and no run or child of the
  script outlives the launcher.
"""
import json
import os
import subprocess
import sys
import time
import uuid

import pytest

from tests import elastic_main
from tests.helpers import survivors

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "elastic_main.py")
GLITCH_S = 2.5


def _hora_run(flags, command, env):
    env = dict(os.environ, **env)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    return subprocess.Popen([sys.executable, "-m", "hora", "run", *flags, *command],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            stdin=subprocess.DEVNULL)


def _wait_for(path, proc, within_s):
    deadline = time.monotonic() + within_s
    while not path.exists():
        assert proc.poll() is None, "the job ended before it got there"
        assert time.monotonic() < deadline, f"{path.name} did not appear within {within_s} s"
        time.sleep(0.05)


@pytest.mark.timeout(150)
def test_workers_stopped_by_an_empty_host_list_are_replaced_when_hosts_return(tmp_path):
    hosts, trigger, out = tmp_path / "hosts", tmp_path / "trigger", tmp_path / "report.json"
    hosts.write_text("localhost:2\n")
    marker = f"hora-glitch-{uuid.uuid4().hex}"
    # rank 0 touches the trigger at epoch 0 batch 2; the 22 steps that remain of round 0
    # sleep 0.25 s each, >= 5 s: time for the empty list to reach the launcher.  (The new
    # workers, in a later round, do not sleep.)  They hold at epoch 0 batch 2 until both
    # are in: the job ends at 2 workers.
    job = _hora_run(["-np", "2", "--min-np", "1", "--elastic-timeout", "60",
                     "--host-discovery-script", f"cat {hosts}"], [sys.executable, SCRIPT, marker],
                    {"ELASTIC_OUT": str(out), "ELASTIC_GROW": f"0:2:{trigger}:x",
                     "ELASTIC_STEP_SLEEP": "0.25", "ELASTIC_HOLD": "0:2:2"})
    try:
        _wait_for(trigger, job, 90)
        hosts.write_text("")
        time.sleep(GLITCH_S)
        hosts.write_text("localhost:2\n")
        _, stderr = job.communicate(timeout=120)
    finally:
        job.kill()
    assert survivors(marker, 5.0) == [], "processes of the job were left alive"
    assert job.returncode == 0, stderr[-3000:]
    assert "host localhost left the discovery output; stopping worker" in stderr
    assert "fewer than --min-np 1; waiting up to 60 s for more" in stderr
    assert "(added)" in stderr
    report = json.loads(out.read_text())
    elastic_main.check_training(report, elastic_main.reference_weights())
    assert report["final_size"] == 2
    # the first workers were stopped: the final ones joined after round 0
    assert all(number >= 1 for entries in report["pids"] for number, _, _ in entries), \
        report["pids"]


@pytest.mark.timeout(60)
def test_a_hung_discovery_script_is_killed_with_its_children(tmp_path):
    """The worker makes the script hang (a child sleeping 1000 s) and lives 6 s: past a
    1 s period and the 2 s bound on one run (HORA_DISCOVERY_TIMEOUT), so one run times
    out and the next is in flight when the job ends, with 3 s to spare as with the 10 s
    default and a worker of 14 s."""
    marker = f"hora-hung-discovery-{uuid.uuid4().hex}"
    flag, hosts = tmp_path / "hang", tmp_path / "hosts"
    hosts.write_text("localhost:1\n")
    script = tmp_path / f"discover-{marker}.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts}\n[ -e {flag} ] && "
                      f"{sys.executable} -c 'import time; time.sleep(1000)' {marker}\nexit 0\n")
    script.chmod(0o755)
    worker = f"import pathlib, time; pathlib.Path({str(flag)!r}).touch(); time.sleep(6)"
    job = _hora_run(["-np", "1", "--min-np", "1", "--host-discovery-script", str(script)],
                    [sys.executable, "-c", worker], {"HORA_DISCOVERY_TIMEOUT": "2"})
    try:
        _, stderr = job.communicate(timeout=45)
    finally:
        job.kill()
    assert job.returncode == 0, stderr[-3000:]
    assert survivors(marker, 5.0) == [], "the discovery script or its child outlived the job"
    assert "did not finish within 2 s; killed; keeping the hosts found before" in stderr
