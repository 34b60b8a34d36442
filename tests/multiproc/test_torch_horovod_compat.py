"""Horovod behaviour that scripts and Horovod-based libraries rely on, on real ranks:
``broadcast_optimizer_state`` on a fresh optimizer (zero gradients everywhere, as after
Horovod's zero step, so ``hvd.broadcast(p.grad, 0)`` works right after it), its errors
reaching every rank, and the attributes of a ``DistributedOptimizer`` made without
``named_parameters`` (``_parameter_names``, ``_requires_update``, ``_handles``,
``_allreduce_delay``, ``_grad_accs``), and the job's basics imported from
``horovod.torch.mpi_ops`` (``from horovod.torch.mpi_ops import size``), as scripts do.

The job runs with ``HORA_BUCKET_CAP_MB=0`` (one allreduce per tensor, Horovod's way), so
that ``_handles`` and ``_requires_update`` work per parameter as in Horovod.
"""
import traceback

import pytest

torch = pytest.importorskip("torch")

from tests.helpers import run_ranks, section  # noqa: E402

NP = 3


class _ModelNoGrad(torch.nn.Module):
    """Horovod's test_broadcast_state_no_grad model: an integer parameter that needs no
    gradient beside one that does."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(11)
        self.a = torch.nn.Parameter(torch.tensor([1, 3], dtype=torch.int32),
                                    requires_grad=False)
        self.b = torch.nn.Parameter(torch.rand(4))

    def forward(self, x):
        return torch.index_select(self.b, 0, self.a.long()) * x


def _fresh_state(hvd):
    rank = hvd.rank()
    model = _ModelNoGrad()
    opt = torch.optim.SGD(model.parameters(), lr=0.001 * (rank + 1), weight_decay=1e-6,
                          momentum=0.9, nesterov=True)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    before = model.b.detach().clone()
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    # the lines Horovod's users write right after it
    grad = opt.param_groups[0]["params"][1].grad
    bgrad = hvd.broadcast(grad, root_rank=0)
    return {
        "int_param_grad_is_none": opt.param_groups[0]["params"][0].grad is None,
        "grad": grad.tolist(),
        "grad_equals_root": torch.equal(grad, bgrad),
        "params_unchanged": torch.equal(model.b.detach(), before),
        "lr": opt.param_groups[0]["lr"],
        "state": {k: (v.tolist() if torch.is_tensor(v) else v)
                  for k, v in opt.state[model.b].items()},
    }


class _Broken(torch.optim.SGD):
    def step(self, closure=None):
        raise ArithmeticError("no state on this rank")


def _failing_root(hvd):
    rank = hvd.rank()
    model = _ModelNoGrad()
    cls = _Broken if rank == 0 else torch.optim.SGD
    opt = cls(model.parameters(), lr=0.1, momentum=0.9)
    try:
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        raised = None
    except Exception as e:                   # what each rank saw
        raised = (type(e).__name__, str(e))
    # the ranks are still in step: the next collective completes
    after = hvd.allreduce(torch.tensor([float(rank)]), op=hvd.Sum, name="after").item()
    return {"raised": raised, "after": after}


def _no_named_parameters(hvd):
    # Horovod's test_optimizer_no_named_parameters
    model = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 10))
    opt = torch.optim.SGD([{"params": model[0].parameters()},
                           {"params": model[1].parameters()}], lr=0.001)
    opt = hvd.DistributedOptimizer(opt)
    names = opt._parameter_names
    everyone = hvd.allgather_object(sorted(names.values()))
    by_position = [names[p] for g in opt.param_groups for p in g["params"]]
    return {"unique": len(names) == len(set(names.values())),
            "same_on_every_rank": all(n == everyone[0] for n in everyone),
            "by_position": by_position}


def _data(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 3, generator=g), torch.randn(4, 2, generator=g)


class _ThreeLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.fc1, self.fc2 = torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)
        self.unused = torch.nn.Linear(3, 2)          # no rank uses it in forward

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _requires_update(hvd):
    rank, size = hvd.rank(), hvd.size()
    out = {}
    for label, required in (("default", None), ("empty", set())):
        model = _ThreeLayers()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        if required is not None:
            opt._requires_update = required         # the workaround scripts carry
        x, y = _data(0, rank)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.synchronize()
        out[label] = {"unused": None if model.unused.weight.grad is None
                      else model.unused.weight.grad.abs().sum().item()}
        # the used gradients are the average of every rank's, all the same
        ref = _ThreeLayers()
        grads = [torch.autograd.grad(torch.nn.functional.mse_loss(ref(xr), yr),
                                     [ref.fc1.weight, ref.fc2.bias])
                 for xr, yr in (_data(0, r) for r in range(size))]
        out[label]["used_diff"] = max(
            float((model.fc1.weight.grad - sum(g[0] for g in grads) / size).abs().max()),
            float((model.fc2.bias.grad - sum(g[1] for g in grads) / size).abs().max()))
        with opt.skip_synchronize():
            opt.step()
    return out


def _handles_and_delays(hvd):
    rank = hvd.rank()
    model = _ThreeLayers()
    params = list(model.parameters())
    used = [model.fc1.weight, model.fc1.bias, model.fc2.weight, model.fc2.bias]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1), backward_passes_per_step=2)
    out = {"requires_update": opt._requires_update == set(params),
           "grad_accs": sorted(type(a).__name__ for a in opt._grad_accs),
           "accs_of_params": sorted(id(a.variable) for a in opt._grad_accs)
           == sorted(id(p) for p in params)}
    x, y = _data(1, rank)
    torch.nn.functional.mse_loss(model(x), y).backward()
    out["after_one_pass"] = (sorted(opt._allreduce_delay[p] for p in params), len(opt._handles))
    torch.nn.functional.mse_loss(model(x), y).backward()
    out["after_two_passes"] = sorted(opt._allreduce_delay[p] for p in params)
    out["handles"] = (set(opt._handles) == set(used),
                      all(callable(h) and ctx is None for h, ctx in opt._handles.values()))
    opt.synchronize()
    out["after_synchronize"] = (len(opt._handles), opt._synchronized,
                                sorted(opt._allreduce_delay[p] for p in params))
    with opt.skip_synchronize():
        opt.step()
    out["after_step"] = (opt._synchronized, opt._should_synchronize)
    return out


def _mpi_ops_basics(hvd):
    from hora.torch import mpi_ops
    from hora.torch.mpi_ops import init, is_initialized, local_rank, rank, size  # noqa: F401
    names = ("init", "shutdown", "is_initialized", "size", "local_size", "cross_size", "rank",
             "local_rank", "cross_rank", "is_homogeneous", "mpi_threads_supported",
             "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built", "nccl_built",
             "ddl_built", "ccl_built", "cuda_built", "rocm_built", "start_timeline",
             "stop_timeline")
    return {"same_objects": [n for n in names if getattr(mpi_ops, n) is not getattr(hvd, n)],
            "values": (size(), rank(), local_rank(), is_initialized())}


def _compat_job():
    import hora.torch as hvd
    torch.set_num_threads(1)
    out = {}
    for name, fn in [("fresh_state", _fresh_state), ("failing_root", _failing_root),
                     ("no_named_parameters", _no_named_parameters),
                     ("requires_update", _requires_update),
                     ("handles_and_delays", _handles_and_delays),
                     ("mpi_ops_basics", _mpi_ops_basics)]:
        try:
            out[name] = ("ok", fn(hvd))
        except Exception:                    # reported per section; the ranks keep in step
            out[name] = ("error", traceback.format_exc())
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_compat_job, NP, timeout_s=80, env={"HORA_BUCKET_CAP_MB": "0"})



@pytest.mark.timeout(90)
def test_fresh_optimizer_has_zero_gradients_everywhere_after_broadcast_optimizer_state(results):
    per_rank = section(results, "fresh_state")
    for rank, res in enumerate(per_rank):
        assert res["int_param_grad_is_none"], f"rank {rank}"
        assert res["grad"] == [0.0] * 4 and res["grad_equals_root"], f"rank {rank}: {res}"
        assert res["params_unchanged"], f"rank {rank}"
        assert res["lr"] == 0.001                                # the root's
        # the state was created, as a fresh optimizer's: a zero momentum buffer
        assert res["state"] == {"momentum_buffer": [0.0] * 4}, f"rank {rank}: {res['state']}"


@pytest.mark.timeout(90)
def test_a_root_that_cannot_create_the_state_fails_every_rank(results):
    per_rank = section(results, "failing_root")
    assert per_rank[0]["raised"] == ("ArithmeticError", "no state on this rank")
    for rank in range(1, NP):
        kind, message = per_rank[rank]["raised"]
        assert kind == "RuntimeError" and "rank 0" in message and "no state" in message, \
            per_rank[rank]["raised"]
    assert [r["after"] for r in per_rank] == [float(sum(range(NP)))] * NP


@pytest.mark.timeout(90)
def test_parameter_names_without_named_parameters_are_horovods(results):
    per_rank = section(results, "no_named_parameters")
    for rank, res in enumerate(per_rank):
        assert res["unique"] and res["same_on_every_rank"], f"rank {rank}"
        assert res["by_position"] == ["allreduce.noname.0.0", "allreduce.noname.0.1",
                                      "allreduce.noname.1.0", "allreduce.noname.1.1"]


@pytest.mark.timeout(90)
def test_requires_update_says_which_missing_gradients_are_reduced(results):
    for rank, res in enumerate(section(results, "requires_update")):
        # by default a gradient no rank computed is reduced as zeros (Horovod's way)...
        assert res["default"]["unused"] == 0.0, f"rank {rank}: {res}"
        # ...and with the workaround scripts carry (_requires_update = set()) it stays None
        assert res["empty"]["unused"] is None, f"rank {rank}: {res}"
        assert res["default"]["used_diff"] < 1e-6 and res["empty"]["used_diff"] < 1e-6


@pytest.mark.timeout(90)
def test_handles_delays_and_grad_accumulators_follow_horovods_meaning(results):
    for rank, res in enumerate(section(results, "handles_and_delays")):
        assert res["requires_update"], f"rank {rank}"
        assert res["grad_accs"] == ["AccumulateGrad"] * 6 and res["accs_of_params"]
        # two backward passes per step: one pass leaves one to go and nothing in flight
        assert res["after_one_pass"] == ([1, 1, 1, 1, 2, 2], 0), f"rank {rank}: {res}"
        # the second starts the used parameters' allreduces (the unused wait for
        # synchronize)
        assert res["after_two_passes"] == [0, 0, 0, 0, 2, 2], f"rank {rank}: {res}"
        assert res["handles"] == (True, True), f"rank {rank}: {res}"
        assert res["after_synchronize"] == (0, True, [2] * 6), f"rank {rank}: {res}"
        assert res["after_step"] == (False, True)


@pytest.mark.timeout(90)
def test_mpi_ops_carries_the_basics_as_horovods_does(results):
    for rank, res in enumerate(section(results, "mpi_ops_basics")):
        assert res["same_objects"] == [], f"rank {rank}: {res}"
        assert res["values"] == (NP, rank, rank, True), f"rank {rank}: {res}"
