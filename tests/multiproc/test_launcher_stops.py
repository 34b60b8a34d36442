"""How ``hora run`` stops, with real processes: a failing or killed rank ends the job, a
signal to the launcher stops its workers and their children, an idle launcher sleeps yet
answers a signal at once, and a killed launcher takes its workers along.

Every worker script gets a unique marker in its argv, so that "nothing is left alive" is checked
by scanning /proc for that marker (psutil may not be installed).
"""
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from tests.helpers import alive_count
from tests.multiproc.hora_cli import assert_none_alive, hora_cli, hora_env, write_script


@pytest.fixture
def marker():
    return f"hora-test-{uuid.uuid4().hex}"


# -- hora run: failures ----------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_failing_rank_stops_the_job(tmp_path, marker):
    script = write_script(tmp_path, """
        import os, sys, time
        if os.environ["HORA_RANK"] == "1":
            time.sleep(0.3)
            sys.exit(3)
        time.sleep(60)
        """)
    start = time.monotonic()
    out = hora_cli("run", "-np", "3", sys.executable, script, marker)
    elapsed = time.monotonic() - start
    assert out.returncode == 3, out.stderr
    assert elapsed < 10, elapsed
    assert "rank 1 (pid" in out.stderr and "exited with code 3" in out.stderr, out.stderr
    assert_none_alive(marker)


@pytest.mark.timeout(60)
def test_rank_killed_by_signal_is_reported(tmp_path, marker):
    script = write_script(tmp_path, """
        import os, signal, time
        if os.environ["HORA_RANK"] == "0":
            time.sleep(0.2)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
        """)
    out = hora_cli("run", "-np", "2", sys.executable, script, marker)
    assert out.returncode == 128 + signal.SIGKILL, out.stderr
    assert "rank 0 (pid" in out.stderr, out.stderr
    assert "was killed by signal SIGKILL" in out.stderr, out.stderr
    assert_none_alive(marker)


def _start_ready_job(tmp_path, marker, np=2, grandchild=True):
    """Start ``hora run`` with workers that (maybe) spawn a grandchild, then wait for all."""
    spawn = (f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', "
             f"{marker!r}])" if grandchild else "None")
    script = write_script(tmp_path, f"""
        import os, subprocess, sys, time
        child = {spawn}
        open(os.path.join({str(tmp_path)!r}, "ready." + os.environ["HORA_RANK"]), "w").close()
        time.sleep(60)
        """)
    launcher = subprocess.Popen([sys.executable, "-m", "hora", "run", "-np", str(np),
                                 sys.executable, script, marker], env=hora_env(),
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not all((tmp_path / f"ready.{r}").exists() for r in range(np)):
        if time.monotonic() > deadline or launcher.poll() is not None:
            launcher.kill()
            pytest.fail(f"workers never became ready: {launcher.communicate()}")
        time.sleep(0.05)
    return launcher


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_launcher_stops_workers_and_grandchildren(tmp_path, marker, sig):
    launcher = _start_ready_job(tmp_path, marker)
    try:
        assert len(alive_count(marker, 5)) == 5      # the launcher, 2 workers, 2 grandchildren
        launcher.send_signal(sig)
        stdout, stderr = launcher.communicate(timeout=20)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == 128 + sig, stderr
    assert f"received {signal.Signals(sig).name}" in stderr, stderr
    assert_none_alive(marker)


def _context_switches(pid):
    """Voluntary and involuntary context switches of every thread of ``pid`` so far."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                total += sum(int(line.split()[1]) for line in f if "ctxt_switches" in line)
        except OSError:             # the thread ended
            pass
    return total


@pytest.mark.timeout(60)
@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="the launcher polls without pidfds")
def test_an_idle_launcher_sleeps_and_still_answers_a_signal_at_once(tmp_path, marker):
    # Ranks that train use every CPU: each wake-up of the launcher takes one from them. Its
    # threads (exit monitor, output forwarding, rendezvous) sleep until something happens.
    launcher = _start_ready_job(tmp_path, marker, grandchild=False)
    try:
        time.sleep(0.5)                         # the start-up's own traffic is over
        before, t0 = _context_switches(launcher.pid), time.monotonic()
        time.sleep(3.0)
        rate = (_context_switches(launcher.pid) - before) / (time.monotonic() - t0)
        sent = time.monotonic()
        launcher.send_signal(signal.SIGTERM)
        launcher.communicate(timeout=20)
        reacted_s = time.monotonic() - sent
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert rate < 6, f"the idle launcher woke {rate:.1f} times a second"
    assert launcher.returncode == 128 + signal.SIGTERM
    # woken by the signal itself, not by its next look (1 s apart)
    assert reacted_s < 0.9, f"the launcher took {reacted_s:.2f} s to stop the job"
    assert_none_alive(marker)


@pytest.mark.timeout(60)
def test_killed_launcher_takes_its_workers_along(tmp_path, marker):
    launcher = _start_ready_job(tmp_path, marker, grandchild=False)
    launcher.kill()                              # SIGKILL: no chance to clean up
    launcher.communicate()
    assert_none_alive(marker)                   # PR_SET_PDEATHSIG did it
