"""Horovod's ``horovod.torch`` collectives on torch tensors, built on hora's core engine.

The binding only converts: a tensor becomes a NumPy array (a view of CPU memory; CUDA
tensors are staged through the host, bfloat16 through float32, which NumPy lacks), the core
engine runs the collective, and the result comes back as a tensor of the input's dtype and
device.  Where the engine has a device plane for a tensor's device (HORA_BACKEND=nccl: CUDA
tensors), an allreduce, broadcast or allgather of the global set hands it the tensor itself
instead (a device array), and the collective runs on the GPU (the conversions are
:mod:`hora.torch.arrays`).  Out-of-place ops are autograd Functions with Horovod's gradients;
``*_`` ops write into their input.  Layer: torch.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .. import core
from ..core import messages
from ..core.basics import *  # noqa: F401,F403  (Horovod's mpi_ops carries the basics too)
from ..core.gradients import reducescatter_grad_factor, rows_of
from ..core.ops import tell_peers, tells_peers
from ..core.ops import wait_now as _now
from ..core.process_sets import ProcessSet, global_process_set
from .arrays import check_tensor, copy_into, own_array, served, to_array, to_tensor
from .basics import cuda_built, nccl_built  # noqa: F401 (for the core's)
from .compression import Compression, Compressor
from .handles import Handle, SparseHandle

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


# -- handles -----------------------------------------------------------------------------------
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
    array = to_array(tensor, "allreduce", process_set=served(process_set))
    h = core.allreduce_async(array, op, name, prescale_factor,
                             postscale_factor, average=average, process_set=process_set)
    return Handle(h, lambda a: to_tensor(a, tensor))


@tells_peers(messages.ALLREDUCE)
def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: int | None = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """In-place :func:`allreduce_async`: ``synchronize`` writes the result into ``tensor``."""
    array = to_array(tensor, "allreduce_", True, served(process_set))
    h = core.allreduce_async_(array, op, name,
                              prescale_factor, postscale_factor, average=average,
                              process_set=process_set)
    return Handle(h, lambda a: copy_into(tensor, a))


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
        check_tensor(tensor, "allreduce")
        compressed, cctx = compression.compress(tensor)
        if compressed.requires_grad and torch.is_grad_enabled():
            out = _Allreduce.apply(compressed, average, name, op, prescale_factor,
                                   postscale_factor, process_set)
        elif (array := own_array(compressed)) is not None:     # no graph, nothing to stage
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
        array = own_array(tensor, True)
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
    arrays = [to_array(t, "grouped_allreduce", process_set=served(process_set))
              for t in tensors]
    h = core.grouped_allreduce_async(arrays, op, name, prescale_factor,
                                     postscale_factor, average=average, process_set=process_set)
    return Handle(h, lambda outs: [to_tensor(a, t) for a, t in zip(outs, tensors)])


@tells_peers(messages.ALLREDUCE)
def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: int | None = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> Handle:
    """In-place :func:`grouped_allreduce_async`."""
    arrays = [to_array(t, "grouped_allreduce_", True, served(process_set)) for t in tensors]
    h = core.grouped_allreduce_async_(arrays, op, name, prescale_factor,
                                      postscale_factor, average=average,
                                      process_set=process_set)
    return Handle(h, lambda outs: [copy_into(t, a) for a, t in zip(outs, tensors)])


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
        check_tensor(t, "grouped_allreduce")
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
    check_tensor(tensor, "sparse_allreduce_async")
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
    divisor = served(process_set).size() if op == Average else 1
    return SparseHandle(indices, values, tensor.shape, divisor)


# -- allgather ---------------------------------------------------------------------------------
@tells_peers(messages.ALLGATHER)
def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start concatenating every rank's ``tensor`` along dimension 0."""
    array = to_array(tensor, "allgather", process_set=served(process_set))
    h = core.allgather_async(array, name, process_set=process_set)
    return Handle(h, lambda a: to_tensor(a, tensor))


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.dim0 = rows_of(tensor.shape)
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
    check_tensor(tensor, "allgather")
    return _Allgather.apply(tensor, name, process_set)


@tells_peers(messages.ALLGATHER, grouped=True)
def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> Handle:
    """Start an allgather of each tensor of a list."""
    arrays = [to_array(t, "grouped_allgather", process_set=served(process_set))
              for t in tensors]
    h = core.grouped_allgather_async(arrays, name, process_set=process_set)
    return Handle(h, lambda outs: [to_tensor(a, t) for a, t in zip(outs, tensors)])


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.dims = [rows_of(t.shape) for t in tensors]
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
        check_tensor(t, "grouped_allgather")
    return list(_GroupedAllgather.apply(name, process_set, *tensors))


# -- broadcast ---------------------------------------------------------------------------------
@tells_peers(messages.BROADCAST)
def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Start sending ``root_rank``'s ``tensor`` to every rank."""
    array = to_array(tensor, "broadcast", process_set=served(process_set))
    h = core.broadcast_async(array, root_rank, name,
                             process_set=process_set)
    return Handle(h, lambda a: to_tensor(a, tensor))


@tells_peers(messages.BROADCAST)
def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """In-place :func:`broadcast_async`."""
    array = to_array(tensor, "broadcast_", process_set=served(process_set))
    h = core.broadcast_async(array, root_rank, name,
                             process_set=process_set)
    return Handle(h, lambda a: copy_into(tensor, a))


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
    h = core.alltoall_async(to_array(tensor, "alltoall"), _splits(splits), name,
                            process_set=process_set)
    return Handle(h, lambda r: (to_tensor(r[0], tensor), torch.from_numpy(r[1])))


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
    h = core.reducescatter_async(to_array(tensor, "reducescatter"), op, name, prescale_factor,
                                 postscale_factor, process_set=process_set)
    return Handle(h, lambda a: to_tensor(a, tensor))


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
    # every rank's output gradient, gathered and scaled
    factor = reducescatter_grad_factor(op, prescale, postscale, process_set.size())
    gathered = _now(lambda: grouped_allgather_async([g.contiguous() for g in grads],
                                                   process_set=process_set))
    return [g * factor if factor != 1 else g for g in gathered]


@tells_peers(messages.REDUCESCATTER)
def reducescatter(tensor: torch.Tensor, name: str | None = None,
                  compression: type[Compressor] = Compression.none, op: int = Average,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """This rank's rows of the reduction of every rank's ``tensor``; differentiable."""
    check_tensor(tensor, "reducescatter")
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
    arrays = [to_array(t, "grouped_reducescatter") for t in tensors]
    h = core.grouped_reducescatter_async(arrays, op, name, prescale_factor, postscale_factor,
                                         process_set=process_set)
    return Handle(h, lambda outs: [to_tensor(a, t) for a, t in zip(outs, tensors)])


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
        check_tensor(t, "grouped_reducescatter")
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

