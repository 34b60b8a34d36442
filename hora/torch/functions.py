"""Broadcasting model state and Python objects, with Horovod's names.  Layer: torch."""
import collections

import torch

from .. import core
from ..core.process_sets import global_process_set
from .mpi_ops import broadcast_async_, synchronize

__all__ = ["broadcast_parameters", "broadcast_object", "allgather_object"]


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


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """``root_rank``'s ``obj`` (anything cloudpickle can serialise), on every rank."""
    return core.broadcast_object(obj, root_rank, name, process_set=process_set)


def allgather_object(obj, name=None, process_set=global_process_set):
    """The list of every rank's ``obj``, in rank order."""
    return core.allgather_object(obj, name, process_set=process_set)
