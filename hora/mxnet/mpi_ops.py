"""Horovod's collectives on MXNet ``NDArray``\\ s, on hora's core.

The names, arguments and defaults are ``horovod.mxnet``'s.  Each call converts: the array
becomes a NumPy array of its dtype (``asnumpy()``, which waits for MXNet's engine to finish
writing it), hora's core runs the collective, and the result comes back as an ``NDArray`` of
the input's dtype on the input's context (an ``mx.np.ndarray`` for one).  The in-place forms
(``allreduce_``, ``grouped_allreduce_``, ``broadcast_``) write the result into their argument
and return it.  ``priority`` is accepted and ignored: hora's engine orders collectives by
when every rank has submitted them.

A collective whose shapes, dtypes or ops differ between ranks raises hora's
``CollectiveMismatchError`` on every rank; a bad argument raises ``TypeError``/``ValueError``
on its rank and ``CollectiveAbortedError`` on the others (see :mod:`hora.core.ops`).

Layer: mxnet (a binding: it converts arrays and never touches a socket).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import mxnet as mx
import numpy as np

from .. import core
from ..core import messages
# Horovod's mpi_ops carries the job's basics too: scripts import size, rank, init from it
from ..core.basics import *  # noqa: F401,F403
from ..core.process_sets import ProcessSet, global_process_set
from .compression import Compression

__all__ = [
    "Average", "Sum", "Adasum", "Min", "Max", "Product", "Compression",
    "allreduce", "allreduce_", "grouped_allreduce", "grouped_allreduce_", "allgather",
    "grouped_allgather", "broadcast", "broadcast_", "alltoall", "reducescatter",
    "grouped_reducescatter", "barrier", "join",
]

Average, Sum, Adasum = messages.Average, messages.Sum, messages.Adasum
Min, Max, Product = messages.Min, messages.Max, messages.Product


# -- conversion ----------------------------------------------------------------------------
def to_numpy(tensor: Any, what: str) -> np.ndarray:
    """``tensor``'s values as a NumPy array of its dtype (TypeError for a non-NDArray)."""
    if not isinstance(tensor, mx.nd.NDArray):
        raise TypeError(f"{what}: expected an mx.nd.NDArray, got {type(tensor).__name__}")
    if tensor.stype != "default":
        raise TypeError(f"{what}: sparse arrays ({tensor.stype}) are not supported")
    return tensor.asnumpy()


def like(values: np.ndarray, tensor: Any, dtype: Any = None) -> Any:
    """``values`` as an array of ``tensor``'s kind, dtype (or ``dtype``) and context."""
    dtype = tensor.dtype if dtype is None else dtype
    make = mx.np.array if isinstance(tensor, mx.np.ndarray) else mx.nd.array
    return make(np.asarray(values, dtype=dtype), ctx=tensor.context, dtype=dtype)


def write(tensor: Any, values: Any) -> Any:
    """Copy ``values`` (a NumPy array or an NDArray of ``tensor``'s size) into ``tensor`` and
    return ``tensor``."""
    if isinstance(values, mx.nd.NDArray):
        tensor[:] = values.astype(tensor.dtype, copy=False).reshape(tensor.shape)
    else:
        # a synchronous copy into the array's memory: half the time of ``tensor[:] = ...``,
        # whose indexing machinery is the same copy behind several checks
        tensor._sync_copyfrom(np.asarray(values, dtype=tensor.dtype).reshape(tensor.shape))
    return tensor


def _ps(process_set: Optional[ProcessSet]) -> ProcessSet:
    return global_process_set if process_set is None else process_set


# -- allreduce -----------------------------------------------------------------------------
def _reduce(tensors, average, name, prescale_factor, postscale_factor, process_set, op, what):
    arrays = [to_numpy(t, what) for t in tensors]
    if what.startswith("allreduce"):
        return [core.allreduce(arrays[0], op, name, prescale_factor, postscale_factor, average,
                               process_set=_ps(process_set))]
    return core.grouped_allreduce(arrays, op, name, prescale_factor, postscale_factor,
                                  average, process_set=_ps(process_set))


def allreduce(tensor: Any, average: Optional[bool] = None, name: Optional[str] = None,
              priority: int = 0, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set, op: Optional[int] = None) -> Any:
    """Average (default) or reduce ``tensor`` over the ranks; returns a new array.

    Args:
        tensor: an NDArray (same shape and dtype on every rank).
        average: deprecated (Horovod's); True means Average, False Sum.
        name: names the collective (the same on every rank); automatic when None.
        priority: accepted for Horovod's callers; hora ignores it.
        prescale_factor, postscale_factor: multiply before / after the reduction.
        process_set: reduce among its ranks only.
        op: Average (default), Sum, Min, Max or Product.

    Example:
        >>> total = hvd.allreduce(mx.nd.ones(3), op=hvd.Sum)    # size() everywhere
    """
    out = _reduce([tensor], average, name, prescale_factor, postscale_factor, process_set,
                  op, "allreduce")[0]
    return like(out, tensor)


def allreduce_(tensor: Any, average: Optional[bool] = None, name: Optional[str] = None,
               priority: int = 0, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set, op: Optional[int] = None) -> Any:
    """In-place :func:`allreduce`: the result is written into ``tensor``, which is
    returned."""
    out = _reduce([tensor], average, name, prescale_factor, postscale_factor, process_set,
                  op, "allreduce_")[0]
    return write(tensor, out)


def grouped_allreduce(tensors: Sequence[Any], average: Optional[bool] = None,
                      name: Optional[str] = None, priority: int = 0,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set,
                      op: Optional[int] = None) -> list[Any]:
    """Reduce a list of arrays as one collective; returns new arrays.  As
    :func:`allreduce`."""
    outs = _reduce(list(tensors), average, name, prescale_factor, postscale_factor,
                   process_set, op, "grouped_allreduce")
    return [like(o, t) for o, t in zip(outs, tensors)]


def grouped_allreduce_(tensors: Sequence[Any], average: Optional[bool] = None,
                       name: Optional[str] = None, priority: int = 0,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set,
                       op: Optional[int] = None) -> list[Any]:
    """In-place :func:`grouped_allreduce`: each result is written into its array."""
    outs = _reduce(list(tensors), average, name, prescale_factor, postscale_factor,
                   process_set, op, "grouped_allreduce_")
    return [write(t, o) for o, t in zip(outs, tensors)]


# -- allgather, broadcast, alltoall, reducescatter -----------------------------------------
def allgather(tensor: Any, name: Optional[str] = None, priority: int = 0,
              process_set: ProcessSet = global_process_set) -> Any:
    """Every rank's ``tensor`` concatenated along the first dimension, in rank order (the
    first dimension may differ by rank)."""
    return like(core.allgather(to_numpy(tensor, "allgather"), name,
                               process_set=_ps(process_set)), tensor)


def grouped_allgather(tensors: Sequence[Any], name: Optional[str] = None, priority: int = 0,
                      process_set: ProcessSet = global_process_set) -> list[Any]:
    """Allgather each array of a list, as one collective."""
    outs = core.grouped_allgather([to_numpy(t, "grouped_allgather") for t in tensors], name,
                                  process_set=_ps(process_set))
    return [like(o, t) for o, t in zip(outs, tensors)]


def broadcast(tensor: Any, root_rank: int, name: Optional[str] = None, priority: int = 0,
              process_set: ProcessSet = global_process_set) -> Any:
    """``root_rank``'s ``tensor``, on every rank; returns a new array."""
    return like(core.broadcast(to_numpy(tensor, "broadcast"), root_rank, name,
                               process_set=_ps(process_set)), tensor)


def broadcast_(tensor: Any, root_rank: int, name: Optional[str] = None, priority: int = 0,
               process_set: ProcessSet = global_process_set) -> Any:
    """In-place :func:`broadcast`: ``root_rank``'s values are written into ``tensor``."""
    return write(tensor, core.broadcast(to_numpy(tensor, "broadcast_"), root_rank, name,
                                        process_set=_ps(process_set)))


def alltoall(tensor: Any, splits: Any = None, name: Optional[str] = None, priority: int = 0,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send ``splits[i]`` rows of ``tensor`` (in order) to rank i of the set and return the
    rows received, in rank order.  Without ``splits`` the first dimension is split evenly;
    with them the result is ``(received, received_splits)`` (an int32 NDArray on the CPU),
    as in Horovod."""
    if isinstance(splits, mx.nd.NDArray):
        splits = splits.asnumpy()
    received, counts = core.alltoall(to_numpy(tensor, "alltoall"), splits, name,
                                     process_set=_ps(process_set))
    out = like(received, tensor)
    if splits is None:
        return out
    return out, mx.nd.array(np.asarray(counts), ctx=mx.cpu(), dtype="int32")


def reducescatter(tensor: Any, op: int = Average, name: Optional[str] = None,
                  priority: int = 0, process_set: ProcessSet = global_process_set,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Any:
    """This rank's block of the reduction (Average or Sum) of every rank's ``tensor``
    along the first dimension (the first ``rows % size`` ranks get one extra row)."""
    return like(core.reducescatter(to_numpy(tensor, "reducescatter"), op, name,
                                   prescale_factor, postscale_factor,
                                   process_set=_ps(process_set)), tensor)


def grouped_reducescatter(tensors: Sequence[Any], op: int = Average,
                          name: Optional[str] = None, priority: int = 0,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[Any]:
    """Reducescatter each array of a list, as one collective."""
    outs = core.grouped_reducescatter([to_numpy(t, "grouped_reducescatter") for t in tensors],
                                      op, name, prescale_factor, postscale_factor,
                                      process_set=_ps(process_set))
    return [like(o, t) for o, t in zip(outs, tensors)]


# -- barrier, join -------------------------------------------------------------------------
def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Return once every rank of ``process_set`` has reached the barrier."""
    core.barrier(process_set=_ps(process_set))


def join() -> int:
    """This rank has no more data: until every rank has joined it takes part in the others'
    allreduces with zeros.  Returns the last rank to join."""
    return core.join()
