"""hora.spark.run on a real local Spark: two executor JVMs (``local-cluster[2,1,1024]``).

One SparkSession for the module (the JVMs start once, in about 20 s); each executor has one
core, so the cluster offers exactly two barrier slots.  The executors' Python is this one
(``PYSPARK_PYTHON``), which has hora installed.  Skipped when pyspark or Java is missing.
"""
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import hora
import hora.spark
from hora.errors import CollectiveTimeoutError, RendezvousTimeoutError, WorkerFailedError
from hora.integrations.spark import task_slots
from tests.helpers import pid_alive

EXECUTORS = 2
_SESSION_START_S = 180      # the JVMs on a busy 2-core machine


def _java_home():
    """JAVA_HOME, or the JDK that the ``java`` on PATH belongs to; None without Java."""
    if os.environ.get("JAVA_HOME"):
        return os.environ["JAVA_HOME"]
    java = shutil.which("java")
    if java is None:
        return None
    return os.path.dirname(os.path.dirname(os.path.realpath(java)))


@pytest.fixture(scope="module")
def spark():
    pytest.importorskip("pyspark", reason="hora.spark needs pyspark (pip install pyspark)")
    java_home = _java_home()
    if java_home is None:
        pytest.skip("hora.spark tests need Java 17+ (no java on PATH, no JAVA_HOME)")
    if not os.path.exists(os.path.join(java_home, "bin", "java")):
        pytest.skip(f"hora.spark tests need Java 17+ (JAVA_HOME={java_home} has no bin/java)")
    from pyspark import SparkContext
    from pyspark.sql import SparkSession
    with pytest.MonkeyPatch.context() as env:
        env.setenv("JAVA_HOME", java_home)
        env.setenv("PYSPARK_PYTHON", sys.executable)       # the executors' Python workers
        env.setenv("SPARK_LOCAL_IP", "127.0.0.1")          # everything on loopback
        start = time.monotonic()
        session = (SparkSession.builder.master(f"local-cluster[{EXECUTORS},1,1024]")
                   .appName("hora-test-spark")
                   .config("spark.ui.enabled", "false")
                   .config("spark.driver.host", "127.0.0.1")
                   .config("spark.driver.memory", "512m")
                   .config("spark.executor.memory", "512m")
                   .config("spark.python.worker.reuse", "true")
                   .getOrCreate())
        try:
            session.sparkContext.setLogLevel("ERROR")
            _wait_for_executors(session.sparkContext, start + _SESSION_START_S)
            print(f"\nSpark session with {EXECUTORS} executors up in "
                  f"{time.monotonic() - start:.1f} s")
            yield session
        finally:
            _stop(session, SparkContext)


def _wait_for_executors(sc, deadline):
    from hora.integrations.spark import _slots
    while (_slots(sc) or 0) < EXECUTORS:
        if time.monotonic() > deadline:
            pytest.fail(f"Spark's {EXECUTORS} executors did not register in "
                        f"{_SESSION_START_S} s")
        time.sleep(0.2)


def _stop(session, SparkContext):
    """Stop the session, its executors, and the driver's JVM (pyspark keeps it otherwise)."""
    try:
        session.stop()
    finally:
        gateway = SparkContext._gateway
        if gateway is not None:
            jvm = getattr(gateway, "proc", None)
            gateway.shutdown()
            if jvm is not None:
                if jvm.stdin is not None:
                    jvm.stdin.close()       # the gateway JVM exits when its stdin closes
                try:
                    jvm.wait(20)
                except subprocess.TimeoutExpired:
                    jvm.kill()
                    jvm.wait(10)
            SparkContext._gateway = SparkContext._jvm = None


# -- the functions the ranks run (module level: they unpickle by reference) -----------------

def _inputs(rank):
    return np.random.default_rng(rank).standard_normal(5)


def _collectives():
    hora.init()
    try:
        x = _inputs(hora.rank())
        return {"rank": hora.rank(), "size": hora.size(), "local_rank": hora.local_rank(),
                "local_size": hora.local_size(), "input": x,
                "sum": hora.allreduce(x, op=hora.Sum, name="sum"),
                "average": hora.allreduce(x, name="average"),
                "gathered": hora.allgather(x.reshape(1, -1) + hora.rank(), name="gather")}
    finally:
        hora.shutdown()


def _raise_on_rank_one():
    if os.environ["HORA_RANK"] == "1":
        raise ValueError("bad rank 1")
    hora.init()            # rank 0 waits here for rank 1, until the driver stops it
    return "unreachable"


def _only_rank_one_raises():
    if os.environ["HORA_RANK"] == "1":
        raise ValueError("bad rank 1")
    return "fine"


def _size_and_env(name):
    return int(os.environ["HORA_SIZE"]), os.environ.get(name)


def _hang():
    time.sleep(120)


def _hang_noting_pids(directory):
    with open(os.path.join(directory, os.environ["HORA_RANK"]), "w") as f:
        f.write(f"{os.getpid()} {os.getppid()}")     # the rank, and its Spark Python worker
    time.sleep(120)


# -- tests ----------------------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_allreduce_and_allgather_equal_numpy(spark):
    results = hora.spark.run(_collectives, num_proc=EXECUTORS)
    assert [r["rank"] for r in results] == list(range(EXECUTORS))
    inputs = np.stack([_inputs(rank) for rank in range(EXECUTORS)])
    for r in results:
        assert r["size"] == EXECUTORS
        # both executors run on this host: one local group of two, which is what hora run
        # would make of two ranks on localhost
        assert (r["local_rank"], r["local_size"]) == (r["rank"], EXECUTORS)
        np.testing.assert_array_equal(r["input"], inputs[r["rank"]])
        np.testing.assert_allclose(r["sum"], inputs.sum(axis=0), rtol=1e-12)
        np.testing.assert_allclose(r["average"], inputs.mean(axis=0), rtol=1e-12)
        np.testing.assert_array_equal(r["gathered"],
                                      inputs + np.arange(EXECUTORS)[:, None])


@pytest.mark.timeout(180)
def test_results_equal_those_of_hora_run(spark):
    on_spark = hora.spark.run(_collectives, num_proc=EXECUTORS)
    by_hora_run = hora.run(_collectives, np=EXECUTORS)
    assert len(on_spark) == len(by_hora_run) == EXECUTORS
    for a, b in zip(on_spark, by_hora_run):
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)


@pytest.mark.timeout(120)
def test_num_proc_defaults_to_default_parallelism_and_env_reaches_the_ranks(spark):
    assert spark.sparkContext.defaultParallelism == EXECUTORS
    results = hora.spark.run(_size_and_env, args=("HORA_TEST_TAG",),
                             env={"HORA_TEST_TAG": "spark"}, verbose=0)
    assert results == [(EXECUTORS, "spark")] * EXECUTORS


@pytest.mark.timeout(120)
def test_a_failing_rank_is_reported_with_its_traceback(spark):
    start = time.monotonic()
    with pytest.raises(WorkerFailedError) as info:
        hora.spark.run(_raise_on_rank_one, num_proc=EXECUTORS)
    error = info.value
    assert (error.rank, error.exitcode, error.host) == (1, 1, "127.0.0.1")
    assert "ValueError: bad rank 1" in error.detail
    assert "_raise_on_rank_one" in error.detail                  # the rank's own traceback
    assert "rank 1" in str(error) and "ValueError: bad rank 1" in str(error)
    # rank 0 was stopped at once, not left waiting in init() for its start timeout (30 s)
    assert time.monotonic() - start < 25
    # the same session runs the next job: nothing of the failed one is left holding slots
    assert hora.spark.run(_size_and_env, args=("X",), num_proc=EXECUTORS) == [(2, None)] * 2


@pytest.mark.timeout(60)
def test_a_failure_is_reported_when_the_other_ranks_finish_first(spark):
    with pytest.raises(WorkerFailedError) as info:
        hora.spark.run(_only_rank_one_raises, num_proc=EXECUTORS)
    assert info.value.rank == 1 and "ValueError: bad rank 1" in info.value.detail


@pytest.mark.timeout(60)
def test_more_ranks_than_slots_fails_fast_and_clearly(spark):
    start = time.monotonic()
    with pytest.raises(RendezvousTimeoutError) as info:
        hora.spark.run(_size_and_env, args=("X",), num_proc=EXECUTORS + 1, start_timeout=3)
    assert time.monotonic() - start < 15
    message = str(info.value)
    assert f"num_proc={EXECUTORS + 1}" in message
    assert f"offered {EXECUTORS} task slot(s)" in message and "barrier" in message


@pytest.mark.timeout(120)
def test_timeout_s_stops_a_hung_job(spark):
    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError) as info:
        hora.spark.run(_hang, num_proc=EXECUTORS, timeout_s=3)
    assert time.monotonic() - start < 40
    assert "timed out after 3 s" in str(info.value)
    assert "rank(s) 0, 1 were still running" in str(info.value)


@pytest.mark.timeout(120)
def test_a_killed_task_takes_its_rank_along(spark, tmp_path):
    outcome = {}

    def job():
        try:
            hora.spark.run(_hang_noting_pids, args=(str(tmp_path),), num_proc=EXECUTORS,
                           timeout_s=60)
        except Exception as e:  # noqa: BLE001 - checked below
            outcome["error"] = e

    thread = threading.Thread(target=job)
    thread.start()
    notes = [tmp_path / str(rank) for rank in range(EXECUTORS)]
    deadline = time.monotonic() + 60
    while not all(n.exists() and n.read_text() for n in notes) and time.monotonic() < deadline:
        time.sleep(0.1)
    pids = [tuple(map(int, n.read_text().split())) for n in notes]
    os.kill(pids[0][1], signal.SIGKILL)             # rank 0's Spark Python worker dies
    thread.join(60)
    assert not thread.is_alive()
    # Spark reports the stage failed before it has killed the other task; the ranks follow
    # their tasks (parent-death signal, or the task stopping its rank) within seconds
    deadline = time.monotonic() + 15
    while any(pid_alive(rank_pid) for rank_pid, _worker in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(pid_alive(rank_pid) for rank_pid, _worker in pids)
    message = str(outcome["error"])
    assert "the Spark job failed" in message and "barrier" in message, message


@pytest.mark.timeout(10)
def test_bad_arguments_are_refused_before_spark_is_asked(spark):
    with pytest.raises(ValueError, match="num_proc=0"):
        hora.spark.run(_hang, num_proc=0)
    with pytest.raises(NotImplementedError, match="use_mpi"):
        hora.spark.run(_hang, num_proc=1, use_mpi=True)


@pytest.mark.timeout(10)
def test_task_slots_group_ranks_by_host():
    slots = task_slots(["h1", "h2", "h1", "h3", "h2"])
    assert [(s.rank, s.hostname, s.local_rank, s.local_size) for s in slots] == [
        (0, "h1", 0, 2), (1, "h2", 0, 2), (2, "h1", 1, 2), (3, "h3", 0, 1), (4, "h2", 1, 2)]
    # cross ranks: hosts in order of their lowest rank, among those with that local rank
    assert [(s.cross_rank, s.cross_size) for s in slots] == [
        (0, 3), (1, 3), (0, 2), (2, 3), (1, 2)]
    assert {s.size for s in slots} == {5}


@pytest.mark.timeout(10)
def test_public_api():
    assert hora.spark.run is hora.integrations.spark.run
    assert hora.spark.__all__ == ["run"]
