"""tests/workers.py: an ``alone`` test waits for running tests and they wait for it; a
session step runs once across processes."""
import os
import pathlib
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from tests import workers

LOCK = "under-test"     # (this test runs inside the session's own lock)


def test_an_alone_test_waits_for_the_running_ones_and_they_wait_for_it():
    order = []
    shared_in, release = threading.Event(), threading.Event()

    def running():
        with workers.alone(exclusive=False, lock=LOCK):
            shared_in.set()
            release.wait(10)
            order.append("running test ends")

    def alone_test():
        shared_in.wait(10)
        with workers.alone(exclusive=True, lock=LOCK, quiet_s=0):   # (the order, not the CPUs)
            order.append("alone test runs")
            time.sleep(0.2)
            order.append("alone test ends")

    def later_test():
        time.sleep(0.1)     # (after the alone test asked for the lock)
        with workers.alone(exclusive=False, lock=LOCK):
            order.append("later test runs")

    threads = [threading.Thread(target=f) for f in (running, alone_test)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    assert order == [], "the alone test ran beside a running test"
    release.set()
    threads[1].join(10)
    later = threading.Thread(target=later_test)
    # (holds the others off while the later test asks)
    with workers.alone(exclusive=True, lock=LOCK, quiet_s=0):
        later.start()
        time.sleep(0.2)
        assert order[-1] == "alone test ends"
    later.join(10)
    threads[0].join(10)
    assert order == ["running test ends", "alone test runs", "alone test ends",
                     "later test runs"]


def test_a_session_step_runs_once_across_processes(tmp_path):
    """Two processes of one session ask for the step; the first computes, the second reads."""
    count = tmp_path / "count"
    code = ("import pathlib, sys; from tests import workers\n"
            f"p = pathlib.Path({str(count)!r})\n"
            "def step():\n"
            "    p.write_text(p.read_text() + 'x' if p.exists() else 'x'); return {'n': 7}\n"
            "print(workers.once('step-under-test', step))\n")
    # as xdist's workers: children of this process, which is their session
    env = {"PYTEST_XDIST_WORKER": "gw0", "PATH": "/usr/bin:/bin"}
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=env, timeout=30, cwd=str(pathlib.Path(__file__).parents[2]))
            for _ in range(2)]
    assert [r.stdout.strip() for r in runs] == ["{'n': 7}"] * 2, [r.stderr for r in runs]
    assert count.read_text() == "x"
    (pathlib.Path(tempfile.gettempdir()) / f"hora-tests-{os.getpid()}"
     / "step-under-test.lock").unlink()


def test_a_wait_for_a_held_lock_ends_with_a_timeout_error():
    with workers.alone(exclusive=True, lock=LOCK, quiet_s=0):     # (the lock, not the CPUs)
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=r"under-test\.lock .* after 0\.3 s"):
            with workers.alone(exclusive=False, lock=LOCK, wait_s=0.3):
                pass
        assert 0.3 <= time.monotonic() - start < 5


@pytest.mark.timeout(30)
def test_quiet_waits_while_the_cpus_are_busy_and_no_longer_than_its_bound():
    import multiprocessing
    idle_now = workers.quiet(idle=0.0, within_s=0.0)        # one window, never waits
    assert 0.0 <= idle_now <= 1.0
    spinners = [multiprocessing.Process(target=_spin, args=(3.0,)) for _ in range(os.cpu_count())]
    for p in spinners:
        p.start()
    try:
        start = time.monotonic()
        share = workers.quiet(idle=0.9, within_s=1.0)       # busy: gives up at its bound
        took = time.monotonic() - start
        assert share < 0.9 and 1.0 <= took < 2.5, (share, took)
    finally:
        for p in spinners:
            p.terminate()
            p.join(5)


def _spin(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass
