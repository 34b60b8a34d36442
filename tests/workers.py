"""What the suite's pytest processes share when pytest-xdist runs it on several workers.

The suite runs on as many workers as the machine has CPUs (``-n logical`` in pyproject.toml):
most of its time is spent waiting (for ranks to start, for a timeout to pass, for a killed
rank to be noticed), and a second worker runs another test meanwhile.  Workers take whole
files (``--dist loadfile``), so a module's cached job runs once.  Three things need every
worker to agree, and live here:

- :func:`alone`: a test marked ``alone`` measures time (how soon a rank's post arrives, how
  fast a call is) and runs while no other test runs.  Every test holds a shared lock on one
  file while it runs; an ``alone`` test holds it exclusively, so it waits for the other
  workers' running tests to end and they wait for it.
- :func:`once`: a step the whole session does once (installing sshd for the multi-host tests),
  however many workers reach it; the first does it, the others wait for it and reuse its
  result.
- :func:`note` and :func:`notes`: lines a worker leaves for the session's summary, which only
  the process that prints it (the controller, under xdist) writes out.

Without xdist the same code runs in the one process: the lock is never contended.
"""
import contextlib
import fcntl
import json
import os
import pathlib
import tempfile
import time

WORKER_ENV = "PYTEST_XDIST_WORKER"
# the longest a process waits for a lock: past every holder's own bound (the longest test
# timeout is 355 s, the sshd install's 240 s), so a wait this long means a holder is stuck
LOCK_WAIT_S = 900.0
_LOCK_POLL_S = 0.05
QUIET_WAIT_S = 20.0     # an alone test waits at most this long for the CPUs to go quiet


def _session_dir():
    """A folder of this session's, the same for the controller and its workers.

    xdist's workers are the controller's children; without xdist the one process is the
    session.  The folder outlives the session in the temporary directory (a few bytes)."""
    owner = os.getppid() if os.environ.get(WORKER_ENV) else os.getpid()
    path = pathlib.Path(tempfile.gettempdir()) / f"hora-tests-{owner}"
    path.mkdir(exist_ok=True)
    return path


@contextlib.contextmanager
def _locked(name, exclusive, wait_s=LOCK_WAIT_S):
    """Hold the session's lock ``name``; TimeoutError after ``wait_s`` without it."""
    deadline = time.monotonic() + wait_s
    with open(_session_dir() / name, "a+") as f:
        while True:
            try:
                fcntl.flock(f, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no {name} in the session's {_session_dir()} after "
                                       f"{wait_s:g} s: a process of the session holds it") \
                        from None
                time.sleep(_LOCK_POLL_S)
        try:
            yield f
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def alone(exclusive, lock="running", wait_s=LOCK_WAIT_S, quiet_s=QUIET_WAIT_S):
    """Hold the session's test lock: exclusively for an ``alone`` test, shared otherwise.
    (``lock`` names another: tests/unit/test_workers.py runs inside the session's.)  An
    ``alone`` test also waits, at most ``quiet_s``, for the CPUs to go quiet: processes of
    earlier tests may still be ending (a JVM, Ray's daemons, a launcher's teardown)."""
    with _locked(f"{lock}.lock", exclusive, wait_s):
        if exclusive and quiet_s > 0:
            quiet(within_s=quiet_s)
        yield


def quiet(idle=0.75, window_s=0.25, within_s=QUIET_WAIT_S):
    """Wait until the machine's CPUs were at least ``idle`` idle for ``window_s``, or
    ``within_s`` passed (then go on: a busy machine is not an error).  Returns the idle
    fraction of the last window."""
    def times():
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        return fields[3] + fields[4], sum(fields)      # idle + iowait, all
    deadline = time.monotonic() + within_s
    while True:
        idle0, all0 = times()
        time.sleep(window_s)
        idle1, all1 = times()
        share = (idle1 - idle0) / max(1, all1 - all0)
        if share >= idle or time.monotonic() >= deadline:
            return share


def once(name, step):
    """``step()``'s result (JSON), computed by the first process of the session to ask."""
    with _locked(f"{name}.lock", exclusive=True) as f:
        f.seek(0)
        done = f.read()
        if done:
            return json.loads(done)
        result = step()
        f.write(json.dumps(result))
        f.flush()
        return result


def note(name, line):
    """Leave ``line`` for the session summary, under ``name`` (the last one left wins)."""
    (_session_dir() / f"{name}.note").write_text(line)


def notes(name):
    """The line left under ``name`` by any process of the session, or None."""
    path = _session_dir() / f"{name}.note"
    return path.read_text() if path.exists() else None


def start_session():
    """Empty the session's folder (a process id is used again, some day), before any worker
    starts: called by the controller, or by the one process without xdist."""
    for path in _session_dir().iterdir():
        path.unlink()
