"""hora.ray.ElasticRayExecutor on a real local Ray: a worker killed mid-training (SIGKILL of
its process, or ray.kill from the driver), a job that grows when discovery reports a slot
more, a killed worker replaced after its node's cooldown, and the ways a run fails (below
min_num_proc, past reset_limit, every worker raising).

Every job that finishes trains tests/elastic_main.py's model (``elastic_main.run_worker`` in
each actor): with a fixed global batch, the final weights equal one process training on the
same batches (``elastic_main.reference_weights``) however the workers come and go, and each
epoch's committed samples are the dataset once.  The jobs that must fail (below min_num_proc,
past reset_limit) run an elastic loop on hora alone (tests/multiproc/elastic_fail_job.py),
without importing torch into their actors.

One Ray instance serves the module: 4 logical CPUs (the actors mostly wait on each other),
a 100 MB object store, no dashboard, workers at normal priority; the actors find this
checkout through the ``PYTHONPATH`` of Ray's runtime environment.
"""
import os
import time

import pytest

from hora.errors import ElasticJobError, ElasticTimeoutError, HoraError, WorkerFailedError
from tests import elastic_main
from tests.helpers import pid_alive
from tests.multiproc import elastic_fail_job

ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'ray[tune]')")
pytest.importorskip("torch")

from hora.ray import ElasticRayExecutor, RayHostDiscovery  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUNTIME_ENV = {"env_vars": {"PYTHONPATH": os.pathsep.join(
    filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}}
STEPS = elastic_main.SAMPLES // elastic_main.GLOBAL_BATCH      # steps per epoch


@pytest.fixture(scope="module")
def cluster():
    if ray.is_initialized():
        ray.shutdown()
    # worker_niceness 0: Ray starts its workers at nice 15, where any other load on the
    # machine (a benchmark) starves them and the job's start-up takes minutes, not seconds
    ray.init(num_cpus=4, object_store_memory=100 * 2**20, include_dashboard=False,
             runtime_env=RUNTIME_ENV, _system_config={"worker_niceness": 0})
    yield
    ray.shutdown()


def _train(executor, **run_args):
    """Start ``executor``, run elastic_main's training on it, shut it down; the results."""
    executor.start()
    try:
        return executor.run(elastic_main.run_worker, timeout_s=80, **run_args)
    finally:
        executor.shutdown()


@pytest.fixture(scope="module")
def reference():
    return elastic_main.reference_weights()


def _left_alive(executor, within=15.0):
    """The pids of the executor's actors still alive after ``within`` seconds."""
    pids = [w.pid for w in executor.workers if w.pid is not None]
    assert len(pids) == len(executor.workers), "an actor never reported its pid"
    deadline = time.monotonic() + within
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [p for p in pids if pid_alive(p)]


def _check(results, reference, size):
    """Every final rank's report: its rank, equal weights, the reference's training."""
    assert [r["rank"] for r in results] == list(range(size))
    assert all(r["final_size"] == size for r in results)
    for r in results[1:]:
        assert r["weights"] == results[0]["weights"]
    elastic_main.check_training(results[0], reference)
    elastic_main.check_kept_pids(results[0])


@pytest.mark.timeout(90)
def test_killed_worker_leaves_and_the_others_finish(cluster, reference):
    """Three workers on Ray's own discovery (one node, 4 CPUs, max_num_proc 3); rank 1
    SIGKILLs its own process at epoch 1 batch 3; the two others restore the commit of batch
    2 and finish in the same processes."""
    settings = ElasticRayExecutor.create_settings(min_num_proc=2, max_num_proc=3,
                                                  elastic_timeout=30, timeout_s=30)
    executor = ElasticRayExecutor(settings, cpus_per_slot=1,
                                  env_vars={"ELASTIC_KILL": "1:1:3"})
    results = _train(executor)
    _check(results, reference, 2)
    assert results[0]["sizes"] == [3] * (STEPS + 2) + [2] * (2 * STEPS - 2)
    assert results[0]["round"] == 1
    assert [len(entries) for entries in results[0]["pids"]] == [2, 2]      # both rounds
    assert [(r["change"], len(r["members"])) for r in executor.rounds] == \
        [("start", 3), ("removed", 2)]
    victim = executor.workers[1]
    assert victim.state == "failed" and isinstance(victim.error, ray.exceptions.RayActorError)
    assert [w.state for w in executor.workers] == ["done", "failed", "done"]
    assert _left_alive(executor) == []


@pytest.mark.timeout(90)
def test_worker_killed_by_ray_kill_from_a_callback(cluster, reference):
    """The driver's callback gets rank 0's reports and ray.kills rank 1's actor at epoch 0
    batch 4; every rank holds at epoch 1 batch 0 until the job has re-formed at 2."""
    settings = ElasticRayExecutor.create_settings(min_num_proc=2, max_num_proc=3,
                                                  elastic_timeout=30, timeout_s=30)
    executor = ElasticRayExecutor(settings, env_vars={"ELASTIC_REPORT": "1",
                                                      "ELASTIC_HOLD": "1:0:2"})
    seen, killed = [], []

    def kill_rank_1(value):
        seen.append(value)
        if (value["epoch"], value["batch"]) == (0, 4) and not killed:
            victim = next(w for w in executor.workers if w.rank == 1)
            killed.append(victim.wid)
            ray.kill(victim.actor, no_restart=True)

    results = _train(executor, callbacks=[kill_rank_1])
    _check(results, reference, 2)
    assert killed and executor.workers[killed[0]].state == "failed"
    sizes = results[0]["sizes"]
    assert sizes[:4] == [3] * 4 and set(sizes[STEPS:]) == {2}, sizes
    # rank 0's reports reached the callback in order, whichever actor was rank 0
    steps = [(v["epoch"], v["batch"]) for v in seen]
    assert steps[:5] == [(0, b) for b in range(5)] and steps[-1] == (2, STEPS - 1)
    assert _left_alive(executor) == []


class FileDiscovery:
    """Horovod's discovery interface over a file of ``host:slots`` lines (which the training
    rewrites): what a test passes as ``settings.discovery`` with ``override_discovery=False``."""

    def __init__(self, path):
        self.path = path

    def find_available_hosts_and_slots(self):
        hosts = {}
        for line in self.path.read_text().split():
            host, slots = line.split(":")
            hosts[host] = int(slots)
        return hosts


@pytest.mark.timeout(90)
def test_job_grows_when_discovery_reports_another_slot(cluster, reference, tmp_path):
    """Discovery lists ``host-a:2`` (a logical host: no Ray node has that name); at epoch 0
    batch 2 rank 0 adds ``host-b:1``; the new actor joins at a commit (every rank holds at
    epoch 1 batch 0 until it has) and the job ends at 3, the first two in their processes."""
    hosts = tmp_path / "hosts"
    hosts.write_text("host-a:2\n")
    settings = ElasticRayExecutor.create_settings(min_num_proc=2, max_num_proc=3,
                                                  elastic_timeout=30, timeout_s=30)
    settings.discovery = FileDiscovery(hosts)
    executor = ElasticRayExecutor(
        settings, override_discovery=False,
        env_vars={"ELASTIC_GROW": f"0:2:{hosts}:host-a:2\\nhost-b:1\\n",
                  "ELASTIC_HOLD": "1:0:3"})
    results = _train(executor)
    _check(results, reference, 3)
    sizes = results[0]["sizes"]
    assert sizes[0] == 2 and sizes[-1] == 3 and sorted(sizes) == sizes, sizes
    assert [(r["change"], len(r["members"])) for r in executor.rounds] == \
        [("start", 2), ("added", 3)]
    assert [m[1] for m in executor.rounds[-1]["members"]] == ["host-a", "host-a", "host-b"]
    assert sorted(len(entries) for entries in results[0]["pids"]) == [1, 2, 2]
    assert _left_alive(executor) == []


@pytest.mark.timeout(60)
def test_below_min_num_proc_fails_within_the_elastic_timeout(cluster):
    """Two workers, min_num_proc 2: rank 1 dies, its node is kept out for the rest of the run
    (no cooldown_range), and 1 s later the run fails, naming the shortfall."""
    settings = ElasticRayExecutor.create_settings(min_num_proc=2, max_num_proc=2,
                                                  elastic_timeout=1, timeout_s=30)
    executor = ElasticRayExecutor(settings)
    executor.start()
    started = time.monotonic()
    try:
        with pytest.raises(ElasticTimeoutError) as info:
            executor.run(elastic_fail_job.dies_at_batch_3, timeout_s=50)
    finally:
        executor.shutdown()
    took = time.monotonic() - started
    message = str(info.value)
    assert "the elastic job has 1 worker(s), fewer than min_num_proc 2" in message
    assert "within 1 s (elastic_timeout)" in message and "worker 1 (rank 1" in message
    assert (info.value.workers, info.value.min_workers) == (1, 2)
    assert took < 40, f"the failure took {took:.1f} s"
    assert _left_alive(executor) == []


@pytest.mark.timeout(60)
def test_start_waits_for_min_num_proc_slots_then_fails(cluster):
    settings = ElasticRayExecutor.create_settings(min_num_proc=5, elastic_timeout=0.5)
    executor = ElasticRayExecutor(settings, cpus_per_slot=1)    # the node has 4 CPUs
    started = time.monotonic()
    with pytest.raises(ElasticTimeoutError, match="reports 4 slot.*fewer than min_num_proc 5"):
        executor.start()
    assert time.monotonic() - started < 10


def test_discovery_counts_slots_by_cpus_and_gpus(monkeypatch):
    nodes = [{"Alive": True, "NodeID": f"{i:02x}" * 28, "NodeManagerAddress": f"10.0.0.{i}",
              "Resources": {"CPU": 8.0, **({"GPU": 2.0} if i < 2 else {})}} for i in range(3)]
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    assert RayHostDiscovery(cpus_per_slot=3).find_available_hosts_and_slots() == \
        {"10.0.0.0": 2, "10.0.0.1": 2, "10.0.0.2": 2}
    assert RayHostDiscovery(use_gpu=True).find_available_hosts_and_slots() == \
        {"10.0.0.0": 2, "10.0.0.1": 2}
    assert RayHostDiscovery(use_gpu=True, gpus_per_slot=2).find_available_hosts_and_slots() \
        == {"10.0.0.0": 1, "10.0.0.1": 1}
    nodes[1]["NodeManagerAddress"] = "10.0.0.0"            # two nodes on one machine
    nodes[2]["Alive"] = False
    assert sorted(RayHostDiscovery().find_available_hosts_and_slots()) == \
        ["10.0.0.0-00000000", "10.0.0.0-01010101"]


def test_arguments_are_checked():
    create = ElasticRayExecutor.create_settings
    with pytest.raises(ValueError, match="max_num_proc 1 is less than min_num_proc 2"):
        create(min_num_proc=2, max_num_proc=1)
    with pytest.raises(ValueError, match="min_num_proc must be an integer >= 1"):
        create(min_num_proc=0)
    with pytest.raises(ValueError, match="cooldown_range"):
        create(cooldown_range=(5, 1))
    with pytest.raises(TypeError, match="unknown setting 'bogus'"):
        create(bogus=1)
    with pytest.warns(DeprecationWarning, match="min_num_proc"):
        assert create(min_np=3).min_num_proc == 3
    with pytest.raises(ValueError, match="use_gpu is False"):
        ElasticRayExecutor(create(), gpus_per_slot=1)
    with pytest.raises(HoraError, match="not started"):
        ElasticRayExecutor(create()).run(len)
    settings = create(min_num_proc=2, cooldown_range=(1, 4), nics="eth0", verbose=2)
    assert (settings.num_proc, settings.cooldown_range, settings.nics) == \
        (2, (1, 4), frozenset({"eth0"}))
    ElasticRayExecutor(settings, override_discovery=False)     # keeps the caller's (None)
    assert settings.discovery is None
    ElasticRayExecutor(settings, use_gpu=True, cpus_per_slot=2)
    assert isinstance(settings.discovery, RayHostDiscovery)
    assert (settings.discovery.use_gpu, settings.discovery.cpus_per_slot,
            settings.discovery.gpus_per_slot) == (True, 2, 1)


@pytest.mark.timeout(90)
def test_killed_worker_is_replaced_after_the_cooldown(cluster, reference):
    """cooldown_range (1, 1): rank 1 dies at epoch 0 batch 3, its node is out for 1 s, then a
    new actor starts there and joins (every rank holds at epoch 1 batch 2 until it has)."""
    settings = ElasticRayExecutor.create_settings(min_num_proc=2, max_num_proc=3,
                                                  elastic_timeout=30, timeout_s=30,
                                                  cooldown_range=(1, 1))
    executor = ElasticRayExecutor(settings, env_vars={"ELASTIC_KILL": "1:0:3",
                                                      "ELASTIC_HOLD": "1:2:3"})
    results = _train(executor)
    _check(results, reference, 3)
    sizes = results[0]["sizes"]
    first2 = sizes.index(2)
    assert set(sizes[:first2]) == {3} and 3 in sizes[first2:], sizes
    assert [(r["change"], len(r["members"])) for r in executor.rounds] == \
        [("start", 3), ("removed", 2), ("added", 3)]
    assert [w.state for w in executor.workers] == ["done", "failed", "done", "done"]
    assert _left_alive(executor) == []


@pytest.mark.timeout(60)
def test_reset_limit_stops_the_job(cluster):
    settings = ElasticRayExecutor.create_settings(min_num_proc=1, max_num_proc=2,
                                                  reset_limit=0, timeout_s=30)
    executor = ElasticRayExecutor(settings)
    executor.start()
    try:
        with pytest.raises(ElasticJobError, match="re-formed 1 times, more than reset_limit 0"):
            executor.run(elastic_fail_job.dies_at_batch_3, timeout_s=50)
    finally:
        executor.shutdown()
    assert [r["change"] for r in executor.rounds] == ["start"]
    assert _left_alive(executor) == []


def _raises():
    import hora
    hora.init()
    raise ValueError(f"bad value on rank {hora.rank()}")


@pytest.mark.timeout(60)
def test_every_worker_raising_fails_the_run_with_the_first_error(cluster):
    settings = ElasticRayExecutor.create_settings(min_num_proc=1, max_num_proc=2, timeout_s=30)
    executor = ElasticRayExecutor(settings)
    executor.start()
    started = time.monotonic()
    try:
        with pytest.raises(WorkerFailedError, match="every worker has failed") as info:
            executor.run(_raises, timeout_s=50)
    finally:
        executor.shutdown()
    assert f"bad value on rank {info.value.rank}" in str(info.value)
    assert "raised" in str(info.value) and info.value.host == executor.workers[0].host
    assert time.monotonic() - started < 30
    assert _left_alive(executor) == []
