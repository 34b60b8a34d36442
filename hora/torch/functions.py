"""Broadcasting model state and Python objects, with Horovod's names.  Layer: torch."""
import collections

import torch

from .. import core
from ..core.process_sets import global_process_set
from .mpi_ops import broadcast_async_, synchronize

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object",
           "allgather_object"]


def broadcast_parameters(params, root_rank, process_set=global_process_set):
    """Overwrite every rank's parameters with ``root_rank``'s, in place.

    Args:
        params: ``model.state_dict()``, ``model.named_parameters()`` or a list of
            ``(name, tensor)`` pairs.  Names must be the same on every rank.
        root_rank: the rank whose values win.

    Example:
        >>> hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    """
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, collections.abc.Iterable):
        items = list(params)
        if items and not all(isinstance(p, tuple) and len(p) == 2 for p in items):
            raise ValueError("broadcast_parameters expects a state_dict or (name, tensor) "
                             "pairs such as model.named_parameters()")
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


def broadcast_optimizer_state(optimizer, root_rank, process_set=global_process_set):
    """Make every rank's optimizer state and hyperparameters equal to ``root_rank``'s.

    Everything in ``optimizer.state_dict()`` is copied: per-parameter state (tensors such as
    Adam's moments, and plain values such as an int ``step``, kept with their types) and
    each param group's settings (``lr``, ``betas``, ... including values a scheduler changed
    on the root only).  Tensors travel as in-place broadcasts, the rest as one pickled
    object.  Works for any ``torch.optim`` optimizer (L-BFGS included) and for a
    :class:`DistributedOptimizer`.

    State that the root has not created yet stays absent everywhere: torch optimizers
    create it on their first ``step()``, so after this call every rank starts exactly as the
    root would.  (Horovod instead runs a step with zero gradients to create it, which
    advances Adam's step count and applies weight decay once.)

    Args:
        optimizer: the optimizer (or ``DistributedOptimizer``) to overwrite, on every rank.
        root_rank: the rank whose state wins.
        process_set: copy among the ranks of this process set only.

    Example:
        >>> hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        >>> hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"broadcast_optimizer_state expects a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    if not process_set.included():
        return
    is_root = core.rank() == root_rank
    tensors = []
    skeleton = _swap(optimizer.state_dict(), _to_slot, tensors) if is_root else None
    skeleton = broadcast_object(skeleton, root_rank, name="broadcast_optimizer_state",
                                process_set=process_set)
    if not is_root:
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


# stands for a tensor in the pickled skeleton of a state dict
_TensorSlot = collections.namedtuple("_TensorSlot", "shape dtype")


def _to_slot(x, tensors):
    if not isinstance(x, torch.Tensor):
        return x
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


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """``root_rank``'s ``obj`` (anything cloudpickle can serialise), on every rank."""
    return core.broadcast_object(obj, root_rank, name, process_set=process_set)


def allgather_object(obj, name=None, process_set=global_process_set):
    """The list of every rank's ``obj``, in rank order."""
    return core.allgather_object(obj, name, process_set=process_set)
