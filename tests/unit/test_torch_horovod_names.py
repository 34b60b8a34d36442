"""Every public name of ``horovod.torch`` exists in ``hora.torch`` with Horovod's signature
(parameter names, order, kinds and defaults), or raises ``NotImplementedError`` saying what
to use instead.

The list below was written by hand from Horovod's source at commit
2626dc87a3a8eb8fb7d2216198ce45bce0f9e65a (2026-06-20): the names that
``horovod/torch/__init__.py`` imports, with their signatures from
``horovod/torch/mpi_ops.py``, ``functions.py``, ``optimizer.py``, ``compression.py``,
``sync_batch_norm.py``, ``elastic/__init__.py`` (``elastic/state.py``,
``elastic/sampler.py``), ``horovod/common/basics.py`` and
``horovod/common/process_sets.py`` (``docs/api.rst`` documents ``horovod.torch`` with
``automodule``, i.e. these same names).  ``horovod.torch.init`` and ``shutdown`` are
``(*args, **kwargs)`` wrappers: their list entries are the signatures of the
``HorovodBasics`` methods they forward to.
"""
import ast
import inspect

import pytest
import torch

import hora.torch as hvd

pytestmark = pytest.mark.timeout(60)

_OPS = "prescale_factor=1.0, postscale_factor=1.0"
_SET = "process_set=global_process_set"
HOROVOD = {
    # horovod/common/basics.py (through horovod/torch/mpi_ops.py)
    "init": "comm=None, process_sets=None",
    "shutdown": "",
    "is_initialized": "",
    "start_timeline": "file_path, mark_cycles=False",
    "stop_timeline": "",
    **{name: "" for name in (
        "size", "local_size", "cross_size", "rank", "local_rank", "cross_rank",
        "is_homogeneous", "mpi_threads_supported", "mpi_enabled", "mpi_built",
        "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built",
        "rocm_built")},
    # horovod/common/process_sets.py
    "add_process_set": "process_set",
    "remove_process_set": "process_set",
    # horovod/torch/mpi_ops.py
    "allreduce": f"tensor, average=None, name=None, compression=Compression.none, op=None, "
                 f"{_OPS}, {_SET}",
    "allreduce_async": f"tensor, average=None, name=None, op=None, {_OPS}, {_SET}",
    "allreduce_": f"tensor, average=None, name=None, op=None, {_OPS}, {_SET}",
    "allreduce_async_": f"tensor, average=None, name=None, op=None, {_OPS}, {_SET}",
    "grouped_allreduce": f"tensors, average=None, name=None, compression=Compression.none, "
                         f"op=None, {_OPS}, {_SET}",
    "grouped_allreduce_async": f"tensors, average=None, name=None, op=None, {_OPS}, {_SET}",
    "grouped_allreduce_": f"tensors, average=None, name=None, op=None, {_OPS}, {_SET}",
    "grouped_allreduce_async_": f"tensors, average=None, name=None, op=None, {_OPS}, {_SET}",
    "sparse_allreduce_async": f"tensor, name, op, {_SET}",
    "allgather": f"tensor, name=None, {_SET}",
    "allgather_async": f"tensor, name=None, {_SET}",
    "grouped_allgather": f"tensors, name=None, {_SET}",
    "grouped_allgather_async": f"tensors, name=None, {_SET}",
    "broadcast": f"tensor, root_rank, name=None, {_SET}",
    "broadcast_async": f"tensor, root_rank, name=None, {_SET}",
    "broadcast_": f"tensor, root_rank, name=None, {_SET}",
    "broadcast_async_": f"tensor, root_rank, name=None, {_SET}",
    "alltoall": f"tensor, splits=None, name=None, {_SET}",
    "alltoall_async": f"tensor, splits=None, name=None, {_SET}",
    "reducescatter": f"tensor, name=None, compression=Compression.none, op=Average, {_SET}, "
                     f"{_OPS}",
    "reducescatter_async": f"tensor, name=None, op=Average, {_SET}, {_OPS}",
    "grouped_reducescatter": f"tensors, name=None, compression=Compression.none, op=Average, "
                             f"{_SET}, {_OPS}",
    "grouped_reducescatter_async": f"tensors, name=None, op=Average, {_SET}, {_OPS}",
    "join": "device=-1",
    "barrier": _SET,
    "poll": "handle",
    "synchronize": "handle",
    # horovod/torch/functions.py
    "broadcast_parameters": "params, root_rank",
    "broadcast_optimizer_state": "optimizer, root_rank, model=None",
    "broadcast_object": f"obj, root_rank=0, name=None, {_SET}",
    "allgather_object": "obj, name=None",
    # horovod/torch/optimizer.py (a function there; a class here: its __init__)
    "DistributedOptimizer": f"optimizer, named_parameters=None, "
                            f"compression=Compression.none, backward_passes_per_step=1, "
                            f"op=Average, gradient_predivide_factor=1.0, num_groups=0, "
                            f"groups=None, sparse_as_dense=False, {_SET}",
    # horovod/torch/sync_batch_norm.py
    "SyncBatchNorm": "num_features, eps=1e-5, momentum=0.1, affine=True, "
                     "track_running_stats=True",
    # horovod/common/process_sets.py
    "ProcessSet": "ranks_or_comm",
}

# what hora adds after Horovod's parameters (each with a default, so that every call
# written for Horovod means the same here)
EXTRA = {
    "broadcast_parameters": ["process_set"],
    "broadcast_optimizer_state": ["process_set"],
    "allgather_object": ["process_set"],
    "SyncBatchNorm": ["process_set"],
}

# DistributedOptimizer's methods (horovod/torch/optimizer.py, _DistributedOptimizer)
METHODS = {
    "synchronize": "",
    "skip_synchronize": "",
    "step": "closure=None",
    "zero_grad": "",
    "set_backward_passes_per_step": "passes",
}
METHOD_EXTRA = {"zero_grad": ["set_to_none"]}      # torch's own parameter

VALUES = ["Average", "Sum", "Adasum", "Min", "Max", "Product", "global_process_set",
          "HorovodInternalError", "Compression"]

# core owns ProcessSet; its parameter is still named ``ranks`` (see the report of the
# change that added this test)
def _expected(spec):
    """``spec`` (Python parameter syntax) as [(name, has_default, default value)]."""
    args = ast.parse(f"def f({spec}): pass").body[0].args
    names = [a.arg for a in args.args]
    defaults = [None] * (len(names) - len(args.defaults)) + list(args.defaults)
    scope = vars(hvd)
    return [(n, d is not None, eval(compile(ast.Expression(d), "<spec>", "eval"), scope)
             if d is not None else None) for n, d in zip(names, defaults)]


def _check(label, params, spec, extra):
    want = _expected(spec)
    got = [p for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    names = [p.name for p in got]
    assert names[:len(want)] == [w[0] for w in want], \
        f"{label}: parameters {names}, Horovod's {[w[0] for w in want]}"
    assert names[len(want):] == extra, f"{label}: parameters beyond Horovod's: " \
                                       f"{names[len(want):]}, expected {extra}"
    for p, (name, has_default, default) in zip(got, want):
        assert p.kind in (p.POSITIONAL_OR_KEYWORD, p.POSITIONAL_ONLY), \
            f"{label}({name}) cannot be passed by position"
        if not has_default:
            assert p.default is inspect.Parameter.empty, f"{label}({name}) has a default"
        else:
            assert p.default is default or (type(p.default) is type(default)
                                            and p.default == default), \
                f"{label}({name}={p.default!r}), Horovod's default is {default!r}"
    for p in got[len(want):]:
        assert p.default is not inspect.Parameter.empty, f"{label}({p.name}) needs a default"


@pytest.mark.parametrize("name", sorted(HOROVOD))
def test_each_horovod_name_has_horovods_signature(name):
    assert hasattr(hvd, name), f"hora.torch has no {name}"
    obj = getattr(hvd, name)
    target = obj.__init__ if inspect.isclass(obj) else obj
    params = list(inspect.signature(target).parameters.values())
    if inspect.isclass(obj):
        params = params[1:]                                  # self
    _check(name, params, HOROVOD[name], EXTRA.get(name, []))


def test_distributed_optimizer_methods_have_horovods_signatures():
    for name, spec in METHODS.items():
        params = list(inspect.signature(getattr(hvd.DistributedOptimizer, name))
                      .parameters.values())[1:]
        _check(f"DistributedOptimizer.{name}", params, spec, METHOD_EXTRA.get(name, []))


def test_values_and_submodules_exist():
    for name in VALUES:
        assert hasattr(hvd, name), name
    assert issubclass(hvd.HorovodInternalError, RuntimeError)
    assert (hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max, hvd.Product) == tuple(range(6))
    assert hvd.Compression.none.compress(torch.ones(1))[1] is None
    assert {"sparse_allreduce_async", "elastic"} <= set(hvd.__all__)
    assert all(hasattr(hvd, name) for name in hvd.__all__)
    for module in ("mpi_ops", "functions", "optimizer", "compression", "sync_batch_norm",
                   "elastic"):
        assert inspect.ismodule(getattr(hvd, module)), module


def test_elastic_names_have_horovods_signatures():
    _check("elastic.run", list(inspect.signature(hvd.elastic.run).parameters.values()),
           "func", [])
    _check("elastic.TorchState",
           list(inspect.signature(hvd.elastic.TorchState.__init__).parameters.values())[1:],
           "model=None, optimizer=None", [])
    _check("elastic.ElasticSampler",
           list(inspect.signature(hvd.elastic.ElasticSampler.__init__).parameters.values())[1:],
           "dataset, shuffle=True, seed=0", [])
    # outside an elastic job, run() calls the function once, after syncing the state
    calls = []

    @hvd.elastic.run
    def train(state, step):
        calls.append(step)
        return step * 2

    assert train(hvd.elastic.ObjectState(lambda obj: obj, lambda: 0, epoch=0), 21) == 42
    assert calls == [21] and train.__name__ == "train"
    # the states and the sampler work (tests/unit/test_elastic_state.py tests them)
    state = hvd.elastic.TorchState(model=None, optimizer=None, epoch=0)
    assert (state.model, state.optimizer, state.epoch) == (None, None, 0)
    assert issubclass(hvd.elastic.ElasticSampler, torch.utils.data.Sampler)


def test_public_functions_have_type_hints():
    skip = {"Average", "Sum", "Adasum", "Min", "Max", "Product", "global_process_set",
            "elastic", "HorovodInternalError", "HoraInternalError", "HoraError", "Compression",
            "ProcessSet", "SyncBatchNorm", "DistributedOptimizer",
            # re-exported from hora.core, which types its own API
            "init", "shutdown", "is_initialized", "size", "local_size", "cross_size", "rank",
            "local_rank", "cross_rank", "is_homogeneous", "add_process_set",
            "remove_process_set"}
    for name in sorted(set(hvd.__all__) - skip):
        sig = inspect.signature(getattr(hvd, name))
        assert sig.return_annotation is not inspect.Signature.empty, f"{name}: no return type"
        for p in sig.parameters.values():
            assert p.annotation is not inspect.Parameter.empty, f"{name}({p.name}): no type"
    for cls in (hvd.DistributedOptimizer, hvd.SyncBatchNorm):
        sig = inspect.signature(cls.__init__)
        assert all(p.annotation is not inspect.Parameter.empty
                   for p in list(sig.parameters.values())[1:]), cls.__name__
