"""hora.torch on CUDA tensors, on real ranks sharing this machine's GPU(s).

Skipped where torch sees no GPU (CI).  Every rank pins its device by local rank, as a
Horovod script does (ranks share a device when there are fewer devices than ranks).  The
oracle is torch on the CPU: every rank rebuilds every rank's input from a seed, and the
training check compares against one process training on the whole batch on the CPU.

By default CUDA tensors are staged through host memory; with HORA_BACKEND=nccl the device
plane (hora.backends.nccl) reduces them on the GPUs, which NCCL allows only with a GPU per
rank.  tests/multiproc/test_device_plane.py runs the same jobs through that plane's code on
CPU tensors, over gloo.
"""
import collections

import pytest

torch = pytest.importorskip("torch")

from tests.helpers import run_ranks  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

DTYPES = ["uint8", "int8", "int32", "int64", "float16", "bfloat16", "float32", "float64",
          "bool"]


def _input(rank, dtype, shape=(3, 5), seed=0):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    x = torch.randint(0, 4, shape, generator=g)
    return x.bool() if dtype == "bool" else x.to(getattr(torch, dtype))


def _sum(xs):
    if xs[0].dtype == torch.bool:
        return torch.stack(xs).any(0)
    acc = xs[0].double()
    for x in xs[1:]:
        acc = acc + x.double()
    return acc.to(xs[0].dtype)


def _device(device_type):
    """The device a rank pins (by local rank, as Horovod's scripts do)."""
    import hora.torch as hvd
    if device_type == "cpu":
        return torch.device("cpu")
    dev = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


def count_plane_calls(device_type):
    """Count the calls the engine makes to this rank's device plane for ``device_type``
    (empty when there is none)."""
    from hora.core import state
    counts = collections.Counter()
    plane = state.engine().device_planes.get(device_type)
    for name in ("allreduce", "allgather", "broadcast") if plane is not None else ():
        def counted(*args, _call=getattr(plane, name), _name=name):
            counts[_name] += 1
            return _call(*args)
        setattr(plane, name, counted)
    return counts


def _ops_job(device_type="cuda"):
    import hora.torch as hvd
    n, rank = hvd.size(), hvd.rank()
    dev = _device(device_type)
    counts = count_plane_calls(device_type)
    bad = []

    def check(what, got, exp, like=None):
        like = exp if like is None else like
        if got.device != dev:
            bad.append(f"{what}: result on {got.device}, not {dev}")
        if got.dtype != like.dtype:
            bad.append(f"{what}: result dtype {got.dtype}, not {like.dtype}")
        if not torch.equal(got.cpu(), exp.cpu()):
            bad.append(f"{what}: {got.cpu().tolist()} != {exp.cpu().tolist()}")

    for dt in DTYPES:
        xs = [_input(r, dt) for r in range(n)]
        mine = xs[rank].to(dev, copy=True)
        check(f"allreduce Sum {dt}", hvd.allreduce(mine, op=hvd.Sum, name=f"ar.{dt}"),
              _sum(xs))
        inplace = xs[rank].to(dev, copy=True)
        out = hvd.allreduce_(inplace, op=hvd.Sum, name=f"ar_.{dt}")
        check(f"allreduce_ {dt} (returned)", out, _sum(xs))
        check(f"allreduce_ {dt} (input)", inplace, _sum(xs))
        check(f"allgather {dt}", hvd.allgather(mine, name=f"ag.{dt}"), torch.cat(xs))
        b = xs[rank].to(dev, copy=True)
        hvd.broadcast_(b, root_rank=n - 1, name=f"bc.{dt}")
        check(f"broadcast_ {dt}", b, xs[n - 1])
        splits = torch.tensor([1] * n)
        rows = [_input(r, dt, shape=(n, 2), seed=7) for r in range(n)]
        got, rsplits = hvd.alltoall(rows[rank].to(dev, copy=True), splits=splits, name=f"a2a.{dt}")
        check(f"alltoall {dt}", got, torch.stack([rows[r][rank] for r in range(n)]))
        if dt != "bool":
            rsx = [_input(r, dt, shape=(2 * n, 3), seed=3) for r in range(n)]
            got = hvd.reducescatter(rsx[rank].to(dev, copy=True), op=hvd.Sum, name=f"rs.{dt}")
            check(f"reducescatter {dt}", got, _sum(rsx)[2 * rank:2 * rank + 2])

    # float averages, a non-contiguous input, grouped ops
    xs = [torch.randn(4, 6, generator=torch.Generator().manual_seed(r)) for r in range(n)]
    got = hvd.allreduce(xs[rank].to(dev, copy=True).t(), name="avg.t")
    exp = torch.stack(xs).mean(0).t()
    if got.device != dev or not torch.allclose(got.cpu(), exp, atol=1e-6):
        bad.append("allreduce of a transposed float32 CUDA tensor")
    mine = xs[rank].to(dev, copy=True)
    group = hvd.grouped_allreduce([mine, 2 * mine], name="grp")
    for i, g in enumerate(group):
        if g.device != dev or not torch.allclose(g.cpu(), (i + 1) * torch.stack(xs).mean(0),
                                                 atol=1e-6):
            bad.append(f"grouped_allreduce member {i}")

    # autograd: allreduce's gradient is the allreduce (average) of the incoming gradients
    x = xs[rank].to(dev, copy=True).requires_grad_()
    y = hvd.allreduce(x, name="ad.y")
    (y * (rank + 1)).sum().backward()
    exp_grad = torch.full_like(xs[rank], sum(r + 1 for r in range(n)) / n)
    if x.grad is None or x.grad.device != dev or not torch.allclose(x.grad.cpu(), exp_grad):
        bad.append(f"allreduce gradient {None if x.grad is None else x.grad.cpu().tolist()}")
    x = xs[rank].to(dev, copy=True).requires_grad_()
    hvd.allgather(x, name="ad.g").pow(2).sum().backward()
    exp_grad = 2 * xs[rank]             # my rows' gradient, averaged over the ranks
    if x.grad is None or not torch.allclose(x.grad.cpu(), exp_grad, atol=1e-5):
        bad.append("allgather gradient")
    return bad, dict(counts)


def _net():
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8),
                               torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _training_job(device_type="cuda"):
    import hora.torch as hvd
    n, rank = hvd.size(), hvd.rank()
    dev = _device(device_type)
    counts = count_plane_calls(device_type)
    model = _net()
    model[1] = hvd.SyncBatchNorm(8)
    with torch.no_grad():                       # rank-dependent start: the broadcast fixes it
        for p in model.parameters():
            p.add_(rank)
    model = model.to(dev)
    ref = _net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    batch = 4 * n
    for step in range(5):
        g = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(batch, 6, generator=g), torch.randn(batch, 2, generator=g)
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
        opt.zero_grad()
        xs, ys = x[4 * rank:4 * rank + 4].to(dev), y[4 * rank:4 * rank + 4].to(dev)
        torch.nn.functional.mse_loss(model(xs), ys).backward()
        opt.step()
    diffs = [float((p.detach().cpu() - q.detach()).abs().max())
             for p, q in zip(model.parameters(), ref.parameters())]
    devices = sorted({str(p.device) for p in model.parameters()}
                     | {str(v.device) for s in opt.state.values() for v in s.values()
                        if torch.is_tensor(v) and v.dim() > 0})
    return max(diffs), devices, dict(counts)


def check_ops(results, plane):
    """Every rank's checks passed; with a device ``plane``, it served its collectives."""
    for rank, (bad, counts) in enumerate(results):
        assert bad == [], f"rank {rank}: {bad}"
        if plane:
            # the float32 checks at the end alone make 3 allreduces (one grouped) and
            # 2 allgathers; every dtype the plane has adds an allreduce, an allreduce_, an
            # allgather and a broadcast_ (autograd's backward adds allreduces)
            assert counts["allreduce"] >= 3 and counts["allgather"] >= 2, counts
            assert counts["broadcast"] >= 5, counts
        else:
            assert counts == {}, counts


def check_training(results, device_prefix, plane):
    # N ranks on shards, with SyncBatchNorm, == one CPU process with BatchNorm on the batch
    for rank, (diff, devices, counts) in enumerate(results):
        assert diff < 1e-4, f"rank {rank} is {diff:.3g} from the one-process CPU run"
        assert all(d.startswith(device_prefix) for d in devices), devices
        if plane:       # 5 steps of gradients; SyncBatchNorm's statistics; the broadcasts
            assert counts["allreduce"] >= 5 and counts["allgather"] >= 5, counts
            assert counts["broadcast"] >= 1, counts


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np_", [1, 2, 3])
def test_collectives_on_cuda_tensors(np_):
    check_ops(run_ranks(_ops_job, np_, timeout_s=100), plane=False)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np_", [1, 2])
def test_training_on_cuda_equals_one_cpu_process(np_):
    check_training(run_ranks(_training_job, np_, timeout_s=100), "cuda", plane=False)


def _gpus_for(np_):
    if torch.cuda.device_count() < np_:
        pytest.skip(f"NCCL needs a GPU per rank: {np_} ranks, "
                    f"{torch.cuda.device_count()} GPU(s) here")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np_", [2, 3])
def test_collectives_through_nccl(np_):
    _gpus_for(np_)
    check_ops(run_ranks(_ops_job, np_, timeout_s=100, env={"HORA_BACKEND": "nccl"}),
              plane=True)


@pytest.mark.timeout(120)
def test_training_through_nccl_equals_one_cpu_process():
    _gpus_for(2)
    check_training(run_ranks(_training_job, 2, timeout_s=100, env={"HORA_BACKEND": "nccl"}),
                   "cuda", plane=True)
