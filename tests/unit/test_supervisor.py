"""The runner's one supervisor (:mod:`hora.runner.supervisor`) and its worker contract
(:mod:`hora.runner.contract`), with small real processes: how a set ends, and that every
teardown is bounded."""
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from hora.runner.contract import forwarded, job_env, torchrun_env, worker_env
from hora.runner.hosts import SlotInfo
from hora.runner.supervisor import Ending, Supervisor, Worker, WorkerState

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not sys.platform.startswith("linux"),
                                 reason="process groups and /proc are Linux's")]

_SLEEP = "import time; time.sleep(30)"
# a worker that ignores SIGTERM: only SIGKILL ends it
_STUBBORN = ("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
             "print('ready', flush=True); time.sleep(30)")


def _spawn(sup, rank, code, env=None):
    return sup.spawn(rank, "localhost", [sys.executable, "-c", code], env or dict(os.environ))


def test_every_worker_succeeds():
    with Supervisor() as sup:
        for rank in range(3):
            _spawn(sup, rank, "pass")
        outcome = sup.wait(timeout_s=30)
    assert (outcome.ending, outcome.exitcode, outcome.failure) == (Ending.SUCCEEDED, 0, None)
    assert [e.state for e in outcome.exits] == [WorkerState.SUCCEEDED] * 3


def test_first_failure_stops_the_others_and_names_the_rank():
    with Supervisor(grace_s=1.0) as sup:
        _spawn(sup, 0, _SLEEP)
        _spawn(sup, 1, "import sys, time; time.sleep(0.2); sys.exit(3)")
        start = time.monotonic()
        outcome = sup.wait()
    assert time.monotonic() - start < 5
    assert (outcome.ending, outcome.exitcode) == (Ending.FAILED, 3)
    assert outcome.failure.rank == 1
    assert outcome.failure.describe().startswith("rank 1 (pid ")
    assert outcome.exits[0].state is WorkerState.STOPPED


def test_a_worker_that_ignores_sigterm_is_killed_after_the_grace():
    with Supervisor(grace_s=0.5) as sup:
        stubborn = sup.spawn(0, "localhost", [sys.executable, "-c", _STUBBORN],
                             dict(os.environ))
        assert stubborn.popen.stdout.readline() == b"ready\n"
        start = time.monotonic()
        sup.stop(signal.SIGTERM)
        took = time.monotonic() - start
    assert 0.4 < took < 5, took
    assert stubborn.popen.returncode == -signal.SIGKILL


def test_at_the_deadline_the_workers_are_left_to_the_caller():
    with Supervisor(grace_s=1.0) as sup:
        worker = _spawn(sup, 0, _SLEEP)
        outcome = sup.wait(timeout_s=0.3)
        assert (outcome.ending, outcome.exitcode) == (Ending.TIMED_OUT, 124)
        assert outcome.hung == [worker] and worker.popen.poll() is None
    assert worker.popen.returncode is not None        # close() stopped it


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_to_this_process_is_forwarded(sig):
    before = signal.signal(sig, signal.SIG_DFL)       # not ignored, even under nohup
    try:
        with Supervisor(grace_s=1.0) as sup:
            worker = _spawn(sup, 0, _SLEEP)
            threading.Timer(0.3, os.kill, (os.getpid(), sig)).start()
            outcome = sup.wait(timeout_s=20)
    finally:
        signal.signal(sig, before)
    assert (outcome.ending, outcome.exitcode, outcome.signal) == (
        Ending.INTERRUPTED, 128 + sig, sig)
    assert worker.popen.returncode == -sig


def test_ignored_sighup_stays_ignored_and_handlers_are_restored():
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)       # as under nohup
    try:
        term = signal.getsignal(signal.SIGTERM)
        with Supervisor():
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) != term
        assert signal.getsignal(signal.SIGTERM) == term
    finally:
        signal.signal(signal.SIGHUP, before)


def test_a_relay_carries_every_signal_but_sigkill():
    relayed = []
    with Supervisor(grace_s=0.3) as sup:
        popen = subprocess.Popen([sys.executable, "-c", _SLEEP], start_new_session=True,
                                 stdin=subprocess.DEVNULL)
        sup.add(Worker(0, "localhost", popen, relay=lambda s: relayed.append(s) or True,
                       name="leader"))
        sup.stop(signal.SIGTERM)          # relayed only: the process lives on, then is killed
    assert relayed == [signal.SIGTERM]
    assert popen.returncode == -signal.SIGKILL


# -- the worker contract ---------------------------------------------------------------------
def test_job_env_puts_the_options_over_the_users_variables():
    env = job_env({"A": "1", "HORA_IFACE": "eth0"}, {"A": "2", "HORA_START_TIMEOUT": "9"},
                  network_interface="lo", start_timeout=20)
    assert env == {"A": "2", "HORA_IFACE": "lo", "HORA_START_TIMEOUT": "20.0",
                   "PYTHONUNBUFFERED": "1"}
    assert job_env({"PYTHONUNBUFFERED": "0"})["PYTHONUNBUFFERED"] == "0"


def test_worker_env_writes_hora_and_horovod_names():
    slot = SlotInfo(hostname="h", rank=2, local_rank=0, cross_rank=1, size=3, local_size=1,
                    cross_size=2)
    env = worker_env(slot, {"X": "y"}, "10.0.0.1", 4242, "s3cret", "job")
    for prefix in ("HORA_", "HOROVOD_"):
        assert [env[prefix + k] for k in ("RANK", "SIZE", "LOCAL_RANK", "CROSS_RANK",
                                          "HOSTNAME")] == ["2", "3", "0", "1", "h"]
    assert (env["HORA_RENDEZVOUS_ADDR"], env["HORA_RENDEZVOUS_PORT"], env["HORA_SECRET"],
            env["HORA_JOB_ID"], env["X"]) == ("10.0.0.1", "4242", "s3cret", "job", "y")


def test_worker_env_tells_torch_where_rank_0_serves_its_store_unless_the_job_does():
    slot = SlotInfo(hostname="h", rank=1, local_rank=1, cross_rank=0, size=2, local_size=2,
                    cross_size=1)
    env = worker_env(slot, {}, "127.0.0.1", 4242, "s", "job", ("127.0.0.1", 29611))
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", "29611")
    mine = {"MASTER_ADDR": "10.1.1.1", "MASTER_PORT": "1234"}
    assert {k: worker_env(slot, mine, "127.0.0.1", 4242, "s", "job", ("a", 1))[k]
            for k in mine} == mine
    assert "MASTER_ADDR" not in worker_env(slot, {}, "127.0.0.1", 4242, "s", "job")


def test_torchrun_env_drops_an_inherited_placement():
    env = torchrun_env({"HORA_RANK": "7", "HOROVOD_SIZE": "9", "KEEP": "1"}, 3, 4, 1, 2,
                       "algo-1", 29501, "algo-2", "s")
    assert "HORA_RANK" not in env and "HOROVOD_SIZE" not in env and env["KEEP"] == "1"
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"],
            env["MASTER_ADDR"], env["MASTER_PORT"], env["HORA_HOSTNAME"]) == (
        "3", "4", "1", "2", "algo-1", "29501", "algo-2")


def test_forwarded_leaves_this_machines_variables_behind():
    assert forwarded({"HOME": "/root", "XDG_RUNTIME_DIR": "/run", "HORA_SECRET": "s",
                      "PATH": "/bin"}) == {"HORA_SECRET": "s", "PATH": "/bin"}
