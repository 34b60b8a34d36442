"""hora as a torch.distributed backend (hora.torch.distributed): ``dist.init_process_group
("hora")`` with hora's placement (RANK/WORLD_SIZE from it), every collective of
``torch.distributed`` checked against NumPy on the inputs (each a function of the rank,
computed here again), the object collectives, async work and its future, groups of some
ranks (``new_group``, ``new_subgroups``); and hora's promises
through it: a mismatched collective fails on every rank, a killed rank is named by every
survivor.
"""
import os
import signal

import numpy as np
import pytest

N = 3


def _x(rank, shape=(2, 3)):
    """Rank ``rank``'s input."""
    return np.arange(np.prod(shape), dtype=np.float32).reshape(shape) * (rank + 1) + rank


def _every_collective():
    import time
    import warnings
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import hora.errors
    import hora.torch  # noqa: F401 - registers the backend

    warnings.simplefilter("ignore", FutureWarning)     # torch's renamed gathers
    dist.init_process_group("hora")
    r, n = dist.get_rank(), dist.get_world_size()
    x = lambda: torch.from_numpy(_x(r))  # noqa: E731
    got = {"backend": dist.get_backend(), "rank": r, "size": n}
    for op in ("SUM", "AVG", "PRODUCT", "MIN", "MAX"):
        t = x()
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
        got[f"all_reduce {op}"] = t.numpy()
    t = x()
    dist.broadcast(t, src=2)
    got["broadcast"] = t.numpy()
    t = x()
    dist.reduce(t, dst=1)
    got["reduce"] = t.numpy()
    outs = [torch.zeros(2, 3) for _ in range(n)]
    dist.all_gather(outs, x())
    got["all_gather"] = np.stack([o.numpy() for o in outs])
    out = torch.zeros(n * 2, 3)
    dist.all_gather_into_tensor(out, x())
    got["all_gather_into_tensor"] = out.numpy()
    out = torch.zeros(2, 3)
    dist.reduce_scatter_tensor(out, torch.from_numpy(_x(r, (n * 2, 3))))
    got["reduce_scatter_tensor"] = out.numpy()
    out = torch.zeros(2, 3)
    dist.reduce_scatter(out, [torch.from_numpy(_x(r, (n * 2, 3))[2 * k:2 * k + 2])
                              for k in range(n)], op=dist.ReduceOp.MAX)
    got["reduce_scatter MAX"] = out.numpy()
    out = torch.zeros(n * 2)
    dist.all_to_all_single(out, torch.from_numpy(_x(r, (n * 2,))))
    got["all_to_all_single"] = out.numpy()
    # uneven: rank r sends k + 1 rows to rank k, so receives r + 1 from each
    send = torch.from_numpy(_x(r, (sum(range(1, n + 1)), 2)))
    out = torch.zeros(n * (r + 1), 2)
    dist.all_to_all_single(out, send, [r + 1] * n, list(range(1, n + 1)))
    got["all_to_all_single uneven"] = out.numpy()
    outs = [torch.zeros(2) for _ in range(n)]
    dist.all_to_all(outs, [torch.full((2,), 10.0 * r + k) for k in range(n)])
    got["all_to_all"] = np.stack([o.numpy() for o in outs])
    gathered = [torch.zeros(2, 3) for _ in range(n)] if r == 0 else None
    dist.gather(x(), gathered, dst=0)
    got["gather"] = None if gathered is None else np.stack([g.numpy() for g in gathered])
    out = torch.zeros(2, 3)
    dist.scatter(out, [torch.from_numpy(_x(k)) for k in range(n)] if r == 1 else None, src=1)
    got["scatter"] = out.numpy()
    dist.barrier()
    objects = [None] * n
    dist.all_gather_object(objects, {"rank": r, "name": f"r{r}"})
    got["all_gather_object"] = objects
    sent = [r, f"from {r}"]
    dist.broadcast_object_list(sent, src=2)
    got["broadcast_object_list"] = sent
    work = dist.all_reduce(x(), async_op=True)
    got["future"] = work.get_future().wait()[0].numpy()
    t = x()
    works = [dist.all_reduce(t, async_op=True), dist.broadcast(x(), src=0, async_op=True)]
    for w in works:
        w.wait()
    got["async"] = t.numpy()
    # a wait with a timeout gives up (rank 2 comes late), the collective goes on
    if r == 2:
        time.sleep(1.0)
    w = dist.all_reduce(x(), async_op=True)
    try:
        w.wait(timedelta(seconds=0.05) if r == 0 else None)
        got["timed out"] = None
    except hora.errors.CollectiveTimeoutError as e:
        got["timed out"] = str(e)
        w.wait()
    try:
        dist.send(x(), dst=(r + 1) % n)
    except Exception as e:          # noqa: BLE001 - which error is what is checked
        got["send"] = (type(e).__name__, str(e))
    for _ in range(5):              # cached: the same call again and again
        t = x()
        dist.all_reduce(t)
    got["repeated"] = t.numpy()
    got.update(_subgroups(r))
    got["steps"] = _steps()
    return got


def _steps():
    """Training steps as hora counts them (``hora run --monitor``'s steps/s): two of a
    plain optimizer under DDP, one of hora's DistributedOptimizer (counted once, not again
    for the optimizer it wraps)."""
    import torch
    import hora
    import hora.torch as hvd

    before = hora.metrics()["steps"]
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
    plain = torch.nn.Linear(2, 1)
    wrapped = hvd.DistributedOptimizer(torch.optim.SGD(plain.parameters(), lr=0.1),
                                       named_parameters=plain.named_parameters())
    plain(torch.ones(1, 2)).sum().backward()
    wrapped.step()
    return hora.metrics()["steps"] - before


def _subgroups(r):
    """Groups of some ranks: each runs on a process set its members register (rank 1 is in
    neither the first nor, with rank 0, in the second); roots are global ranks in torch's
    API, group ranks in what the backend is given."""
    import torch
    import torch.distributed as dist

    got = {}
    pair, other = dist.new_group([0, 2]), dist.new_group([1, 2])
    if r in (0, 2):
        x = lambda: torch.from_numpy(_x(r))  # noqa: E731
        t = x()
        dist.all_reduce(t, group=pair)
        got["pair all_reduce"] = t.numpy()
        t = x()
        dist.broadcast(t, src=2, group=pair)
        got["pair broadcast"] = t.numpy()
        outs = [torch.zeros(2, 3) for _ in range(2)]
        dist.all_gather(outs, x(), group=pair)
        got["pair all_gather"] = np.stack([o.numpy() for o in outs])
        out = torch.zeros(3)
        dist.reduce_scatter_tensor(out, torch.from_numpy(_x(r, (6,))), group=pair)
        got["pair reduce_scatter_tensor"] = out.numpy()
        t = x()
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pair, async_op=True).wait()
        got["pair async MAX"] = t.numpy()
        got["pair rank"] = dist.get_rank(pair)
    if r in (1, 2):
        t = torch.full((2,), float(r))
        dist.all_reduce(t, group=other)
        got["other all_reduce"] = t.numpy()
    alone, _ = dist.new_subgroups(group_size=1)     # a group of one rank each
    t = torch.full((2,), float(r))
    dist.all_reduce(t, group=alone)
    got["alone"] = t.numpy()
    return got


def _job():
    """Every collective, then a mismatched all_reduce (rank 1's shape differs), then rank 2
    SIGKILLs itself in a loop of all_reduce: ``(collectives, the mismatch's error, the rank
    the failure names)``."""
    import torch
    import torch.distributed as dist
    import hora

    got = _every_collective()
    r = dist.get_rank()
    try:
        dist.all_reduce(torch.ones(4 if r == 1 else 3))
        mismatch = None
    except hora.HoraError as e:
        mismatch = (type(e).__name__, str(e))
    try:
        for i in range(10000):
            if i == 20 and r == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            dist.all_reduce(torch.ones(2))
    except hora.HoraRankFailedError as e:
        return got, mismatch, e.rank
    return got, mismatch, None


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """One job of N ranks, placed as hora run places them (HORA_RANK, ...: hora.torch gives
    torch's env:// RANK and WORLD_SIZE from them), MASTER_ADDR/MASTER_PORT as hora run sets
    them; no launcher above it, so that the survivors of the kill report."""
    from tests.helpers import RawJob
    raw = RawJob(_job, N, tmp_path_factory.mktemp("dist"),
                 env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())})
    return raw, raw.results(timeout_s=50)


@pytest.mark.timeout(60)
def test_every_collective_equals_numpy_on_the_inputs(job):
    raw, outcome = job
    results = []
    for rank in range(N - 1):               # rank 2 was killed at the end
        status, value = outcome[rank][:2]
        assert status == "ok", (rank, outcome[rank], raw.stderr(rank)[-2000:])
        results.append(value[0])
    xs = np.stack([_x(r) for r in range(N)])
    big = np.stack([_x(r, (N * 2, 3)) for r in range(N)])
    flat = np.stack([_x(r, (N * 2,)) for r in range(N)])
    uneven = [_x(r, (sum(range(1, N + 1)), 2)) for r in range(N)]
    for r, got in enumerate(results):
        assert (got["backend"], got["rank"], got["size"]) == ("hora", r, N)
        np.testing.assert_allclose(got["all_reduce SUM"], xs.sum(0), rtol=1e-6)
        np.testing.assert_allclose(got["all_reduce AVG"], xs.mean(0), rtol=1e-6)
        np.testing.assert_allclose(got["all_reduce PRODUCT"], xs.prod(0), rtol=1e-6)
        np.testing.assert_array_equal(got["all_reduce MIN"], xs.min(0))
        np.testing.assert_array_equal(got["all_reduce MAX"], xs.max(0))
        np.testing.assert_array_equal(got["broadcast"], xs[2])
        # reduce: the result on the destination; the others' tensors as they were
        np.testing.assert_allclose(got["reduce"], xs.sum(0) if r == 1 else xs[r], rtol=1e-6)
        np.testing.assert_array_equal(got["all_gather"], xs)
        np.testing.assert_array_equal(got["all_gather_into_tensor"], xs.reshape(N * 2, 3))
        np.testing.assert_allclose(got["reduce_scatter_tensor"],
                                   big.sum(0)[2 * r:2 * r + 2], rtol=1e-6)
        np.testing.assert_array_equal(got["reduce_scatter MAX"], big.max(0)[2 * r:2 * r + 2])
        np.testing.assert_array_equal(got["all_to_all_single"],
                                      flat[:, 2 * r:2 * r + 2].reshape(-1))
        starts = np.cumsum([0, *range(1, N + 1)])
        np.testing.assert_array_equal(got["all_to_all_single uneven"], np.concatenate(
            [uneven[k][starts[r]:starts[r + 1]] for k in range(N)]))
        np.testing.assert_array_equal(got["all_to_all"],
                                      [[10.0 * k + r] * 2 for k in range(N)])
        if r == 0:
            np.testing.assert_array_equal(got["gather"], xs)
        else:
            assert got["gather"] is None
        np.testing.assert_array_equal(got["scatter"], xs[r])
        assert got["all_gather_object"] == [{"rank": k, "name": f"r{k}"} for k in range(N)]
        assert got["broadcast_object_list"] == [2, "from 2"]
        np.testing.assert_allclose(got["future"], xs.sum(0), rtol=1e-6)
        np.testing.assert_allclose(got["async"], xs.sum(0), rtol=1e-6)
        np.testing.assert_allclose(got["repeated"], xs.sum(0), rtol=1e-6)
        if r == 0:
            assert "did not finish within 0.05 s" in got["timed out"], got["timed out"]
        if r in (0, 2):
            pair = xs[[0, 2]]
            np.testing.assert_allclose(got["pair all_reduce"], pair.sum(0), rtol=1e-6)
            np.testing.assert_array_equal(got["pair broadcast"], xs[2])
            np.testing.assert_array_equal(got["pair all_gather"], pair)
            halves = np.stack([_x(k, (6,)) for k in (0, 2)]).sum(0)
            np.testing.assert_allclose(got["pair reduce_scatter_tensor"],
                                       halves[3 * (r // 2):3 * (r // 2) + 3], rtol=1e-6)
            np.testing.assert_array_equal(got["pair async MAX"], pair.max(0))
            assert got["pair rank"] == r // 2
        else:
            assert not any(k.startswith("pair") for k in got)
        if r == 1:
            np.testing.assert_array_equal(got["other all_reduce"], [3.0, 3.0])
        np.testing.assert_array_equal(got["alone"], [float(r)] * 2)
        assert got["steps"] == 3, got["steps"]
        kind, text = got["send"]
        assert kind == "HoraError" and "point-to-point" in text, got["send"]


@pytest.mark.timeout(60)
def test_a_mismatch_fails_on_every_rank_and_a_killed_rank_is_named(job):
    raw, outcome = job
    assert outcome[2] is None               # killed: no result
    for rank in (0, 1):
        _, mismatch, named = outcome[rank][1]
        kind, text = mismatch
        assert kind == "CollectiveMismatchError" and "shapes" in text, text
        assert "rank 1: (4,)" in text, text
        assert named == 2, (rank, named)


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
