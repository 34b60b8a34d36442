"""hora.ray.RayExecutor on a real local Ray: collectives checked against numpy and against
hora.run, a two-node cluster on loopback (``ray start``), a worker killed mid-run, and the
Ray Tune example.

Ray is kept small: the machine's CPUs, a 100 MB object store, no dashboard.  The workers
find this checkout through the ``PYTHONPATH`` of Ray's runtime environment.
"""
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

import hora
from hora.errors import WorkerFailedError
from tests.helpers import pid_alive

ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'ray[tune]')")

from hora.ray import RayExecutor  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OBJECT_STORE = 100 * 2**20
RUNTIME_ENV = {"env_vars": {"PYTHONPATH": os.pathsep.join(
    filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}}
# a cluster of `ray start` nodes: its own token-authenticated control plane, on loopback
CLUSTER_ENV = {"RAY_AUTH_MODE": "token", "PYTHONPATH": RUNTIME_ENV["env_vars"]["PYTHONPATH"]}


@pytest.fixture
def local_ray():
    """A local Ray instance, shared by the tests that use it (started again after a test
    that needed another cluster)."""
    if not ray.is_initialized():
        ray.init(num_cpus=os.cpu_count(), object_store_memory=OBJECT_STORE,
                 include_dashboard=False, runtime_env=RUNTIME_ENV)
    yield


@pytest.fixture(scope="module", autouse=True)
def _stop_ray():
    yield
    if ray.is_initialized():
        ray.shutdown()


def _inputs(rank):
    return np.arange(6, dtype=np.float64).reshape(3, 2) * (rank + 1) + 0.5 * rank


def _collectives():
    """What every worker computes: its inputs, a sum, an average and a ragged allgather."""
    from hora.core import state
    hora.init()
    rank = hora.rank()
    x = _inputs(rank)
    out = {"rank": rank, "size": hora.size(), "local_rank": hora.local_rank(),
           "local_size": hora.local_size(), "cross_size": hora.cross_size(),
           "host": os.environ["HORA_HOSTNAME"], "pid": os.getpid(), "x": x,
           "sum": hora.allreduce(x, op=hora.Sum, name="sum"),
           "avg": hora.allreduce(x, name="avg"),
           "gather": hora.allgather(x[:rank + 1], name="gather"),
           "plane": type(state.engine()._plane).__name__}
    hora.shutdown()
    return out


def _check_against_numpy(results):
    xs = [r["x"] for r in results]
    for rank, r in enumerate(results):
        assert r["rank"] == rank and r["size"] == len(results)
        np.testing.assert_array_equal(r["sum"], np.sum(xs, axis=0))
        np.testing.assert_allclose(r["avg"], np.mean(xs, axis=0), rtol=1e-12)
        np.testing.assert_array_equal(
            r["gather"], np.concatenate([x[:i + 1] for i, x in enumerate(xs)]))


@pytest.mark.timeout(120)
def test_two_workers_match_numpy_and_hora_run(local_ray):
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=30), num_workers=2)
    executor.start()
    try:
        results = executor.run(_collectives)
        again = executor.run(_collectives)           # the same actors join a second job
        ranks = executor.execute(lambda _: int(os.environ["HORA_RANK"]))
        refs = executor.run_remote(lambda a, b: a + b, args=[1], kwargs={"b": 2})
        assert ray.get(refs, timeout=30) == [3, 3]
        seen = []
        for tag in ("first", "second"):        # each call hands on its own reports only
            executor.run(_reports, args=[tag], callbacks=[seen.append])
            assert seen == [{"tag": tag, "rank": 0, "n": 0}, {"tag": tag, "rank": 0, "n": 1}]
            seen.clear()
    finally:
        executor.shutdown()
    _check_against_numpy(results)
    # one node: both ranks local, so the shared-memory plane is theirs
    assert [(r["local_rank"], r["local_size"], r["plane"]) for r in results] == \
        [(0, 2, "ShmGroup"), (1, 2, "ShmGroup")]
    assert ranks == [0, 1]
    assert len({r["pid"] for r in results}) == 2
    reference = hora.run(_collectives, np=2, timeout_s=60)
    for key in ("x", "sum", "avg", "gather"):
        for ours, theirs, second in zip(results, reference, again):
            np.testing.assert_array_equal(ours[key], theirs[key])
            np.testing.assert_array_equal(second[key], theirs[key])


def _reports(tag):
    from hora.ray import report
    hora.init()
    for n in range(2):
        report({"tag": tag, "rank": hora.rank(), "n": n})      # rank 0's reach the driver


@pytest.mark.timeout(30)
def test_arguments_are_checked():
    settings = RayExecutor.create_settings(timeout_s=5)
    with pytest.raises(ValueError, match="num_workers or num_hosts"):
        RayExecutor(settings)
    with pytest.raises(ValueError, match="num_workers or num_hosts"):
        RayExecutor(settings, num_workers=2, num_hosts=2)
    with pytest.raises(ValueError, match="positive integer, got 0"):
        RayExecutor(settings, num_workers=0)
    with pytest.raises(NotImplementedError, match="min_workers"):
        RayExecutor(settings, min_workers=1, max_workers=2)
    with pytest.raises(hora.HoraError, match="not started"):
        RayExecutor(settings, num_workers=1).run(len)


def _collective_loop(seconds):
    """Allreduce until ``seconds`` pass (a rank is killed meanwhile); rank 0 reports once
    the first allreduce is done, when every rank is in the loop."""
    from hora.ray import report
    hora.init()
    end, reported = time.monotonic() + seconds, False
    while time.monotonic() < end:
        hora.allreduce(np.ones(1000), name="loop")
        if not reported:
            report("looping")           # rank 0's reaches the driver; the others' do nothing
            reported = True
    return "finished"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["os.kill", "ray.kill"])
def test_killed_worker_names_its_rank(local_ray, how):
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=30, grace_s=5),
                           num_workers=2)
    executor.start()
    try:
        pids = executor.execute(lambda _: os.getpid())
        victim = executor.workers[1]
        kill = (lambda: os.kill(pids[1], signal.SIGKILL)) if how == "os.kill" else \
            (lambda: ray.kill(victim.actor, no_restart=True))
        killed = []

        def kill_once_looping(value):   # the driver's callback: both ranks are in the loop
            if value == "looping" and not killed:
                killed.append(value)
                kill()
        started = time.monotonic()
        with pytest.raises(WorkerFailedError) as info:
            executor.run(_collective_loop, args=[60], callbacks=[kill_once_looping])
        took = time.monotonic() - started
        assert killed, "rank 0 never reported that the loop had started"
        assert info.value.rank == 1, str(info.value)
        assert info.value.host == victim.host
        assert "rank 1" in str(info.value) and "died" in str(info.value)
        assert took < 20, f"the failure took {took:.1f} s to surface"
        with pytest.raises(hora.HoraError, match="lost workers"):
            executor.run(_collective_loop, args=[1])
    finally:
        executor.shutdown()


def _raises_on_rank_1():
    hora.init()
    if hora.rank() == 1:
        raise ValueError("bad value on rank 1")
    return hora.rank()


@pytest.mark.timeout(60)
def test_raised_error_names_its_rank(local_ray):
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=30, grace_s=3),
                           num_workers=2)
    executor.start()
    try:
        with pytest.raises(WorkerFailedError, match="bad value on rank 1") as info:
            executor.run(_raises_on_rank_1)
        assert info.value.rank == 1
    finally:
        executor.shutdown()


def _ray(*args, timeout=60):
    return subprocess.run([os.path.join(os.path.dirname(sys.executable), "ray"), *args],
                          env={**os.environ, **CLUSTER_ENV}, capture_output=True, text=True,
                          timeout=timeout)


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cluster_processes(temp_dir, port):
    """The processes of the nodes ``ray start`` left with ``--temp-dir temp_dir`` and GCS
    port ``port``, and every process below them (Linux: read from /proc): those whose
    command line names the folder (GCS, raylets, their monitors) or connects to the GCS
    (Ray's client server), then their children (workers and agents, which retitle
    themselves ``ray::...``), and theirs."""
    children, found = {}, []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        pid = int(entry)
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline") as f:
                argv = f.read().split("\0")
        except OSError:
            continue
        children.setdefault(ppid, []).append(pid)
        if pid != os.getpid() and any(
                temp_dir in a or (a.startswith("--address=") and a.endswith(f":{port}"))
                for a in argv):
            found.append(pid)
    todo = list(found)
    while todo:
        below = children.get(todo.pop(), [])
        found.extend(below)
        todo.extend(below)
    return found


def _stop_nodes(temp_dir, port):
    """SIGKILL :func:`_cluster_processes`; return those still alive 10 s later (a zombie
    counts as ended).  Not ``ray stop``: that stops every Ray process on the machine
    (another test's Ray as well), and waits in each of its three stages until the killed
    processes, orphans, have been reaped by init (seconds, on some machines)."""
    pids = _cluster_processes(temp_dir, port)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if pid_alive(p)]


@pytest.mark.timeout(180)
def test_two_node_cluster_on_loopback(monkeypatch):
    if ray.is_initialized():
        ray.shutdown()
    port = _free_port()
    # the nodes' own temporary folder names their processes (short: Ray's sockets live there)
    temp_dir = tempfile.mkdtemp(prefix="hora-ray-")
    node = ["--node-ip-address", "127.0.0.1", "--num-cpus", "1",
            "--object-store-memory", str(OBJECT_STORE), "--temp-dir", temp_dir]
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    try:
        head = _ray("start", "--head", "--port", str(port), "--include-dashboard=false", *node)
        assert head.returncode == 0, head.stdout + head.stderr
        second = _ray("start", "--address", f"127.0.0.1:{port}", *node)
        assert second.returncode == 0, second.stdout + second.stderr
        ray.init(address=f"127.0.0.1:{port}", runtime_env=RUNTIME_ENV)
        assert len([n for n in ray.nodes() if n["Alive"]]) == 2
        executor = RayExecutor(RayExecutor.create_settings(timeout_s=30,
                                                           placement_group_timeout_s=60),
                               num_hosts=2, num_workers_per_host=1)
        executor.start()
        try:
            nodes = [w.node_id for w in executor.workers]
            results = executor.run(_collectives)
        finally:
            executor.shutdown()
        assert len(set(nodes)) == 2, nodes
        _check_against_numpy(results)
        assert [(r["local_rank"], r["local_size"], r["cross_size"]) for r in results] == \
            [(0, 1, 2), (0, 1, 2)]
        assert [r["plane"] for r in results] == ["NoneType", "NoneType"]    # the tcp ring
        assert results[0]["host"] != results[1]["host"]
    finally:
        if ray.is_initialized():
            ray.shutdown()
        left = _stop_nodes(temp_dir, port)
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert left == [], f"the nodes' processes {left} outlived SIGKILL by 10 s"


@pytest.mark.timeout(150)
def test_tune_example_searches_the_learning_rate(tmp_path):
    """The slowest test here (~40 s): two trials of two workers, two epochs each."""
    pytest.importorskip("ray.tune", reason="ray[tune] is not installed")
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    if ray.is_initialized():
        ray.shutdown()            # the example starts its own Ray
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "ray_tune_digits.py"),
         "--lrs", "0.02", "0.1", "--epochs", "2", "--workers", "2", "--num-cpus", "2",
         "--storage", str(tmp_path)],
        capture_output=True, text=True, timeout=140, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("lr ")]
    assert len(lines) == 2 and all("test acc" in line for line in lines), proc.stdout
    best = [line for line in proc.stdout.splitlines() if line.startswith("best lr")]
    assert best and float(best[0].rsplit(" ", 1)[1]) > 0.7, proc.stdout
