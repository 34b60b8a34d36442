"""DistributedOptimizer and broadcast_optimizer_state on real ranks (SyncBatchNorm:
test_torch_sync_batch_norm.py).

The oracle is one process training on the whole batch: every rank rebuilds the global batch
from a fixed seed, trains a reference copy of the model on it locally, and reports how far
its distributed copy is from the reference.  Starting ranks is the expensive part, so the
tests share one job of 2 ranks and one of 3 (and one rank runs a job of its own): each job
runs a section per test, every section checks many configurations and returns plain numbers.
"""
import functools
import os
import warnings

import pytest

torch = pytest.importorskip("torch")

from tests.helpers import job_fixture, run_ranks, run_sections, section  # noqa: E402

SEED = 1234
STEPS = 4
BATCH = 12                   # the global batch: divisible by 1, 2, 3 ranks and 2 micro-batches


# -- models and data, identical on every rank ------------------------------------------------
class _Net(torch.nn.Module):
    def __init__(self, sparse=False):
        super().__init__()
        torch.manual_seed(SEED)
        self.sparse = sparse
        if sparse:
            self.emb = torch.nn.Embedding(10, 4, sparse=True)
        self.fc1 = torch.nn.Linear(4, 6)
        self.fc2 = torch.nn.Linear(6, 3)

    def forward(self, x):
        if self.sparse:
            x = self.emb((x.abs() * 3).long().clamp(max=9)).sum(1)
        return self.fc2(torch.tanh(self.fc1(x)))


def _batch(step, n=BATCH):
    g = torch.Generator().manual_seed(SEED + step)
    return torch.randn(n, 4, generator=g), torch.randn(n, 3, generator=g)


def _max_diff(a_params, b_params):
    return max(float((a.detach() - b.detach()).abs().max()) for a, b in zip(a_params, b_params))


# -- equivalence: N ranks on shards == one process on the whole batch ------------------------
def _sgd(params, size):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3)


def _adam(params, size):
    return torch.optim.Adam(params, lr=0.01)


def _plain_sgd(params, size):                 # sparse gradients: no momentum or decay
    return torch.optim.SGD(params, lr=0.1)


CONFIGS = {
    # name: (optimizer factory, DistributedOptimizer kwargs, options, tolerance)
    "sgd_momentum_named_steplr": (_sgd, {}, {"named": True, "sched": True}, 1e-6),
    "adam_unnamed": (_adam, {}, {}, 1e-6),
    "sgd_two_passes": (_sgd, {"backward_passes_per_step": 2}, {"named": True}, 1e-6),
    "adam_two_passes": (_adam, {"backward_passes_per_step": 2}, {}, 1e-6),
    "adam_fp16": (_adam, {"compression": "fp16"}, {"named": True}, 5e-3),
    "sgd_fp16": (_sgd, {"compression": "fp16"}, {}, 1e-3),
    "sgd_groups_list": (_sgd, {"groups": "fc1"}, {"named": True}, 1e-6),
    "adam_groups_int": (_adam, {"groups": 2}, {}, 1e-6),
    "sgd_predivide": (_sgd, {"gradient_predivide_factor": 2.0}, {}, 1e-6),
    "sgd_sum_op": (_plain_sgd, {"op": "Sum"}, {"lr_over_size": True}, 1e-6),
    "sgd_clip_synchronize": (_sgd, {}, {"clip": True, "named": True}, 1e-6),
    "sgd_sparse": (_plain_sgd, {}, {"sparse": True, "named": True}, 1e-6),
    "sgd_sparse_as_dense": (_plain_sgd, {"sparse_as_dense": True}, {"sparse": True}, 1e-6),
    # fresh gradients every step (model.zero_grad() sets them to None), kept ones zeroed
    "sgd_model_zero_grad": (_sgd, {}, {"named": True, "zero": "model"}, 1e-6),
    "adam_fp16_model_zero_grad": (_adam, {"compression": "fp16"}, {"zero": "model"}, 5e-3),
    "adam_zero_grad_keep": (_adam, {}, {"zero": "keep"}, 1e-6),
}


def _train_pair(name):
    """Train the distributed and the reference model of config ``name``; returns
    (max |distributed - reference| over parameters, flattened distributed parameters)."""
    import hora.torch as hvd
    factory, kwargs, opts, _ = CONFIGS[name]
    size, rank = hvd.size(), hvd.rank()
    kwargs = dict(kwargs)
    if kwargs.get("compression") == "fp16":
        kwargs["compression"] = hvd.Compression.fp16
    if kwargs.get("op") == "Sum":
        kwargs["op"] = hvd.Sum
    passes = kwargs.get("backward_passes_per_step", 1)

    model, ref = _Net(opts.get("sparse", False)), _Net(opts.get("sparse", False))
    if kwargs.get("groups") == "fc1":
        kwargs["groups"] = [[model.fc1.weight, model.fc1.bias]]
    opt = factory(model.parameters(), size)
    ref_opt = factory(ref.parameters(), size)
    if opts.get("lr_over_size"):             # Sum of gradients == size x their average
        for g in opt.param_groups:
            g["lr"] /= size
    if opts.get("named"):
        kwargs["named_parameters"] = model.named_parameters()
    opt = hvd.DistributedOptimizer(opt, **kwargs)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    scheds = []
    if opts.get("sched"):
        scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5)
                  for o in (opt, ref_opt)]

    shard = BATCH // size
    for step in range(STEPS):
        x, y = _batch(step)
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        if opts.get("clip"):
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()

        if opts.get("zero") == "model":
            model.zero_grad()
        else:
            opt.zero_grad(set_to_none=opts.get("zero") != "keep")
        xs, ys = x[rank * shard:(rank + 1) * shard], y[rank * shard:(rank + 1) * shard]
        for xm, ym in zip(xs.chunk(passes), ys.chunk(passes)):
            (torch.nn.functional.mse_loss(model(xm), ym) / passes).backward()
        if opts.get("clip"):
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
        for s in scheds:
            s.step()
    if scheds and opt.param_groups[0]["lr"] != ref_opt.param_groups[0]["lr"]:
        raise AssertionError("the LR scheduler did not drive the DistributedOptimizer")
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return _max_diff(model.parameters(), ref.parameters()), flat.tolist()


# How gradients travel, by the test's bucket_mb: None, the default buckets; "0", one
# allreduce per tensor (Horovod's); "0.0002", 200 B buckets and a 100 B first one, so several
# buckets, some launched during backward.  The optimizer reads these settings when it builds
# its buckets, so a rank can set them for one run of every config and then put them back.
def _bucket_env(bucket_mb):
    if bucket_mb is None:
        return {}
    return {"HORA_BUCKET_CAP_MB": bucket_mb, "HORA_FIRST_BUCKET_CAP_MB": "0.0001"}


def _equivalence_job(names, bucket_mb=None):
    torch.set_num_threads(1)
    env = _bucket_env(bucket_mb)
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    out = {}
    try:
        for name in names:
            try:
                out[name] = _train_pair(name)
            except Exception as e:           # report per config, keep the ranks in step
                import traceback
                out[name] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    finally:
        for key, value in saved.items():
            if value is None:
                del os.environ[key]
            else:
                os.environ[key] = value
    return out


def _check_equivalence(results):
    for name, (_, _, _, tol) in CONFIGS.items():
        per_rank = [r[name] for r in results]
        for rank, res in enumerate(per_rank):
            assert not isinstance(res, str), f"{name} failed on rank {rank}: {res}"
            assert res[0] < tol, f"{name}: rank {rank} is {res[0]:.3g} from the oracle"
            assert res[1] == per_rank[0][1], f"{name}: rank {rank} differs from rank 0"


# the bucket settings each job of the shared ones runs every config with
EQUIVALENCE_BUCKETS = {2: [None, "0", "0.0002"], 3: [None]}
# the bound of the shared jobs: the sum of the bounds of the jobs folded into the larger one,
# of 2 ranks: 45 + 60 s, and 80 s for each equivalence run (3 ranks: 80 + 60 + 80 s)
SHARED_TIMEOUT_S = 45 + 60 + 3 * 80


@pytest.mark.timeout(SHARED_TIMEOUT_S + 10)
@pytest.mark.parametrize("np_,bucket_mb", [(1, None), (2, None), (3, None), (2, "0"),
                                           (2, "0.0002")])
def test_equivalent_to_one_process_on_the_whole_batch(shared, np_, bucket_mb):
    # one rank takes the optimizer's path with nothing to reduce, in a job of its own; the
    # others are sections of the jobs of 2 and 3 ranks the tests below share
    if np_ == 1:
        _check_equivalence(run_ranks(_equivalence_job, 1, timeout_s=80, args=(list(CONFIGS),)))
    else:
        _check_equivalence(section(shared(np_), f"equivalence {bucket_mb}"))


# -- the jobs of 2 and 3 ranks ---------------------------------------------------------------
# Each test below and the equivalence test check one section of a job of the same N (a torch
# rank takes seconds to start): a section that raises fails its own test with that rank's
# traceback, and the other sections still run.  The job of 2 ranks runs the bucket views
# first (the threads it sets last are what misuse sets again), the job of 3 ranks
# broadcast_optimizer_state before join; the equivalence runs come last in both (each sets
# one thread, as misuse and join leave it, and the bucket settings only for itself).
def _shared_job(n):
    equivalence = {f"equivalence {bucket_mb}": functools.partial(
        _equivalence_job, list(CONFIGS), bucket_mb) for bucket_mb in EQUIVALENCE_BUCKETS[n]}
    if n == 2:
        return run_sections({"bucket_views": _bucket_views_job, "misuse": _misuse_job,
                             **equivalence})
    return run_sections({"broadcast_state": _broadcast_state_job, "join": _join_job,
                         **equivalence})


shared = job_fixture(_shared_job, timeout_s=SHARED_TIMEOUT_S)


# -- gradients as views of their bucket; submissions that wait for step() ------------------
def _storages(params):
    return {p.grad.untyped_storage().data_ptr() for p in params if p.grad is not None}


def _bucket_views_job():
    import time

    import hora.torch as hvd
    rank = hvd.rank()
    out = {}
    model = _Net()
    params = list(model.parameters())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1),
                                   named_parameters=model.named_parameters())

    def backward(step):
        x, y = _batch(step)
        torch.nn.functional.mse_loss(model(x[rank::2]), y[rank::2]).backward()

    opt.zero_grad()
    backward(0)
    fresh = _storages(params)
    opt.step()
    bucket = _storages(params)
    out["fresh_grads_separate"] = len(fresh) == len(params)
    out["one_bucket_after_step"] = len(bucket) == 1
    opt.zero_grad()                          # set_to_none=True: the bucket is kept, zeroed
    out["kept_and_zeroed"] = all(p.grad is not None and not p.grad.any() for p in params)
    backward(1)
    out["accumulated_into_bucket"] = _storages(params) == bucket
    # what the averaged gradient must be: both ranks' halves of the batch, locally
    ref = _Net()
    ref.load_state_dict(model.state_dict())
    x, y = _batch(1)
    halves = [torch.autograd.grad(torch.nn.functional.mse_loss(ref(x[r::2]), y[r::2]),
                                  list(ref.parameters())) for r in range(2)]
    opt.synchronize()
    out["average"] = max(float((p.grad - (a + b) / 2).abs().max())
                         for p, a, b in zip(params, *halves))
    with opt.skip_synchronize():
        opt.step()
    model.zero_grad()                        # None: the next step copies, then views again
    backward(2)
    opt.step()
    out["views_again"] = _storages(params) == bucket

    # no CPU to spare (ranks x threads >= CPUs): gradients are submitted without waking the
    # engine thread, and still reach the other ranks when this one is slow to call step()
    torch.set_num_threads(max(2, os.cpu_count() or 1))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1))
    out["deferred"] = opt._defer
    opt.zero_grad()
    backward(3)
    start = time.monotonic()
    if rank == 1:
        time.sleep(3.0)
        opt.step()
    else:
        opt.synchronize()
        out["wait_s"] = time.monotonic() - start
        with opt.skip_synchronize():
            opt.step()
    out["params"] = torch.cat([p.detach().reshape(-1) for p in params]).tolist()
    return out


@pytest.mark.timeout(SHARED_TIMEOUT_S + 10)
def test_gradients_become_views_of_their_bucket(shared):
    results = section(shared(2), "bucket_views")
    for rank, res in enumerate(results):
        for key in ["fresh_grads_separate", "one_bucket_after_step", "kept_and_zeroed",
                    "accumulated_into_bucket", "views_again", "deferred"]:
            assert res[key] is True, f"rank {rank}, {key}: {res[key]}"
        assert res["average"] < 1e-6, f"rank {rank}: {res['average']}"
    # rank 1 slept 3 s before step(): its engine thread sent the deferred request anyway
    assert results[0]["wait_s"] < 2.0, results[0]["wait_s"]
    assert results[0]["params"] == results[1]["params"]


# -- broadcast_optimizer_state ---------------------------------------------------------------
def _canon(obj):
    """A state dict as plain values (tensors become (dtype, shape, values))."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", str(obj.dtype), tuple(obj.shape), obj.detach().reshape(-1).tolist())
    if isinstance(obj, dict):
        return {k: _canon(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_canon(v) for v in obj]
    return (type(obj).__name__, obj)


def _local_steps(model, opt, n, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x, y = torch.randn(5, 4, generator=g), torch.randn(5, 3, generator=g)

        def closure():
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss
        opt.step(closure)


OPTIMIZERS = {
    "SGD": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "Adam": lambda p: torch.optim.Adam(p, lr=0.01, amsgrad=True),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=0.01),
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
    "Adadelta": lambda p: torch.optim.Adadelta(p),
    "Adamax": lambda p: torch.optim.Adamax(p),
    "ASGD": lambda p: torch.optim.ASGD(p),
    "NAdam": lambda p: torch.optim.NAdam(p),
    "RAdam": lambda p: torch.optim.RAdam(p),
    "RMSprop": lambda p: torch.optim.RMSprop(p, momentum=0.5, centered=True),
    "Rprop": lambda p: torch.optim.Rprop(p),
    "LBFGS": lambda p: torch.optim.LBFGS(p, history_size=3, max_iter=3),
}


def _broadcast_state_job():
    import hora.torch as hvd
    torch.set_num_threads(1)
    rank = hvd.rank()
    out = {}
    # plain optimizers trained on different data, rank 1 not at all (its state is empty);
    # rank 0 alone changes its LR with a scheduler and adds a non-tensor state entry
    for name, make in OPTIMIZERS.items():
        model = _Net()
        opt = make(model.parameters())
        _local_steps(model, opt, 0 if rank == 1 else 2 + rank, seed=rank)
        if rank == 0:
            with warnings.catch_warnings():      # "scheduler.step() before optimizer.step()"
                warnings.simplefilter("ignore")
                torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.25).step()
            opt.state[model.fc1.bias]["note"] = (7, 0.5)     # not str: torch's
            # load_state_dict mangles strings in state (it iterates them like tuples)
        opt.param_groups[0]["lr"] = opt.param_groups[0]["lr"] * (rank + 1)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        out[name] = _canon(opt.state_dict())
    # a DistributedOptimizer (collective steps), then ranks drift apart; root rank 2
    model = _Net()
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    for step in range(2):
        opt.zero_grad()
        x, y = _batch(step + 10 * rank, 4)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    for st in opt.state.values():
        st["exp_avg"].add_(rank)
    opt.param_groups[0]["betas"] = (0.5 + 0.1 * rank, 0.99)
    hvd.broadcast_optimizer_state(opt, root_rank=2)
    out["distributed_adam_root2"] = _canon(opt.state_dict())
    # a fresh optimizer everywhere: its state is created (Horovod's zero step), the
    # hyperparameters follow the root, and the next collective step keeps every rank's
    # parameters identical
    model = _Net()
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01 * (rank + 1)))
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    out["lazy_state_len"] = len(opt.state)
    out["lazy_lr"] = opt.param_groups[0]["lr"]
    opt.zero_grad()
    x, y = _batch(rank, 4)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    out["lazy_params"] = [p.detach().reshape(-1).tolist() for p in model.parameters()]
    return out


@pytest.mark.timeout(SHARED_TIMEOUT_S + 10)
def test_broadcast_optimizer_state_makes_every_rank_equal_to_root(shared):
    results = section(shared(3), "broadcast_state")
    for key in [*OPTIMIZERS, "distributed_adam_root2", "lazy_params", "lazy_lr"]:
        for rank, res in enumerate(results):
            assert res[key] == results[0][key], f"{key}: rank {rank} differs from rank 0"
    assert results[0]["Adam"]["param_groups"][0]["lr"] == ("float", 0.01 * 0.25)
    assert results[1]["SGD"]["state"][1]["note"] == [("int", 7), ("float", 0.5)]
    assert results[1]["Adam"]["state"], "rank 1 did not receive the root's state"
    assert results[0]["distributed_adam_root2"]["param_groups"][0]["betas"][0] == \
        ("float", pytest.approx(0.7))
    assert [r["lazy_state_len"] for r in results] == [4, 4, 4]     # fc1, fc2: weight, bias
    assert [r["lazy_lr"] for r in results] == [0.01] * 3


# -- join: ranks with fewer batches join early -----------------------------------------------
BATCHES = [3, 5, 4]                      # batches per rank; rank 1 joins last


def _join_job():
    import hora.torch as hvd
    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(SEED)
    model = torch.nn.Linear(3, 2)
    ref = torch.nn.Linear(3, 2)
    ref.load_state_dict(model.state_dict())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())

    def data(r, step):
        g = torch.Generator().manual_seed(100 * r + step)
        return torch.randn(4, 3, generator=g), torch.randn(4, 2, generator=g)

    for step in range(BATCHES[rank]):
        opt.zero_grad()
        x, y = data(rank, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    last = hvd.join()
    # the oracle: joined ranks add zeros, and Average still divides by the job size
    with torch.no_grad():
        for step in range(max(BATCHES)):
            total = [torch.zeros_like(p) for p in ref.parameters()]
            for r in range(size):
                if step < BATCHES[r]:
                    x, y = data(r, step)
                    with torch.enable_grad():
                        grads = torch.autograd.grad(
                            torch.nn.functional.mse_loss(ref(x), y), list(ref.parameters()))
                    total = [t + g for t, g in zip(total, grads)]
            for p, t in zip(ref.parameters(), total):
                p -= 0.1 * t / size
    hvd.broadcast_parameters(model.state_dict(), root_rank=last)
    return last, _max_diff(model.parameters(), ref.parameters())


@pytest.mark.timeout(SHARED_TIMEOUT_S + 10)
def test_join_with_uneven_batches(shared):
    results = section(shared(3), "join")
    for rank, (last, diff) in enumerate(results):
        assert last == 1
        assert diff < 1e-6, f"rank {rank} is {diff:.3g} from the oracle"


# -- misuse and API edges --------------------------------------------------------------------
def _raises(fn, exc, text=""):
    try:
        fn()
    except exc as e:
        return text in str(e) or f"wrong message: {e}"
    except Exception as e:
        return f"raised {type(e).__name__}: {e}"
    return "did not raise"


def _misuse_job():
    import hora.torch as hvd
    torch.set_num_threads(1)
    rank = hvd.rank()
    out = {}
    model = _Net()
    named = list(model.named_parameters())

    def wrap(**kw):
        return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **kw)

    out["duplicate_names"] = _raises(lambda: wrap(named_parameters=[("w", p) for _, p in named]),
                                     ValueError, "Found duplicates: w")
    out["names_missing"] = _raises(lambda: wrap(named_parameters=named[:2]), ValueError,
                                   "not named")
    out["names_not_tuples"] = _raises(
        lambda: wrap(named_parameters=list(model.parameters())), ValueError, "(name, parameter)")
    out["groups_bad"] = _raises(lambda: wrap(groups=[[1.0]]), ValueError, "torch.Tensor")
    out["groups_twice"] = _raises(lambda: wrap(groups=[[model.fc1.weight], [model.fc1.weight]]),
                                  ValueError, "only appear once")
    out["predivide_sum"] = _raises(lambda: wrap(op=hvd.Sum, gradient_predivide_factor=2.0),
                                   ValueError, "gradient_predivide_factor")
    out["adasum"] = _raises(lambda: wrap(op=hvd.Adasum), NotImplementedError, "Adasum")
    out["passes_zero"] = _raises(lambda: wrap(backward_passes_per_step=0), ValueError,
                                 "backward_passes_per_step")
    out["not_an_optimizer"] = _raises(lambda: hvd.DistributedOptimizer(model), TypeError)
    out["wrapped_twice"] = _raises(lambda: hvd.DistributedOptimizer(wrap()), ValueError)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrap(num_groups=2)
    out["num_groups_deprecated"] = [w.category.__name__ for w in caught]

    def loss():
        x, y = _batch(rank, 4)
        return torch.nn.functional.mse_loss(model(x), y)

    # zero_grad between backward and step: refused, and the step still completes
    opt = wrap(named_parameters=named)
    loss().backward()
    out["zero_grad_race"] = _raises(opt.zero_grad, AssertionError, "race condition")
    opt.step()
    opt.zero_grad()
    # more backward passes than backward_passes_per_step
    opt = wrap(backward_passes_per_step=2)
    loss().backward()
    loss().backward()
    out["too_many_passes"] = _raises(lambda: loss().backward(), AssertionError,
                                     "more than backward_passes_per_step")
    opt.synchronize()                        # the two allowed passes are still reduced
    with opt.skip_synchronize():
        opt.step()
    # step() right after synchronize(): Horovod's warning, no second reduction
    opt = wrap()
    loss().backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    out["step_after_sync"] = [str(w.message) for w in caught]
    # step() without backward(): every gradient is reduced as zeros, nothing hangs
    opt.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    out["step_without_backward"] = _max_diff(before, model.parameters())
    # a parameter only rank 0 uses: rank 1 contributes zeros instead of hanging
    opt = wrap(named_parameters=named)
    opt.zero_grad()
    x, _ = _batch(0, 4)
    h = torch.tanh(model.fc1(x))
    (model.fc2(h).sum() if rank == 0 else h.sum()).backward()
    opt.synchronize()
    out["unused_grad"] = model.fc2.bias.grad.tolist()     # rank 0's 4.0 averaged: 2.0
    with opt.skip_synchronize():
        opt.step()
    # checkpoint round trip through the wrapper, and a param group added later
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.fc1.parameters(), lr=0.01))
    opt.add_param_group({"params": list(model.fc2.parameters()), "lr": 0.02})
    opt.zero_grad()
    loss().backward()
    opt.step()
    fresh = hvd.DistributedOptimizer(torch.optim.Adam(model.fc1.parameters(), lr=0.01))
    fresh.add_param_group({"params": list(model.fc2.parameters()), "lr": 0.5})
    fresh.load_state_dict(opt.state_dict())
    out["checkpoint"] = _canon(fresh.state_dict()) == _canon(opt.state_dict())
    del opt, fresh                           # their hooks go with them
    # a closure's gradients (computed inside step) are reduced before they are applied
    opt = wrap(named_parameters=named)
    opt.zero_grad()

    def closure():
        opt.zero_grad()
        value = loss()
        value.backward()
        return value
    opt.step(closure)
    out["fc2_reduced"] = model.fc2.weight.detach().reshape(-1).tolist()
    return out


@pytest.mark.timeout(SHARED_TIMEOUT_S + 10)
def test_misuse_raises_clear_errors_and_nothing_hangs(shared):
    results = section(shared(2), "misuse")
    for rank, res in enumerate(results):
        for key in ["duplicate_names", "names_missing", "names_not_tuples", "groups_bad",
                    "groups_twice", "predivide_sum", "adasum", "passes_zero",
                    "not_an_optimizer", "wrapped_twice", "zero_grad_race", "too_many_passes",
                    "checkpoint"]:
            assert res[key] is True, f"rank {rank}, {key}: {res[key]}"
        assert res["num_groups_deprecated"] == ["DeprecationWarning"]
        assert [m[:60] for m in res["step_after_sync"]] == [
            "optimizer.step() called without optimizer.skip_synchronize()"]
        assert res["step_without_backward"] == 0.0
        assert res["unused_grad"] == [2.0, 2.0, 2.0]
    assert results[0]["fc2_reduced"] == results[1]["fc2_reduced"]

