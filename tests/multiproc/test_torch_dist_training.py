"""What runs on torch.distributed runs on backend "hora" (issue 64, item 2): real ranks,
each item trained twice in the same job, once on the default group (``init_process_group
("hora")``) and once on a gloo group of the same ranks (``new_group(backend="gloo")``), from
the same seed on the same shards; the two must agree, and where the oracle is simple, agree
with one process training on the whole batch.

* DDP with several buckets (``bucket_cap_mb`` of a few hundred bytes) over a few steps;
* DDP's ``no_sync()`` (gradient accumulation over two micro-batches);
* a DDP communication hook: ``fp16_compress_hook``;
* ``ZeroRedundancyOptimizer`` (under DDP), and its consolidated state dict;
* FSDP2 ``fully_shard`` on CPU (a 1-D ``DeviceMesh``: ``init_device_mesh`` for hora,
  ``DeviceMesh.from_group`` for gloo);
* ``torch.distributed.checkpoint`` of that sharded model: saved on hora to a directory and
  loaded back, on hora and on gloo, equal to what was saved.

A Hugging Face Accelerate script on backend hora is test_torch_dist_accelerate.py's (a job
of its own, under ``hora run --monitor`` with the timeline on); Lightning is not installed.

Starting ranks is the expensive part: one job of 2 ranks runs every section (and one of 3
ranks the DDP sections); each section returns plain numbers, read by its own test.
"""
import pytest

torch = pytest.importorskip("torch")

from tests.helpers import cached, run_ranks, run_sections, section  # noqa: E402

SEED = 1234
STEPS = 3
BATCH = 12                   # the global batch: divisible by 2 and 3 ranks, and 2 micro-batches
LR = 0.1
BUCKET_MB = 0.0001           # ~100 B: each of _Net's layers (156 B and more) in a bucket of its own
TOL = 1e-5                   # float32, summed in another order than one process does
FP16_TOL = 2e-3              # gradients rounded to float16 before they are summed


# -- models and data, identical on every rank ------------------------------------------------
class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(SEED)
        self.fc1 = torch.nn.Linear(6, 12)
        self.fc2 = torch.nn.Linear(12, 12)
        self.fc3 = torch.nn.Linear(12, 3)

    def forward(self, x):
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def _batch(step):
    g = torch.Generator().manual_seed(SEED + step)
    return torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 3, generator=g)


def _shard(t, rank, size):
    n = BATCH // size
    return t[rank * n:(rank + 1) * n]


def _loss(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def _flat(params):
    return torch.cat([p.detach().reshape(-1) for p in params])


def _diff(a, b):
    return float((a - b).abs().max())


def _reference(micro=1):
    """One process on the whole batch: the parameters after :data:`STEPS` SGD steps."""
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        for xm, ym in zip(x.chunk(micro), y.chunk(micro)):
            (_loss(model, xm, ym) / micro).backward()
        opt.step()
    return _flat(model.parameters())


# -- the sections (each runs on the default group, hora, and on a gloo group) ----------------
def _ddp(group, micro=1, hook=None, **kwargs):
    """DDP over ``group`` for :data:`STEPS` steps; ``micro`` micro-batches a step, all but
    the last under ``no_sync()``.  Returns (flat parameters, number of buckets)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    rank, size = dist.get_rank(), dist.get_world_size()
    model = DDP(_Net(), process_group=group, **kwargs)
    if hook is not None:
        model.register_comm_hook(group, hook)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for step in range(STEPS):
        x, y = (_shard(t, rank, size) for t in _batch(step))
        opt.zero_grad()
        pieces = list(zip(x.chunk(micro), y.chunk(micro)))
        for i, (xm, ym) in enumerate(pieces):
            if i < len(pieces) - 1:
                with model.no_sync():
                    (_loss(model, xm, ym) / micro).backward()
            else:
                (_loss(model, xm, ym) / micro).backward()
        opt.step()
    buckets = len(model.reducer._get_zeros_like_grad_buckets())
    return _flat(model.parameters()), buckets


def _versus(run, reference=None):
    """``run(group)`` on hora and on gloo: their distance, and each one's from the
    reference (or None)."""
    hora_out, gloo_out = run(None), run(_gloo())
    hora_p, gloo_p = (o[0] if isinstance(o, tuple) else o for o in (hora_out, gloo_out))
    out = {"hora_vs_gloo": _diff(hora_p, gloo_p), "params": hora_p.tolist()}
    if reference is not None:
        out["hora_vs_one"] = _diff(hora_p, reference)
        out["gloo_vs_one"] = _diff(gloo_p, reference)
    if isinstance(hora_out, tuple):
        out["extra"] = (hora_out[1:], gloo_out[1:])
    return out


_GLOO = []                   # in a rank: the gloo group of every rank (made by _job)


def _gloo():
    return _GLOO[0]


def _ddp_buckets():
    return _versus(lambda g: _ddp(g, bucket_cap_mb=BUCKET_MB), _reference())


def _ddp_no_sync():
    return _versus(lambda g: _ddp(g, micro=2, bucket_cap_mb=BUCKET_MB), _reference(micro=2))


def _ddp_fp16_hook():
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
    return _versus(lambda g: _ddp(g, hook=fp16_compress_hook, bucket_cap_mb=BUCKET_MB),
                   _reference())


def _zero(group):
    """DDP with ZeroRedundancyOptimizer (each rank steps its share of the parameters and
    broadcasts them); also the consolidated optimizer state on rank 0."""
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP
    rank, size = dist.get_rank(), dist.get_world_size()
    model = DDP(_Net(), process_group=group)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD,
                                  process_group=group, lr=LR, momentum=0.9)
    for step in range(STEPS):
        x, y = (_shard(t, rank, size) for t in _batch(step))
        opt.zero_grad()
        _loss(model, x, y).backward()
        opt.step()
    opt.consolidate_state_dict(to=0)
    momenta = None
    if rank == 0:
        state = opt.state_dict()["state"]
        momenta = _flat(state[i]["momentum_buffer"] for i in sorted(state)).tolist()
    owned = sum(p.numel() for g in opt.optim.param_groups for p in g["params"])
    return _flat(model.parameters()), momenta, owned


def _zero_redundancy():
    return _versus(_zero, _reference())


def _mesh(group):
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    import torch.distributed as dist
    if group is None:
        return init_device_mesh("cpu", (dist.get_world_size(),))
    return DeviceMesh.from_group(group, "cpu")


def _fsdp_model(group):
    from torch.distributed.fsdp import fully_shard
    model = _Net()
    mesh = _mesh(group)
    for layer in (model.fc1, model.fc2, model.fc3):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _full(model):
    """The whole parameters of a sharded model, in order (an all-gather each)."""
    return _flat(p.full_tensor() for p in model.parameters())


def _fsdp(group):
    import torch.distributed as dist
    rank, size = dist.get_rank(), dist.get_world_size()
    model = _fsdp_model(group)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for step in range(STEPS):
        x, y = (_shard(t, rank, size) for t in _batch(step))
        opt.zero_grad()
        _loss(model, x, y).backward()
        opt.step()
    local = _flat(p.to_local() for p in model.parameters())
    return _full(model), local.numel()


def _fsdp2():
    return _versus(_fsdp, _reference())


def _checkpoint(directory):
    """FSDP2 trained on hora, its sharded state dict saved to ``directory`` and loaded back
    into freshly made models, on hora and on gloo."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    rank, size = dist.get_rank(), dist.get_world_size()
    trained = _fsdp_model(None)
    opt = torch.optim.SGD(trained.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = (_shard(t, rank, size) for t in _batch(step))
        opt.zero_grad()
        _loss(trained, x, y).backward()
        opt.step()
    saved = _full(trained)
    dcp.save(trained.state_dict(), checkpoint_id=directory)
    out = {"moved": _diff(saved, _full(_fsdp_model(None)))}      # training changed it
    for name, group in (("hora", None), ("gloo", _gloo())):
        fresh = _fsdp_model(group)
        state = fresh.state_dict()
        dcp.load(state, checkpoint_id=directory, process_group=group)
        fresh.load_state_dict(state)
        out[name] = _diff(saved, _full(fresh))
    return out


# -- the jobs ---------------------------------------------------------------------------------
DDP_SECTIONS = {"ddp_buckets": _ddp_buckets, "ddp_no_sync": _ddp_no_sync,
                "ddp_fp16_hook": _ddp_fp16_hook}
SECTIONS = dict(DDP_SECTIONS, zero_redundancy=_zero_redundancy, fsdp2=_fsdp2)


def _job(sections, directory=None):
    import torch.distributed as dist

    import hora.torch  # noqa: F401 - registers the backend "hora"
    torch.set_num_threads(1)
    dist.init_process_group("hora")
    try:
        _GLOO[:] = [dist.new_group(backend="gloo")]
        runs = {"backends": lambda: (dist.get_backend(), dist.get_backend(_gloo()))}
        runs.update((name, SECTIONS[name]) for name in sections)
        if directory is not None:
            runs["checkpoint"] = lambda: _checkpoint(directory)
        return run_sections(runs)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    jobs = {}

    def get(n):
        sections = list(SECTIONS) if n == 2 else list(DDP_SECTIONS)
        directory = str(tmp_path_factory.mktemp("dcp")) if n == 2 else None
        return cached(jobs, n, lambda: run_ranks(_job, n, timeout_s=60,
                                                 args=(sections, directory)),
                      f"the job with {n} ranks")
    yield get


def _check(results, name, tol=TOL):
    assert section(results, "backends") == [("hora", "gloo")] * len(results)
    per_rank = section(results, name)
    for rank, res in enumerate(per_rank):
        assert res["hora_vs_gloo"] < tol, (name, rank, res["hora_vs_gloo"])
        assert res["hora_vs_one"] < tol, (name, rank, res["hora_vs_one"])
        assert res["gloo_vs_one"] < tol, (name, rank, res["gloo_vs_one"])
        assert res["params"] == per_rank[0]["params"], f"{name}: rank {rank} differs"
    return per_rank


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n", [2, 3])
def test_ddp_with_several_buckets_equals_gloo_and_one_process(job, n):
    per_rank = _check(job(n), "ddp_buckets")
    hora_buckets, gloo_buckets = per_rank[0]["extra"]
    assert hora_buckets == gloo_buckets and hora_buckets[0] >= 3, per_rank[0]["extra"]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n", [2, 3])
def test_ddp_no_sync_accumulation_equals_gloo_and_one_process(job, n):
    _check(job(n), "ddp_no_sync")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n", [2, 3])
def test_ddp_fp16_compress_hook_equals_gloo(job, n):
    # both backends sum the same float16 gradients: two of them round alike however they
    # are added, three may not (by a float16 rounding of a gradient, scaled by the steps);
    # each run is within float16's rounding of one process in float32
    per_rank = _check(job(n), "ddp_fp16_hook", tol=FP16_TOL)
    for res in per_rank:
        assert res["hora_vs_gloo"] < (TOL if n == 2 else 1e-4), res["hora_vs_gloo"]


@pytest.mark.timeout(90)
def test_zero_redundancy_optimizer_equals_gloo_and_one_process(job):
    per_rank = _check(job(2), "zero_redundancy")
    (hora_momenta, hora_owned), (gloo_momenta, gloo_owned) = per_rank[0]["extra"]
    assert hora_momenta is not None and len(hora_momenta) == len(per_rank[0]["params"])
    assert max(abs(a - b) for a, b in zip(hora_momenta, gloo_momenta)) < TOL
    # each rank stepped only its share of the parameters
    owned = [res["extra"][0][1] for res in per_rank]
    assert sum(owned) == len(per_rank[0]["params"]) and min(owned) > 0, owned
    assert hora_owned == gloo_owned


@pytest.mark.timeout(90)
def test_fsdp2_fully_shard_on_cpu_equals_gloo_and_one_process(job):
    per_rank = _check(job(2), "fsdp2")
    # each rank held a shard of the parameters, not all of them
    local = [res["extra"][0][0] for res in per_rank]
    assert sum(local) == len(per_rank[0]["params"]) and max(local) < sum(local), local


@pytest.mark.timeout(90)
def test_checkpoint_of_a_sharded_model_loads_back_equal(job):
    for rank, res in enumerate(section(job(2), "checkpoint")):
        assert res["moved"] > 1e-3, (rank, res)       # a fresh model is not the trained one
        assert res["hora"] == 0.0 and res["gloo"] == 0.0, (rank, res)
