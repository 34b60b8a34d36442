"""The device plane (hora.backends.nccl) on real ranks, without a GPU: its code over gloo on
CPU tensors.

With HORA_BACKEND=nccl the engine hands CUDA tensors to the plane, which fuses, reduces and
scales them where they live.  NCCL needs a GPU per rank, so CI cannot run it; but the plane
is one class for both (``TensorGroup(t, "cuda")`` over NCCL, ``TensorGroup(t, "cpu")`` over
gloo), and so is everything around it: the binding's device arrays, the request's device,
fusion, the coordinator's checks, a joined rank's zeros.  Here every rank installs the CPU
plane in place of the CUDA one before ``hora.init()``, and CPU tensors take the path CUDA
tensors take under NCCL.  The oracles are numpy on every rank's input (each rank rebuilds
them all from seeds) and one process training on the whole batch.

Each torch rank costs seconds to start, so one job per N runs every section of that N
(``job``): 2 ranks the collectives and the training, 3 ranks the collectives and the
cached, fused, scaled, integer, mismatched and joined calls (last: it joins).  Each test
checks its own section.
"""
import os
import signal
import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests.helpers import (  # noqa: E402
    RawJob, job_fixture, run_ranks, run_sections, section)
from tests.multiproc import test_torch_cuda as cuda_suite  # noqa: E402


def _on_cpu_plane(job, *args):
    """Run ``job(*args)`` in a job whose CPU tensors go through the device plane."""
    import hora
    _install_cpu_plane()
    hora.init()
    try:
        return job(*args)
    finally:
        hora.shutdown()


def _install_cpu_plane():
    from hora.backends.nccl import TensorGroup
    from hora.core import lifecycle

    def cpu_plane(settings, t, topo):
        if topo.size == 1:
            return {}
        return {"cpu": TensorGroup(t, "cpu", settings.start_timeout, settings.transport_timeout)}

    lifecycle.make_device_planes = cpu_plane


def _sections(n):
    """Every section of the ``n``-rank job (each returns its own counts of plane calls)."""
    sections = {"ops": lambda: cuda_suite._ops_job("cpu")}
    if n == 2:
        sections["training"] = lambda: cuda_suite._training_job("cpu")
        sections["torch.distributed"] = _dist_job
    else:
        sections["details"] = _details_job      # last: it joins
    return run_sections(sections)


def _run_on_cpu_plane(fn, np_, timeout_s, args, env):
    return run_ranks(_on_cpu_plane, np_, timeout_s=timeout_s, args=(fn, *args), init=False,
                     env=env)


job = job_fixture(_sections, timeout_s=80, sizes=(2, 3), runner=_run_on_cpu_plane)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("np_", [2, 3])
def test_collectives_through_the_device_plane(job, np_):
    # cuda_suite's checks on CPU tensors: every dtype, in place or not, non-contiguous,
    # grouped, autograd; alltoall, reducescatter and the dtypes the plane lacks take the
    # host path beside it
    results = section(job(np_), "ops")
    cuda_suite.check_ops(results, plane=True)
    for bad, counts in results:
        # 7 dtypes the plane has: allreduce, allreduce_, allgather, broadcast_ each; then a
        # transposed average, a grouped pair, autograd's allreduce forward and backward and
        # the allgather's backward (a grouped allreduce), and the allgather forward
        assert counts == {"allreduce": 7 * 2 + 5, "allgather": 7 + 1, "broadcast": 7}


@pytest.mark.timeout(90)
def test_training_through_the_device_plane_equals_one_process(job):
    cuda_suite.check_training(section(job(2), "training"), "cpu", plane=True)


def _dist_job():
    """torch.distributed's backend "hora" hands the tensors to the plane as hora.torch does
    (CUDA tensors under NCCL): ``(each call's result, the plane's calls)``."""
    import torch.distributed as dist
    counts = cuda_suite.count_plane_calls("cpu")
    dist.init_process_group("hora")         # hora run's MASTER_ADDR/PORT; hora is running
    r, n = dist.get_rank(), dist.get_world_size()
    got = {}
    t = torch.full((3,), float(r + 1))
    dist.all_reduce(t)
    got["all_reduce"] = t.tolist()
    t = torch.full((3,), float(r + 1))
    dist.all_reduce(t, op=dist.ReduceOp.AVG, async_op=True).wait()
    got["all_reduce AVG async"] = t.tolist()
    t = torch.full((2,), float(r))
    dist.broadcast(t, src=1)
    got["broadcast"] = t.tolist()
    outs = [torch.zeros(2) for _ in range(n)]
    dist.all_gather(outs, torch.full((2,), 10.0 + r))
    got["all_gather"] = [o.tolist() for o in outs]
    dist.destroy_process_group()
    return got, dict(counts)


@pytest.mark.timeout(90)
def test_torch_distributed_on_hora_takes_the_device_plane(job):
    for got, counts in section(job(2), "torch.distributed"):
        assert got == {"all_reduce": [3.0] * 3, "all_reduce AVG async": [1.5] * 3,
                       "broadcast": [1.0] * 2, "all_gather": [[10.0] * 2, [11.0] * 2]}, got
        # each call went to the plane (torch's own set-up calls may add more)
        assert counts["allreduce"] >= 2 and counts["broadcast"] >= 1, counts
        assert counts["allgather"] >= 1, counts


def _details_job():
    import hora
    import hora.torch as hvd
    from tests.multiproc.test_torch_cuda import count_plane_calls
    n, rank = hvd.size(), hvd.rank()
    counts = count_plane_calls("cpu")
    out = {}
    rng = [np.random.default_rng(r) for r in range(n)]
    xs = [g.standard_normal((5, 7)).astype(np.float32) for g in rng]

    # steady state: the same names every step (cached requests), async, several at a time
    # (fused into one buffer), small (no payload travels with the request), scaled
    steps = []
    for step in range(4):
        hs = [hvd.allreduce_async(torch.from_numpy(xs[rank] * (i + 1)), name=f"s.{i}",
                                  op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0)
              for i in range(3)]
        tiny = hvd.allreduce(torch.tensor([float(rank + step)]), name="tiny", op=hvd.Max)
        steps.append(([hvd.synchronize(h).numpy() for h in hs], tiny.numpy()))
    out["steps"] = steps
    out["expected_steps"] = [([sum(x * (i + 1) for x in xs) * 1.5 for i in range(3)],
                              np.array([n - 1 + step], np.float32)) for step in range(4)]

    # in place: a fused pair (one of them transposed) and a transposed tensor alone get
    # their results written back into their own memory
    a, b, c = (torch.from_numpy(xs[rank].copy()) for _ in range(3))
    b, c = b.t(), c.t()
    hvd.grouped_allreduce_([a, b], name="g_", op=hvd.Sum)
    hvd.allreduce_(c, name="t_", op=hvd.Sum)
    out["inplace"] = (a.numpy(), b.numpy(), c.numpy())

    # integers: Average and scaling truncate toward zero, as on the host path
    ints = [np.arange(-6, 6, dtype=np.int32) * (r + 2) for r in range(n)]
    got = hvd.allreduce(torch.from_numpy(ints[rank]), name="ints", op=hvd.Average,
                        postscale_factor=0.7)
    host = hora.allreduce(ints[rank], name="ints.host", op=hora.Average, postscale_factor=0.7)
    out["ints"] = (got.numpy(), host)

    # a rank that passes a numpy array where the others pass tensors: one error everywhere
    try:
        if rank == 0:
            hora.allreduce(xs[rank], name="mixed")
        else:
            hvd.allreduce(torch.from_numpy(xs[rank]), name="mixed")
        out["mixed"] = None
    except hora.CollectiveMismatchError as e:
        out["mixed"] = str(e)

    # join: rank 0 runs two more allreduces, the others contribute zeros on the device plane
    if rank == 0:
        late = [hvd.allreduce(torch.from_numpy(xs[0]), name=f"late.{i}", op=hvd.Sum).numpy()
                for i in range(2)]
        out["late"] = late
    out["last_joined"] = hvd.join()
    out["counts"] = dict(counts)
    out["xs"] = xs
    return out


@pytest.mark.timeout(90)
def test_cached_fused_scaled_small_integer_mismatched_and_joined_collectives(job):
    results = section(job(3), "details")
    for rank, out in enumerate(results):
        for (got, tiny), (exp, exp_tiny) in zip(out["steps"], out["expected_steps"]):
            for g, e in zip(got, exp):
                np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(tiny, exp_tiny)
        total = sum(results[0]["xs"])
        for got, exp in zip(out["inplace"], (total, total.T, total.T)):
            np.testing.assert_allclose(got, exp, rtol=1e-5, atol=1e-5)
        dev, host = out["ints"]
        np.testing.assert_array_equal(dev, host)
        assert dev.dtype == np.int32
        assert "Mismatched devices" in out["mixed"] and "host" in out["mixed"], out["mixed"]
        assert "rank 0: 'host'" in out["mixed"] and "cpu" in out["mixed"], out["mixed"]
        assert out["last_joined"] == 0
    for got in results[0]["late"]:
        np.testing.assert_allclose(got, results[0]["xs"][0], rtol=1e-6)
    # the steps (at least 2 a step: the 3 async ones may fuse), the in-place ones, the
    # integers and the late allreduces all ran on the plane (the joined ranks' zeros too)
    for out in results:
        assert out["counts"]["allreduce"] >= 2 * 4 + 2 + 1 + 2, out["counts"]


def _die_in_a_device_allreduce(victim):
    import hora
    import hora.torch as hvd
    _install_cpu_plane()
    hora.init()
    data = torch.ones(4 << 20)
    hvd.allreduce(data, name="warmup")
    if hvd.rank() == victim:
        def kill_soon():
            time.sleep(0.05)            # in the middle of the next allreduces
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Thread(target=kill_soon, daemon=True).start()
    try:
        for i in range(200):
            hvd.allreduce_(data, name=f"step.{i}", op=hvd.Max)
        return ("finished",)
    except hora.HorovodInternalError as e:
        return (type(e).__name__, getattr(e, "rank", None), str(e), time.time())


@pytest.mark.timeout(60)
def test_a_rank_killed_in_a_device_plane_collective_is_named_by_the_others(tmp_path):
    job = RawJob(_die_in_a_device_allreduce, 3, tmp_path, args=(2,))
    started = time.time()
    results = job.results(timeout_s=40)
    assert results[2] is None
    for r in (0, 1):
        assert results[r][0] == "ok", (results[r], job.stderr(r))
        kind, rank, message, at = results[r][1]
        assert kind == "HoraRankFailedError" and rank == 2, results[r]
        assert "rank 2" in message
        assert at - started < 15.0, f"rank {r} took {at - started:.1f} s"
