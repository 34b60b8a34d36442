"""Broadcasting model state and Python objects, with Horovod's names.  Layer: torch."""
from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from .. import core
from ..core.objects import allow_objects
from ..core.process_sets import ProcessSet, global_process_set
from .mpi_ops import allreduce, broadcast_async_, synchronize
from .optimizer import DistributedOptimizer

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object",
           "allgather_object", "average_metrics"]


def average_metrics(values: Mapping[str, Any], name: str = "average_metrics",
                    process_set: ProcessSet = global_process_set) -> dict[str, Any]:
    """Average scalar metrics over the ranks in one allreduce (what Horovod scripts do by
    hand, one ``allreduce`` a metric).

    Every rank passes the same keys.  A value is a number or a tensor of one element; the
    result has the same keys, a Python float for a number and a tensor of the input's dtype
    and device for a tensor.

    Example::

        logs = hvd.average_metrics({"loss": loss.detach(), "accuracy": correct / total})
        if hvd.rank() == 0:
            print(logs)

    Raises:
        ValueError: a value with more than one element (the key is named).
    """
    keys = sorted(values)
    flat = []
    for key in keys:
        value = values[key]
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(f"average_metrics: {key!r} has {value.numel()} elements; "
                                 f"a metric is one number")
            flat.append(float(value.detach().reshape(()).to("cpu", torch.float64)))
        else:
            flat.append(float(value))
    mean = allreduce(torch.tensor(flat, dtype=torch.float64), name=name,
                     process_set=process_set)
    out = {}
    for i, key in enumerate(keys):
        value = values[key]
        if isinstance(value, torch.Tensor):
            out[key] = mean[i].to(value.device, value.dtype).reshape(value.shape)
        else:
            out[key] = float(mean[i])
    return out


def broadcast_parameters(params: Mapping[str, torch.Tensor]
                         | Iterable[tuple[str, torch.Tensor] | torch.Tensor],
                         root_rank: int, process_set: ProcessSet = global_process_set) -> None:
    """Overwrite every rank's parameters with ``root_rank``'s, in place.

    Args:
        params: ``model.state_dict()``, ``model.named_parameters()``, a list of
            ``(name, tensor)`` pairs, or a list of tensors such as
            ``list(model.parameters())`` (named by position).  Names, and the list's
            order, must be the same on every rank.
        root_rank: the rank whose values win.
        process_set: copy among the ranks of this process set only.

    Raises:
        ValueError: ``params`` is neither a dict nor an iterable of tensors or
            ``(name, tensor)`` pairs.

    Example:
        >>> hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    """
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, collections.abc.Iterable) and not isinstance(params, torch.Tensor):
        items = []
        for i, p in enumerate(params):
            if isinstance(p, torch.Tensor):          # Horovod takes model.parameters() too
                items.append((f"#{i}", p))
            elif isinstance(p, tuple) and len(p) == 2:
                items.append(p)
            else:
                raise ValueError(f"broadcast_parameters expects a state_dict, (name, tensor) "
                                 f"pairs such as model.named_parameters(), or tensors; item "
                                 f"{i} is a {type(p).__name__}")
    else:
        raise ValueError(f"invalid params of type {type(params).__name__}")
    handles = []
    for name, p in items:
        if p is None or not isinstance(p, torch.Tensor):
            continue
        if isinstance(p, torch.nn.Parameter) or p.requires_grad:
            p = p.data
        handles.append(broadcast_async_(p, root_rank, name=f"broadcast.param.{name}",
                                        process_set=process_set))
    for h in handles:
        synchronize(h)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              model: torch.nn.Module | None = None,
                              process_set: ProcessSet = global_process_set) -> None:
    """Make every rank's optimizer state and hyperparameters equal to ``root_rank``'s.

    Everything in ``optimizer.state_dict()`` is copied: per-parameter state (tensors such as
    Adam's moments, and plain values such as an int ``step``, kept with their types) and
    each param group's settings (``lr``, ``betas``, ... including values a scheduler changed
    on the root only).  Tensors travel as in-place broadcasts, the rest as one pickled
    object.  Works for any ``torch.optim`` optimizer (L-BFGS included) and for a
    :class:`DistributedOptimizer`.

    A fresh optimizer (the root's state is empty: torch creates it on the first
    ``step()``) gets its state created first, as Horovod does it, by one step with zero
    gradients.  Afterwards every parameter that requires a gradient has a zero ``.grad``
    (sparse for ``SparseAdam``, and for the sparse embeddings of ``model``) on every rank;
    the others keep ``.grad`` None.  Unlike Horovod's, that step changes nothing else: the
    parameters (which weight decay would move), the hyperparameters, the step counters
    (``step``, so Adam's bias correction starts as a fresh optimizer's) and what LR
    schedulers and step hooks see are as before it, so training continues exactly as a
    fresh optimizer would.

    Args:
        optimizer: the optimizer (or ``DistributedOptimizer``) to overwrite, on every rank.
        root_rank: the rank whose state wins.
        model: optional, as in Horovod: the parameters of its sparse ``nn.Embedding`` /
            ``nn.EmbeddingBag`` layers get sparse zero gradients (with ``SGD`` and
            ``Adagrad``, which take either), so that sparse gradients keep accumulating as
            sparse ones.
        process_set: copy among the ranks of this process set only.

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``, or ``model`` not a
            ``torch.nn.Module``.
        RuntimeError: the root could not create the state (the error is raised on every
            rank).

    Example:
        >>> hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        >>> hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    """
    _check_optimizer_args(optimizer, model, process_set)
    if not process_set.included():
        return
    inner = optimizer.optimizer if isinstance(optimizer, DistributedOptimizer) else optimizer
    is_root = core.rank() == root_rank
    tensors: list[torch.Tensor] = []
    skeleton, failure = (_root_skeleton(optimizer, inner, model, tensors) if is_root
                         else (None, None))
    fresh, message, skeleton = broadcast_object(skeleton, root_rank,
                                                name="broadcast_optimizer_state",
                                                process_set=process_set)
    if failure is not None:
        raise failure
    if message is not None:
        raise RuntimeError(f"broadcast_optimizer_state: rank {root_rank} could not create "
                           f"the optimizer's state: {message}")
    if not is_root:
        if fresh:
            _zero_grads(inner, model)       # as on the root; its state arrives below
        # the walk visits the slots in the order the root made them: tensors line up
        state_dict = _swap(skeleton, _from_slot, tensors)
    handles = [broadcast_async_(t, root_rank, name=f"broadcast_optimizer_state.{i}",
                                process_set=process_set)
               for i, t in enumerate(tensors)]
    for h in handles:
        synchronize(h)
    if not is_root:
        # load_state_dict moves each tensor to its parameter's device and dtype
        optimizer.load_state_dict(state_dict)


def _check_optimizer_args(optimizer, model, process_set):
    """TypeError for what is not an optimizer or a model, and for a process set passed
    positionally, where Horovod's signature has ``model``."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"broadcast_optimizer_state expects a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    if isinstance(model, ProcessSet) and process_set is global_process_set:
        raise TypeError("broadcast_optimizer_state: the third argument is Horovod's model; "
                        "pass the process set as process_set=...")
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"broadcast_optimizer_state: model must be a torch.nn.Module, got "
                        f"{type(model).__name__}")


def _root_skeleton(optimizer, inner, model, tensors):
    """The root's side: ``(skeleton, failure)``, after creating a fresh optimizer's state.

    The skeleton ``(fresh, message, state)`` is the one object the other ranks get:
    ``state`` is ``optimizer.state_dict()`` with a slot for each dense tensor, which is
    appended to ``tensors`` to be broadcast in place.  When the state cannot be created,
    ``message`` says why and ``state`` is None, so that every rank raises, and ``failure``
    is the error itself, for the root to raise."""
    failure = None
    fresh = not inner.state_dict()["state"]
    if fresh:
        try:
            _create_state(inner, model)
        except Exception as e:  # noqa: BLE001 - the caller raises it, after telling the others
            failure = e
    message = None if failure is None else f"{type(failure).__name__}: {failure}"
    skeleton = (fresh, message,
                None if failure else _swap(optimizer.state_dict(), _to_slot, tensors))
    return skeleton, failure


# -- creating a fresh optimizer's state --------------------------------------------------------
def _zero_grads(optimizer, model):
    """Give every parameter that requires a gradient a zero one, of the layout its
    optimizer takes (Horovod's rule): in place where a dense gradient is there already,
    which keeps a DistributedOptimizer's bucket views."""
    sparse_ids = set()
    if model is not None and isinstance(optimizer, _SPARSE_CAPABLE):
        for m in model.modules():
            if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse:
                sparse_ids.update(id(p) for p in m.parameters())
    all_sparse = isinstance(optimizer, torch.optim.SparseAdam)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not p.requires_grad:
                continue
            if all_sparse or id(p) in sparse_ids:
                # an embedding's layout (row indices), which its gradients add up with
                p.grad = torch.zeros_like(p).to_sparse(min(1, p.dim()))
            elif p.grad is not None and not p.grad.is_sparse and p.grad.shape == p.shape:
                if p.grad.grad_fn is not None:          # as torch's zero_grad does
                    p.grad.detach_()
                else:
                    p.grad.requires_grad_(False)
                p.grad.zero_()
            else:
                p.grad = torch.zeros_like(p)


_SPARSE_CAPABLE = (torch.optim.SGD, torch.optim.Adagrad, torch.optim.SparseAdam)


def _create_state(optimizer, model):
    """Create ``optimizer``'s state with one step on zero gradients, as Horovod does, and
    leave nothing else changed: weight decay is off for that step (restored after it, with
    every other setting), the parameters are put back and the step counters reset."""
    _zero_grads(optimizer, model)
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    with torch.no_grad():
        saved = [p.detach().clone() for p in params]
    settings = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        if "weight_decay" in g:
            # weight decay adds wd * p to the zero gradient: the moments it creates (Adam's,
            # RMSprop's, ...) would not be zeros, as a fresh optimizer's are
            g["weight_decay"] = 0.0
    try:
        _bare_step(optimizer)
    finally:
        with torch.no_grad():
            for p, value in zip(params, saved):
                p.copy_(value)
        for g, kept in zip(optimizer.param_groups, settings):
            g.update(kept)
    _as_fresh(optimizer)


def _bare_step(optimizer):
    """The optimizer's own ``step()``: not through the wrapper that runs the step hooks
    (a user's hook should not see this step), nor the one an LR scheduler adds to count
    steps (its warnings should not either)."""
    step = type(optimizer).step
    if getattr(step, "hooked", False):
        step = getattr(step, "__wrapped__", step)
    if isinstance(optimizer, torch.optim.LBFGS):
        # it needs a closure; a zero gradient ends its first iteration at once
        step(optimizer, lambda: torch.zeros(()))
    else:
        step(optimizer)


def _as_fresh(optimizer):
    """Set the counters that the zero step advanced back to a fresh optimizer's values, so
    the next step is computed as a fresh optimizer's first.  (The moments it created are
    zeros either way.)"""
    resets = {"step": lambda group, old: 0}
    if isinstance(optimizer, torch.optim.NAdam):
        resets["mu_product"] = lambda group, old: 1.0
    if isinstance(optimizer, torch.optim.ASGD):
        resets["eta"] = lambda group, old: group["lr"]
        resets["mu"] = lambda group, old: 1.0
    if isinstance(optimizer, torch.optim.LBFGS):
        resets["func_evals"] = resets["n_iter"] = lambda group, old: 0
    if isinstance(optimizer, torch.optim.SGD):
        # with dampening, the first step takes the gradient undamped: only when the
        # buffer is missing
        resets["momentum_buffer"] = lambda group, old: None if group["dampening"] else old
    for group in optimizer.param_groups:
        for p in group["params"]:
            st = optimizer.state.get(p)
            for key, fresh in resets.items():
                if st and key in st:
                    st[key] = _like(st[key], fresh(group, st[key]))


def _like(old, value):
    """``value`` in ``old``'s type: in place for a tensor, else int/float as ``old`` was."""
    if value is None or value is old:
        return value
    if isinstance(old, torch.Tensor):
        with torch.no_grad():
            return old.fill_(value)
    if isinstance(old, (bool, int, float)):
        return type(old)(value)
    return value


# stands for a tensor in the pickled skeleton of a state dict
_TensorSlot = collections.namedtuple("_TensorSlot", "shape dtype")

# a slot and torch's dtypes are data: they may travel even when the job's key is derivable
# and objects are decoded as plain data only (hora.core.ops.allow_objects)
allow_objects([_TensorSlot], {("torch", str(d).split(".")[-1]): d for d in vars(torch).values()
                              if isinstance(d, torch.dtype)})


def _to_slot(x, tensors):
    if not isinstance(x, torch.Tensor):
        return x
    if x.layout != torch.strided:
        # a sparse tensor (SGD's momentum for a sparse embedding) travels pickled; it
        # holds the rows touched only.  load_state_dict moves it to its parameter's device.
        return x.detach().cpu()
    tensors.append(x.detach())
    return _TensorSlot(tuple(x.shape), x.dtype)


def _from_slot(x, tensors):
    if not isinstance(x, _TensorSlot):
        return x
    tensors.append(torch.empty(x.shape, dtype=x.dtype))
    return tensors[-1]


def _swap(obj, leaf, tensors):
    """A copy of the dicts, lists and tuples in ``obj`` with ``leaf`` applied to the rest."""
    if type(obj) is dict:
        return {k: _swap(v, leaf, tensors) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_swap(v, leaf, tensors) for v in obj)
    return leaf(obj, tensors)      # other objects travel pickled as they are


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """``root_rank``'s ``obj`` (anything cloudpickle can serialise), on every rank."""
    return core.broadcast_object(obj, root_rank, name, process_set=process_set)


def allgather_object(obj: Any, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """The list of every rank's ``obj``, in rank order."""
    return core.allgather_object(obj, name, process_set=process_set)
