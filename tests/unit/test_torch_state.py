"""``hora.torch`` in one process: ``broadcast_optimizer_state`` on a fresh optimizer (its
state is created, as by Horovod's zero step, and nothing else changes: the oracle is a
fresh optimizer that never saw the call), ``broadcast_parameters`` on a list of tensors,
``sparse_allreduce_async``'s argument checks, and the Horovod attributes of
``DistributedOptimizer``."""
import pytest
import torch

import hora.torch as hvd

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def alone():
    hvd.init()
    torch.set_num_threads(1)
    yield
    hvd.shutdown()


class _Mlp(torch.nn.Module):
    """A small model with a frozen integer parameter, as in Horovod's
    test_broadcast_state_no_grad."""

    def __init__(self, bias=True, frozen=True):
        super().__init__()
        torch.manual_seed(7)
        self.fc1 = torch.nn.Linear(4, 5, bias=bias)
        self.fc2 = torch.nn.Linear(5, 3, bias=bias)
        index = torch.tensor([2, 0, 1])
        self.index = torch.nn.Parameter(index, requires_grad=False) if frozen else index

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))[:, self.index]


class _Embeddings(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.emb = torch.nn.Embedding(10, 3, sparse=True)

    def forward(self, x):
        return self.emb((x.abs() * 3).long().clamp(max=9)).sum(1)


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(6, 4, generator=g), torch.randn(6, 3, generator=g)


def _settings(opt):
    return [{k: (type(v), v) for k, v in g.items() if k != "params"} for g in opt.param_groups]


# every optimizer of torch.optim (as Horovod's test_broadcast_state lists them), with
# weight decay and momentum where they take them
_KWARGS = dict(lr=0.05, momentum=0.9, weight_decay=0.1, dampening=0.2, centered=True,
               amsgrad=True)


def _optimizers():
    classes = [c for c in torch.optim.Optimizer.__subclasses__()
               if c.__module__.startswith("torch.optim")]
    return sorted(classes, key=lambda c: c.__name__)


def _make(cls, params):
    import inspect
    accepted = inspect.signature(cls.__init__).parameters
    return cls(params, **{k: v for k, v in _KWARGS.items() if k in accepted})


def _model_for(cls):
    if cls is torch.optim.SparseAdam:
        return _Embeddings()
    # Muon takes 2-D parameters only; L-BFGS steps every parameter, integer ones too
    return _Mlp(bias=cls.__name__ != "Muon", frozen=cls.__name__ not in ("Muon", "LBFGS"))


def _train(model, opt, steps=3):
    for step in range(steps):
        x, y = _batch(step)

        def closure():
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss
        opt.step(closure)
    return torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])


@pytest.mark.parametrize("cls", _optimizers(), ids=lambda c: c.__name__)
def test_fresh_optimizer_state_is_created_and_training_continues_as_a_fresh_ones(alone, cls):
    model = _model_for(cls)
    opt = _make(cls, list(model.parameters()))
    fresh = not opt.state_dict()["state"]
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    hook_calls = []
    opt.register_step_post_hook(lambda *args: hook_calls.append(args))
    params = [p.detach().clone() for p in model.parameters()]
    settings = _settings(opt)

    hvd.broadcast_optimizer_state(opt, root_rank=0, model=model)

    if fresh:
        assert opt.state_dict()["state"] or cls is torch.optim.SGD and not _KWARGS["momentum"]
    for (name, p), before in zip(model.named_parameters(), params):
        assert torch.equal(p.detach(), before), f"{name} moved"
        if not p.requires_grad:
            assert p.grad is None, name
        elif fresh:                             # Horovod's zero gradients
            assert p.grad is not None and p.grad.shape == p.shape, name
            assert not p.grad.to_dense().any(), name
            assert p.grad.is_sparse == (cls is torch.optim.SparseAdam), name
        else:                                   # its state existed: gradients untouched
            assert p.grad is None, name
    assert _settings(opt) == settings
    assert hook_calls == [] and not getattr(opt, "_opt_called", False)

    # the oracle: the same optimizer, fresh, never broadcast
    ref_model = _model_for(cls)
    ref = _make(cls, list(ref_model.parameters()))
    torch.optim.lr_scheduler.StepLR(ref, step_size=1, gamma=0.5)
    assert torch.equal(_train(model, opt), _train(ref_model, ref))
    scheduler.step()                            # after a real step: no warning (an error here)


def test_sparse_embeddings_of_the_model_get_sparse_zero_gradients(alone):
    model = _Embeddings()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_model = _Embeddings()
    ref = torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9)
    hvd.broadcast_optimizer_state(opt, 0, model)            # Horovod's third argument
    grad = model.emb.weight.grad
    assert grad.is_sparse and grad.sparse_dim() == 1 and grad._nnz() == 0
    x, _ = _batch(0)
    model(x).sum().backward()                   # sparse gradients accumulate as sparse
    assert model.emb.weight.grad.is_sparse
    assert torch.equal(_train(model, opt), _train(ref_model, ref))


def test_distributed_optimizer_state_is_created_on_the_wrapped_optimizer(alone):
    model = _Mlp()
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01,
                                                    weight_decay=0.1),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert len(opt.optimizer.state) == 4
    assert all(float(s["step"]) == 0 for s in opt.optimizer.state.values())
    assert hvd.broadcast(model.fc1.weight.grad, 0).abs().sum() == 0   # the script
    ref_model = _Mlp()
    ref = torch.optim.Adam(ref_model.parameters(), lr=0.01, weight_decay=0.1)
    assert torch.equal(_train(model, opt), _train(ref_model, ref))


class _Broken(torch.optim.SGD):
    def step(self, closure=None):
        super().step(closure)
        raise ArithmeticError("no state for you")


def test_a_failing_zero_step_raises_and_leaves_parameters_and_settings(alone):
    model = _Mlp()
    opt = _Broken(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.5)
    params = [p.detach().clone() for p in model.parameters()]
    settings = _settings(opt)
    with pytest.raises(ArithmeticError, match="no state for you"):
        hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), params))
    assert _settings(opt) == settings


def test_bad_arguments_are_type_errors(alone):
    model = _Mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="Optimizer"):
        hvd.broadcast_optimizer_state(model, 0)
    with pytest.raises(TypeError, match="process_set="):   # hora's old third argument
        hvd.broadcast_optimizer_state(opt, 0, hvd.global_process_set)
    with pytest.raises(TypeError, match="Module"):
        hvd.broadcast_optimizer_state(opt, 0, model=[1])


def test_broadcast_parameters_takes_a_list_of_tensors(alone):
    model = _Mlp()
    before = [p.detach().clone() for p in model.parameters()]
    hvd.broadcast_parameters(list(model.parameters()), root_rank=0)   # Horovod allows it
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    with pytest.raises(ValueError, match="item 1 is a str"):
        hvd.broadcast_parameters([model.fc1.weight, "fc2"], root_rank=0)


def _sparse(rows, cols, seed):
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(rows, cols, generator=g)
    dense[torch.rand(rows, generator=g) < 0.6] = 0
    return dense.to_sparse(1)


def test_sparse_allreduce_async_checks_its_arguments(alone):
    t = _sparse(6, 3, 0)
    with pytest.raises(TypeError, match="sparse COO"):
        hvd.sparse_allreduce_async(t.to_dense(), "dense", hvd.Sum)
    with pytest.raises(TypeError, match="Tensor"):
        hvd.sparse_allreduce_async([1.0], "list", hvd.Sum)
    for op in (hvd.Min, hvd.Max, hvd.Product, hvd.Adasum):
        with pytest.raises(ValueError, match="Average or Sum"):
            hvd.sparse_allreduce_async(t, "op", op)
    with pytest.raises(TypeError, match="torch.int64"):
        hvd.sparse_allreduce_async(t.to_dense().long().to_sparse(), "int", hvd.Average)
    # one rank: the result is the input, coalesced, whichever way the handle is waited on
    handle = hvd.sparse_allreduce_async(torch.cat([t, t]).coalesce().narrow_copy(0, 0, 6),
                                        "same", None)
    assert hvd.poll(handle) in (True, False)
    out = hvd.synchronize(handle)
    assert out.is_sparse and out.is_coalesced() and torch.equal(out.to_dense(), t.to_dense())
    assert handle() is out
    summed = hvd.sparse_allreduce_async(t.long(), "int sum", hvd.Sum)()
    assert summed.dtype == torch.int64 and torch.equal(summed.to_dense(), t.to_dense().long())


def test_distributed_optimizer_keeps_horovods_attributes(alone):
    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(6)])
    groups = [{"params": list(model[:5].parameters())}, {"params": list(model[5].parameters())}]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(groups, lr=0.1),
                                   backward_passes_per_step=3, op=hvd.Sum,
                                   sparse_as_dense=True, groups=2)
    # Horovod's naming: allreduce.noname.<group>.<index>, the dict in sorted-name order
    names = [f"allreduce.noname.0.{j}" for j in range(10)] + ["allreduce.noname.1.0",
                                                              "allreduce.noname.1.1"]
    assert list(opt._parameter_names.values()) == sorted(names)
    params = [p for g in opt.param_groups for p in g["params"]]
    assert [opt._parameter_names[p] for p in params] == names
    assert (opt.backward_passes_per_step, opt.op, opt.gradient_predivide_factor,
            opt.sparse_as_dense, opt.process_set, opt._groups) == \
        (3, hvd.Sum, 1.0, True, hvd.global_process_set, 2)
    # one rank: like Horovod, no hooks, nothing to reduce
    assert opt._requires_update == set() and opt._handles == {} and opt._grad_accs == []
    assert (opt._synchronized, opt._should_synchronize) == (False, True)

    # named: the names as given; a tensor named twice keeps the last name in sorted order
    tied = torch.nn.Linear(2, 2)
    named = [("b.weight", tied.weight), ("a.weight", tied.weight), ("a.bias", tied.bias)]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(tied.parameters(), lr=0.1),
                                   named_parameters=named)
    assert opt._parameter_names == {tied.bias: "a.bias", tied.weight: "b.weight"}
    assert list(opt._parameter_names.values()) == ["a.bias", "b.weight"]
