"""Horovod's ``horovod.torch`` collectives on torch tensors, built on hora's core engine.

The binding only converts: a tensor becomes a NumPy array (a view of CPU memory; CUDA
tensors are staged through the host, bfloat16 through float32, which NumPy lacks), the core
engine runs the collective, and the result comes back as a tensor of the input's dtype and
device.  Where the engine has a device plane for a tensor's device (HORA_BACKEND=nccl: CUDA
tensors), an allreduce, broadcast or allgather of the global set hands it the tensor itself
instead (a device array), and the collective runs on the GPU.  Out-of-place ops are autograd
Functions with Horovod's gradients; ``*_`` ops write into their input.  Layer: torch.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Callable

import numpy as np
import torch

from .. import core
from ..core import messages, state
from ..core.ops import tell_peers, tells_peers
from ..core.ops import wait_now as _now
from ..core.process_sets import ProcessSet, global_process_set
from .basics import *  # noqa: F401,F403  (Horovod's mpi_ops carries the basics too)
from .compression import Compression, Compressor

__all__ = [
    "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "allgather", "allgather_async", "grouped_allgather",
    "grouped_allgather_async", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
    "grouped_reducescatter", "grouped_reducescatter_async", "sparse_allreduce_async", "poll",
    "synchronize", "join", "barrier",
]

Average, Sum, Adasum = messages.Average, messages.Sum, messages.Adasum
Min, Max, Product = messages.Min, messages.Max, messages.Product

_SUPPORTED = {torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
              torch.bfloat16, torch.float32, torch.float64, torch.bool}


# -- tensors <-> arrays ------------------------------------------------------------------------
def _check_tensor(tensor, what):
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(tensor).__name__}")


def _to_array(tensor, what, writable=False, process_set=None):
    """A NumPy array of ``tensor``'s values: its own memory for a contiguous CPU tensor
    (so an in-place collective writes straight into it), else a staged copy.  For a
    collective that a device plane serves (``process_set`` given: allreduce, broadcast and
    allgather), of the global set, the tensor itself as a device array where a device plane
    takes it."""
    _check_tensor(tensor, what)
    if tensor.dtype not in _SUPPORTED:
        raise TypeError(f"{what}: unsupported dtype {tensor.dtype}")
    if process_set is global_process_set and state.is_initialized():
        planes = state.engine().device_planes
        if planes and tensor.device.type in planes:
            dtype = _NUMPY_DTYPES.get(tensor.dtype)
            if dtype in planes[tensor.device.type].dtypes:
                return _DeviceArray(tensor.detach(), dtype)
    t = tensor.detach()
    if t.dtype == torch.bfloat16:
        t = t.float()
    if t.device.type != "cpu":
        t = t.cpu()
    array = t.contiguous().numpy()
    if writable and not array.flags.writeable:
        array = array.copy()
    return array


def _own_array(tensor, keep=False):
    """The memory of a contiguous CPU ``tensor`` of a dtype that NumPy has, as an array,
    else None (the tensor must go through :func:`_to_array`: also where a device plane
    serves CPU tensors).

    A loop reduces the same few small tensors in place again and again, and ``numpy()`` and
    the checks cost a blocking round about a tenth of its time (in a loop of two ranks, the
    binding's work took twice what it takes alone).  So when ``keep``, the array of a tensor
    whose storage has up to _KEPT_BYTES is kept (in :data:`_arrays`, at most _KEPT of them),
    and given again while the tensor has the same memory, shape and strides.  The array
    holds the tensor, and so its storage: one its user dropped lives on until the kept
    arrays are _KEPT and make way for the next (the storage's size, not the tensor's, is
    what counts: a small view of a large tensor is not kept)."""
    ctx = state._ctx
    if ctx is not None and "cpu" in ctx.engine.device_planes:
        return None
    got = _arrays.get(id(tensor))
    if (got is not None and got[0] is tensor and tensor.data_ptr() == got[1]
            and tensor.shape == got[2] and tensor.stride() == got[3]):
        return got[4]
    if (tensor.__class__ is torch.Tensor and tensor.is_cpu and tensor.dtype in _NUMPY_DTYPES
            and tensor.is_contiguous()):
        array = tensor.detach().numpy() if tensor.requires_grad else tensor.numpy()
        if keep and tensor.untyped_storage().nbytes() <= _KEPT_BYTES:
            if len(_arrays) >= _KEPT:       # (one call: atomic, whatever other threads do)
                _arrays.clear()
            _arrays[id(tensor)] = (tensor, tensor.data_ptr(), tensor.shape, tensor.stride(),
                                   array)
        return array
    return None


# id(tensor) -> (tensor, its data_ptr(), shape and stride(), its array): see _own_array
_arrays: dict[int, tuple[torch.Tensor, int, torch.Size, tuple[int, ...], np.ndarray]] = {}
_KEPT, _KEPT_BYTES = 64, 64 << 10


def _served(process_set):
    """The set to pass to _to_array: None means the global set, as in core."""
    return global_process_set if process_set is None else process_set


_NUMPY_DTYPES = {torch.float16: np.dtype("float16"), torch.float32: np.dtype("float32"),
                 torch.float64: np.dtype("float64"), torch.int8: np.dtype("int8"),
                 torch.uint8: np.dtype("uint8"), torch.int32: np.dtype("int32"),
                 torch.int64: np.dtype("int64")}


class _DeviceArray:
    """A tensor the engine leaves where it is: a device array (``hora.core.ops._device``)
    for the device plane of its device type."""

    __slots__ = ("tensor", "ready", "shape", "dtype", "hora_device")

    def __init__(self, tensor, dtype):
        self.tensor = tensor
        self.shape = tuple(tensor.shape)
        self.dtype = dtype
        self.hora_device = tensor.device.type
        self.ready = None
        if tensor.is_cuda:      # the plane's work waits for what this stream has queued
            self.ready = torch.cuda.Event()
            self.ready.record(torch.cuda.current_stream(tensor.device))

    @property
    def size(self):
        return math.prod(self.shape)

    @property
    def ndim(self):
        return len(self.shape)


def _to_tensor(array, like):
    if isinstance(array, torch.Tensor):         # a device plane's result
        return array
    out = torch.from_numpy(array)
    if out.dtype != like.dtype or out.device != like.device:
        out = out.to(device=like.device, dtype=like.dtype)
    return out


class Handle:
    """What the ``*_async`` functions return: pass it to :func:`poll` or :func:`synchronize`.

    It holds the core engine's handle and the conversion of the result back to tensors.
    """

    __slots__ = ("_core", "_convert", "_done", "_result")

    def __init__(self, core_handle: Any, convert: Callable[[Any], Any]) -> None:
        self._core = core_handle
        self._convert: Callable[[Any], Any] | None = convert
        self._done = False
        self._result: Any = None

    def poll(self) -> bool:
        """True once the collective has finished (``wait`` will not block)."""
        return self._done or self._core.poll()

    def wait(self, timeout: float | None = None) -> Any:
        """Wait for the collective and return its result (raises its error)."""
        if not self._done:
            convert: Callable[[Any], Any] = self._convert  # type: ignore[assignment]
            self._result = convert(self._core.wait(timeout))
            self._done = True
            self._core = self._convert = None
        return self._result



def poll(handle: Handle | SparseHandle) -> bool:
    """True when the asynchronous collective behind ``handle`` has finished."""
    return handle.poll()


def synchronize(handle: Handle | SparseHandle) -> Any:
    """Wait for ``handle``'s collective; return its output tensor(s)."""
    return handle.wait()


# -- allreduce ---------------------------------------------------------------------------------
@tells_peers(messages.ALLREDUCE)
def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: int | None = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start averaging (or summing, ...) ``tensor`` over the ranks; returns a handle.  The
    input is not modified."""
    array = _to_array(tensor, "allreduce", process_set=_served(process_set))
    h = core.allreduce_async(array, op, name, prescale_factor,
                             postscale_factor, average=average, process_set=process_set)
    return Handle(h, lambda a: _to_tensor(a, tensor))


@tells_peers(messages.ALLREDUCE)
def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: int | None = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """In-place :func:`allreduce_async`: ``synchronize`` writes the result into ``tensor``."""
    array = _to_array(tensor, "allreduce_", True, _served(process_set))
    h = core.allreduce_async_(array, op, name,
                              prescale_factor, postscale_factor, average=average,
                              process_set=process_set)
    return Handle(h, lambda a: _copy_into(tensor, a))


def _copy_into(tensor, array):
    """Put ``array`` into ``tensor`` unless the engine already wrote there (a CPU tensor's
    own memory is reduced in place)."""
    result = array if isinstance(array, torch.Tensor) else torch.from_numpy(array)
    if result.device != tensor.device or result.data_ptr() != tensor.data_ptr():
        with torch.no_grad():
            tensor.copy_(result.reshape(tensor.shape))
    return tensor


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, average, name, op, prescale, postscale, process_set):
        ctx.args = (average, op, prescale, postscale, process_set)
        # the unwrapped body: allreduce() already tells the peers of a failure (tell_peers)
        return _now(lambda: allreduce_async.__wrapped__(tensor, average, name, op, prescale,
                                                       postscale, process_set))

    @staticmethod
    def backward(ctx, grad):
        average, op, prescale, postscale, process_set = ctx.args
        return (allreduce(grad, average=average, op=op, prescale_factor=prescale,
                          postscale_factor=postscale, process_set=process_set),
                None, None, None, None, None, None)


# allreduce and allreduce_ do tells_peers' work themselves: a loop's blocking call is a few
# Python frames in all, each of them a part of every round, and the decorator's is one more
def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: type[Compressor] = Compression.none, op: int | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Average (default) or reduce ``tensor`` over the ranks; differentiable.

    Example:
        >>> loss = hvd.allreduce(loss, name="loss")        # the mean over all ranks
    """
    try:
        _check_tensor(tensor, "allreduce")
        compressed, cctx = compression.compress(tensor)
        if compressed.requires_grad and torch.is_grad_enabled():
            out = _Allreduce.apply(compressed, average, name, op, prescale_factor,
                                   postscale_factor, process_set)
        elif (array := _own_array(compressed)) is not None:     # no graph, nothing to stage
            out = torch.from_numpy(core.allreduce(array, op, name, prescale_factor,
                                                  postscale_factor, average, process_set))
        else:                       # no graph to record: skip autograd's bookkeeping
            out = _now(lambda: allreduce_async.__wrapped__(compressed, average, name, op,
                                                           prescale_factor, postscale_factor,
                                                           process_set))
        return compression.decompress(out, cctx)
    except Exception as e:
        tell_peers(messages.ALLREDUCE, e, name, process_set)
        raise


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: int | None = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place :func:`allreduce`; returns ``tensor``."""
    try:
        array = _own_array(tensor, True)
        if array is None:
            return _now(lambda: allreduce_async_.__wrapped__(
                tensor, average, name, op, prescale_factor, postscale_factor, process_set))
        # core's blocking call reduces in the tensor's own memory
        core.allreduce_(array, op, name, prescale_factor, postscale_factor, average,
                        process_set)
        return tensor
    except Exception as e:
        tell_peers(messages.ALLREDUCE, e, name, process_set)
        raise


@tells_peers(messages.ALLREDUCE)
def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op: int | None = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> Handle:
    """Start reducing a list of tensors as one atomically negotiated collective."""
    arrays = [_to_array(t, "grouped_allreduce", process_set=_served(process_set))
              for t in tensors]
    h = core.grouped_allreduce_async(arrays, op, name, prescale_factor,
                                     postscale_factor, average=average, process_set=process_set)
    return Handle(h, lambda outs: [_to_tensor(a, t) for a, t in zip(outs, tensors)])


@tells_peers(messages.ALLREDUCE)
def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: int | None = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> Handle:
    """In-place :func:`grouped_allreduce_async`."""
    arrays = [_to_array(t, "grouped_allreduce_", True, _served(process_set)) for t in tensors]
    h = core.grouped_allreduce_async_(arrays, op, name, prescale_factor,
                                      postscale_factor, average=average,
                                      process_set=process_set)
    return Handle(h, lambda outs: [_copy_into(t, a) for a, t in zip(outs, tensors)])


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, average, name, op, prescale, postscale, process_set, *tensors):
        ctx.args = (average, op, prescale, postscale, process_set)
        return tuple(_now(lambda: grouped_allreduce_async(list(tensors), average, name, op,
                                                         prescale, postscale, process_set)))

    @staticmethod
    def backward(ctx, *grads):
        average, op, prescale, postscale, process_set = ctx.args
        reduced = grouped_allreduce(list(grads), average=average, op=op,
                                    prescale_factor=prescale, postscale_factor=postscale,
                                    process_set=process_set)
        return (None,) * 6 + tuple(reduced)


@tells_peers(messages.ALLREDUCE)
def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None,
                      name: str | None = None,
                      compression: type[Compressor] = Compression.none, op: int | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Reduce a list of tensors together; differentiable; returns a list."""
    for t in tensors:
        _check_tensor(t, "grouped_allreduce")
    pairs = [compression.compress(t) for t in tensors]
    outs = _GroupedAllreduce.apply(average, name, op, prescale_factor, postscale_factor,
                                   process_set, *[p[0] for p in pairs])
    return [compression.decompress(o, p[1]) for o, p in zip(outs, pairs)]


@tells_peers(messages.ALLREDUCE)
def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                       name: str | None = None, op: int | None = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """In-place :func:`grouped_allreduce`; returns ``tensors``."""
    return _now(lambda: grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


# -- sparse allreduce --------------------------------------------------------------------------
class SparseHandle:
    """What :func:`sparse_allreduce_async` returns.  Call it, as Horovod's users do
    (``handle()``), or pass it to :func:`synchronize`: either waits for both allgathers and
    returns the reduced sparse tensor."""

    __slots__ = ("_indices", "_values", "_shape", "_divisor", "_result")

    def __init__(self, indices: Handle, values: Handle, shape: torch.Size,
                 divisor: int) -> None:
        self._indices = indices
        self._values = values
        self._shape = shape
        self._divisor = divisor
        self._result: torch.Tensor | None = None

    def poll(self) -> bool:
        """True once both allgathers have finished."""
        return self._result is not None or (self._values.poll() and self._indices.poll())

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        """Wait for every rank's indices and values; returns the sum (or average) as a
        coalesced sparse tensor shaped like the input."""
        if self._result is None:
            values = self._values.wait(timeout)
            indices = self._indices.wait(timeout)
            # every rank's (index, value) pairs side by side: coalescing adds up the rows
            # that several ranks touched, which is what a dense allreduce would do
            out = torch.sparse_coo_tensor(indices.t(), values, self._shape,
                                          check_invariants=False).coalesce()
            if self._divisor != 1:
                # divide once the rows are summed, as a dense Average rounds (coalesce made
                # the values a new tensor: dividing them in place touches nothing else)
                out._values().div_(self._divisor)
            self._result = out
        return self._result

    def __call__(self) -> torch.Tensor:
        return self.wait()


def sparse_allreduce_async(tensor: torch.Tensor, name: str | None, op: int | None,
                           process_set: ProcessSet = global_process_set) -> SparseHandle:
    """Start reducing a sparse COO tensor over the ranks by gathering every rank's indices
    and values (two allgathers, named ``<name>.indices`` and ``<name>.values``), as
    Horovod does: the traffic grows with the rows touched, not with the tensor's size.

    Args:
        tensor: a sparse COO tensor (``tensor.is_sparse``), such as the gradient of an
            ``nn.Embedding(..., sparse=True)``; same shape and dtype on every rank, any
            number of entries.
        name: names the two allgathers; the same on every rank.
        op: ``Average`` (or None, which means Average as in :func:`allreduce`) or ``Sum``.
        process_set: reduce over the ranks of this process set only.

    Returns:
        A handle: call it (``handle()``) or pass it to :func:`synchronize` to get the
        reduced tensor, sparse and coalesced (duplicate indices summed).

    Raises:
        TypeError: ``tensor`` is not a sparse COO tensor, or is an integer tensor to
            average.
        ValueError: ``op`` is neither Average nor Sum.

    Example:
        >>> handle = hvd.sparse_allreduce_async(emb.weight.grad, name="emb", op=hvd.Average)
        >>> grad = handle()
    """
    _check_tensor(tensor, "sparse_allreduce_async")
    if not tensor.is_sparse:
        raise TypeError(f"sparse_allreduce_async: expected a sparse COO tensor, got layout "
                        f"{tensor.layout}; use allreduce for a dense tensor")
    op = Average if op is None else op
    if op not in (Average, Sum):
        raise ValueError(f"sparse_allreduce_async: op must be Average or Sum, got "
                         f"{messages.OP_NAMES.get(op, op)!r} (gathered entries can only be "
                         f"added up)")
    if op == Average and not (tensor.dtype.is_floating_point or tensor.dtype.is_complex):
        raise TypeError(f"sparse_allreduce_async: cannot average a {tensor.dtype} tensor; "
                        f"use op=Sum")
    t = tensor if tensor.is_coalesced() else tensor.coalesce()   # fewer entries to send
    # allgather concatenates along dimension 0: send the indices as (nnz, sparse_dim)
    indices = allgather_async(t._indices().t().contiguous(),
                              name=None if name is None else f"{name}.indices",
                              process_set=process_set)
    values = allgather_async(t._values().contiguous(),
                             name=None if name is None else f"{name}.values",
                             process_set=process_set)
    divisor = _served(process_set).size() if op == Average else 1
    return SparseHandle(indices, values, tensor.shape, divisor)


# -- allgather ---------------------------------------------------------------------------------
@tells_peers(messages.ALLGATHER)
def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start concatenating every rank's ``tensor`` along dimension 0."""
    array = _to_array(tensor, "allgather", process_set=_served(process_set))
    h = core.allgather_async(array, name, process_set=process_set)
    return Handle(h, lambda a: _to_tensor(a, tensor))


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.dim0 = tensor.shape[0] if tensor.dim() else 1
        ctx.process_set = process_set
        return _now(lambda: allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        return _allgather_grads([grad], [ctx.dim0], ctx.process_set)[0], None, None


@tells_peers(messages.ALLGATHER)
def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along dimension 0 (which may differ by rank);
    differentiable."""
    _check_tensor(tensor, "allgather")
    return _Allgather.apply(tensor, name, process_set)


@tells_peers(messages.ALLGATHER, grouped=True)
def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> Handle:
    """Start an allgather of each tensor of a list."""
    arrays = [_to_array(t, "grouped_allgather", process_set=_served(process_set))
              for t in tensors]
    h = core.grouped_allgather_async(arrays, name, process_set=process_set)
    return Handle(h, lambda outs: [_to_tensor(a, t) for a, t in zip(outs, tensors)])


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.dims = [t.shape[0] if t.dim() else 1 for t in tensors]
        ctx.process_set = process_set
        return tuple(_now(lambda: grouped_allgather_async(list(tensors), name, process_set)))

    @staticmethod
    def backward(ctx, *grads):
        return (None, None) + tuple(_allgather_grads(list(grads), ctx.dims, ctx.process_set))


def _allgather_grads(grads, dims, process_set):
    # every rank's output depends on my rows: average the gradients, keep my rows
    reduced = grouped_allreduce(grads, op=Average, process_set=process_set)
    all_dims = core.allgather(torch.tensor([dims]).numpy(), process_set=process_set)
    me = process_set.rank() if process_set is not global_process_set else core.rank()
    offsets = all_dims[:me].sum(axis=0)
    return [r.narrow(0, int(o), d) for r, o, d in zip(reduced, offsets, dims)]


@tells_peers(messages.ALLGATHER, grouped=True)
def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allgather each tensor of a list; differentiable; returns a list."""
    for t in tensors:
        _check_tensor(t, "grouped_allgather")
    return list(_GroupedAllgather.apply(name, process_set, *tensors))


# -- broadcast ---------------------------------------------------------------------------------
@tells_peers(messages.BROADCAST)
def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start sending ``root_rank``'s ``tensor`` to every rank."""
    array = _to_array(tensor, "broadcast", process_set=_served(process_set))
    h = core.broadcast_async(array, root_rank, name,
                             process_set=process_set)
    return Handle(h, lambda a: _to_tensor(a, tensor))


@tells_peers(messages.BROADCAST)
def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """In-place :func:`broadcast_async`."""
    array = _to_array(tensor, "broadcast_", process_set=_served(process_set))
    h = core.broadcast_async(array, root_rank, name,
                             process_set=process_set)
    return Handle(h, lambda a: _copy_into(tensor, a))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank = root_rank
        ctx.process_set = process_set
        return _now(lambda: broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        # only the root's input reached the output: it receives the averaged gradient
        reduced = allreduce(grad, op=Average, process_set=ctx.process_set)
        if core.rank() != ctx.root_rank:
            reduced = torch.zeros_like(reduced)
        return reduced, None, None, None


@tells_peers(messages.BROADCAST)
def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """``root_rank``'s ``tensor`` on every rank; differentiable."""
    return _Broadcast.apply(tensor, root_rank, name, process_set)


@tells_peers(messages.BROADCAST)
def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place :func:`broadcast`; returns ``tensor``."""
    return _now(lambda: broadcast_async_(tensor, root_rank, name, process_set))


# -- alltoall ----------------------------------------------------------------------------------
def _splits(splits):
    if splits is None:
        return None
    if isinstance(splits, torch.Tensor):        # (its dtype kept: the core checks it)
        return splits.detach().cpu().numpy()
    return splits


@tells_peers(messages.ALLTOALL)
def alltoall_async(tensor: torch.Tensor, splits: Sequence[int] | torch.Tensor | None = None,
                   name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> Handle:
    """Start an alltoall; ``synchronize`` returns ``(output, received_splits)``."""
    h = core.alltoall_async(_to_array(tensor, "alltoall"), _splits(splits), name,
                            process_set=process_set)
    return Handle(h, lambda r: (_to_tensor(r[0], tensor), torch.from_numpy(r[1])))


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        output, received = _now(lambda: alltoall_async(tensor, splits, name, process_set))
        ctx.received = received
        ctx.process_set = process_set
        if splits is None:
            return output
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad, *unused):
        back, _ = _now(lambda: alltoall_async(grad.contiguous(), ctx.received,
                                             process_set=ctx.process_set))
        return back, None, None, None


@tells_peers(messages.ALLTOALL)
def alltoall(tensor: torch.Tensor, splits: Sequence[int] | torch.Tensor | None = None,
             name: str | None = None, process_set: ProcessSet = global_process_set
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Scatter slices of ``tensor`` (``splits[j]`` rows to rank j; an even split when None)
    and gather what every rank sent here; differentiable.

    Returns the received tensor, and also the received splits when ``splits`` is given
    (Horovod's convention).
    """
    return _Alltoall.apply(tensor, splits, name, process_set)


# -- reducescatter -----------------------------------------------------------------------------
@tells_peers(messages.REDUCESCATTER)
def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: int = Average,
                        process_set: ProcessSet = global_process_set,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Handle:
    """Start a reducescatter: the reduction of every rank's ``tensor``, split along dimension
    0 (the first ``rows % size`` ranks get one extra row)."""
    h = core.reducescatter_async(_to_array(tensor, "reducescatter"), op, name, prescale_factor,
                                 postscale_factor, process_set=process_set)
    return Handle(h, lambda a: _to_tensor(a, tensor))


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, process_set, prescale, postscale):
        ctx.args = (op, process_set, prescale, postscale)
        return _now(lambda: reducescatter_async(tensor, name, op, process_set, prescale,
                                               postscale))

    @staticmethod
    def backward(ctx, grad):
        return _reducescatter_grads([grad], *ctx.args)[0], None, None, None, None, None


def _reducescatter_grads(grads, op, process_set, prescale, postscale):
    # Horovod's definition, kept for drop-in compatibility: every rank's gathered output
    # gradient, times the size for Sum, times the scale factors
    factor = prescale * postscale * (process_set.size() if op == Sum else 1)
    gathered = _now(lambda: grouped_allgather_async([g.contiguous() for g in grads],
                                                   process_set=process_set))
    return [g * factor if factor != 1 else g for g in gathered]


@tells_peers(messages.REDUCESCATTER)
def reducescatter(tensor: torch.Tensor, name: str | None = None,
                  compression: type[Compressor] = Compression.none, op: int = Average,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """This rank's rows of the reduction of every rank's ``tensor``; differentiable."""
    _check_tensor(tensor, "reducescatter")
    compressed, cctx = compression.compress(tensor)
    out = _Reducescatter.apply(compressed, name, op, process_set, prescale_factor,
                               postscale_factor)
    return compression.decompress(out, cctx)


@tells_peers(messages.REDUCESCATTER, grouped=True)
def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                                op: int = Average,
                                process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> Handle:
    """Start a reducescatter of each tensor of a list."""
    arrays = [_to_array(t, "grouped_reducescatter") for t in tensors]
    h = core.grouped_reducescatter_async(arrays, op, name, prescale_factor, postscale_factor,
                                         process_set=process_set)
    return Handle(h, lambda outs: [_to_tensor(a, t) for a, t in zip(outs, tensors)])


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, process_set, prescale, postscale, *tensors):
        ctx.args = (op, process_set, prescale, postscale)
        return tuple(_now(lambda: grouped_reducescatter_async(list(tensors), name, op,
                                                             process_set, prescale, postscale)))

    @staticmethod
    def backward(ctx, *grads):
        return (None,) * 5 + tuple(_reducescatter_grads(list(grads), *ctx.args))


@tells_peers(messages.REDUCESCATTER, grouped=True)
def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None,
                          compression: type[Compressor] = Compression.none, op: int = Average,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """Reducescatter each tensor of a list; differentiable; returns a list."""
    for t in tensors:
        _check_tensor(t, "grouped_reducescatter")
    pairs = [compression.compress(t) for t in tensors]
    outs = _GroupedReducescatter.apply(name, op, process_set, prescale_factor, postscale_factor,
                                       *[p[0] for p in pairs])
    return [compression.decompress(o, p[1]) for o, p in zip(outs, pairs)]


# -- join, barrier -----------------------------------------------------------------------------
def join(device: int = -1) -> int:
    """Declare that this rank has no more batches: until every rank has joined it takes part
    in the others' allreduces with zeros.  Returns the last rank to join.  ``device`` is
    accepted for Horovod compatibility."""
    return core.join()


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Return once every rank of ``process_set`` has reached the barrier."""
    core.barrier(process_set=process_set)

