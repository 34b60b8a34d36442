"""torch tensors as the NumPy arrays (or device arrays) that hora's core takes, and back.

A contiguous CPU tensor lends its own memory (an in-place collective writes straight into
it); other tensors are staged: CUDA tensors through the host, bfloat16 through float32,
which NumPy lacks.  Where the engine has a device plane for a tensor's device
(HORA_BACKEND=nccl: CUDA tensors), a collective of the global set that the plane serves gets
the tensor itself, as a :class:`DeviceArray`.  Layer: torch.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ..core import state
from ..core.process_sets import global_process_set

__all__ = ["check_tensor", "to_array", "own_array", "served", "DeviceArray", "to_tensor",
           "copy_into"]

_SUPPORTED = {torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
              torch.bfloat16, torch.float32, torch.float64, torch.bool}


def check_tensor(tensor, what):
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(tensor).__name__}")


def to_array(tensor, what, writable=False, process_set=None):
    """A NumPy array of ``tensor``'s values: its own memory for a contiguous CPU tensor
    (so an in-place collective writes straight into it), else a staged copy.  For a
    collective that a device plane serves (``process_set`` given: allreduce, broadcast and
    allgather), of the global set, the tensor itself as a device array where a device plane
    takes it."""
    check_tensor(tensor, what)
    if tensor.dtype not in _SUPPORTED:
        raise TypeError(f"{what}: unsupported dtype {tensor.dtype}")
    if process_set is global_process_set and state.is_initialized():
        planes = state.engine().device_planes
        if planes and tensor.device.type in planes:
            dtype = _NUMPY_DTYPES.get(tensor.dtype)
            if dtype in planes[tensor.device.type].dtypes:
                return DeviceArray(tensor.detach(), dtype)
    t = tensor.detach()
    if t.dtype == torch.bfloat16:
        t = t.float()
    if t.device.type != "cpu":
        t = t.cpu()
    array = t.contiguous().numpy()
    if writable and not array.flags.writeable:
        array = array.copy()
    return array


def own_array(tensor, keep=False):
    """The memory of a contiguous CPU ``tensor`` of a dtype that NumPy has, as an array,
    else None (the tensor must go through :func:`to_array`: also where a device plane
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


def served(process_set):
    """The set to pass to _to_array: None means the global set, as in core."""
    return global_process_set if process_set is None else process_set


_NUMPY_DTYPES = {torch.float16: np.dtype("float16"), torch.float32: np.dtype("float32"),
                 torch.float64: np.dtype("float64"), torch.int8: np.dtype("int8"),
                 torch.uint8: np.dtype("uint8"), torch.int32: np.dtype("int32"),
                 torch.int64: np.dtype("int64")}


class DeviceArray:
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


def to_tensor(array, like):
    if isinstance(array, torch.Tensor):         # a device plane's result
        return array
    out = torch.from_numpy(array)
    if out.dtype != like.dtype or out.device != like.device:
        out = out.to(device=like.device, dtype=like.dtype)
    return out



def copy_into(tensor, array):
    """Put ``array`` into ``tensor`` unless the engine already wrote there (a CPU tensor's
    own memory is reduced in place)."""
    result = array if isinstance(array, torch.Tensor) else torch.from_numpy(array)
    if result.device != tensor.device or result.data_ptr() != tensor.data_ptr():
        with torch.no_grad():
            tensor.copy_(result.reshape(tensor.shape))
    return tensor
