"""Horovod's collectives on ``jax.Array``\\ s, eagerly and inside ``jax.jit``, on hora's core.

Horovod has no JAX binding; the names, arguments and semantics here are those of its torch and
TensorFlow ones (``op``, ``prescale_factor``/``postscale_factor``, ``process_set``, ``name``).
The binding only converts: an array becomes a NumPy array (bfloat16 travels as float32, which
NumPy lacks), hora's core runs the collective, and the result comes back as a ``jax.Array`` of
the input's dtype.

- **Eagerly** (no tracer among the inputs) the core is called at once, in this thread (and
  straight, not through ``custom_vjp``, when no transformation is active: it is cheaper).
- **Under a trace** (``jax.jit``, ``lax.cond``, ...) the call is one
  ``jax.experimental.io_callback(..., ordered=True)`` whose results have the shapes and dtypes
  known at trace time.  ``io_callback`` is effectful: XLA never drops it (even when its result
  is unused), never merges two identical calls, and never runs it twice; ``ordered=True`` also
  makes the callbacks of a process run one at a time in program order, across successive
  calls of jitted functions too.  ``pure_callback`` promises none of this: a collective whose
  result looks unused would vanish on one rank, and two collectives could run in either order
  or be recomputed (remat), which for a collective means a stall.  Since two collectives of
  one process never overlap, a name that a traced function uses each time it runs never
  clashes with itself.
- **Names** of unnamed collectives under a trace are fixed when they are traced:
  ``<Prefix>.<function>.<k>``, the k-th collective traced in the outermost function being
  traced (``...<function>.ps<id>.<k>`` on process set ``id``).  Every rank that traces the
  same function gets the same names, whether or not it traced other functions before, and a
  function traced again (new shapes) gets the same names again.  Eagerly, unnamed collectives
  take the core's automatic names, counted in call order.
- **Shapes under a trace** must be known when tracing: an allgather assumes every rank sends
  as many rows as this one (the result has ``size * rows``; every rank's rows travel along,
  and a difference raises ``CollectiveMismatchError`` on every rank), and an alltoall takes
  no ``splits`` (an even exchange of same-shaped arrays).  Eagerly both take any rows and
  splits.
- **Gradients** (``jax.grad``, eagerly and under ``jit``) are Horovod's, through
  ``jax.custom_vjp``: allreduce reduces the cotangent the same way; allgather averages it and
  keeps this rank's rows; broadcast gives the root the average and the others zeros;
  reducescatter gathers it back.  ``alltoall`` is not differentiable here.
- **Errors.** Eagerly a collective raises hora's own types (``CollectiveMismatchError``...).
  Inside ``jit`` JAX re-raises whatever a callback raised as its own runtime error, whose
  message keeps hora's class name and text.  ``vmap`` of an ordered callback is refused by
  JAX.

The machinery (checks, the callback, the names, compression) is :mod:`hora.jax.bridge`.

Layer: jax (a binding: it converts arrays and never touches a socket).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .. import core
from ..core import messages
from ..core.gradients import block_rows, reducescatter_grad_factor, rows_of
from ..core.process_sets import ProcessSet, global_process_set, set_id_of
from ..errors import CollectiveMismatchError
from .bridge import Compression, collective_name
from .bridge import check_array as _check
from .bridge import check_op as _check_op
from .bridge import differentiable as _differentiable
from .bridge import is_traced as _is_traced
from .bridge import ps_of as _ps
from .bridge import resolve_op as _resolve_op
from .bridge import run as _run
from .bridge import stage as _stage
from .bridge import tells_peers_eagerly as _eager_only
from .bridge import tracing as _tracing
from .bridge import zero_cotangent as _zero_cotangent

__all__ = [
    "Average", "Sum", "Adasum", "Min", "Max", "Product", "Compression",
    "allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast",
    "alltoall", "reducescatter", "grouped_reducescatter", "barrier", "join",
    "allreduce_async", "allgather_async", "broadcast_async", "alltoall_async",
    "reducescatter_async", "poll", "synchronize",
]

Average, Sum, Adasum = messages.Average, messages.Sum, messages.Adasum
Min, Max, Product = messages.Min, messages.Max, messages.Product


# -- allreduce ---------------------------------------------------------------------------------
def _grouped_allreduce(xs: list[jax.Array], op: int, pre: float, post: float,
                       name: Optional[str], ps: ProcessSet, what: str) -> list[jax.Array]:
    """One collective for all of ``xs``; differentiable (the cotangents are reduced the same
    way)."""
    def primal(*xs):
        staged = [_stage(x) for x in xs]
        key = collective_name(name, "HorovodAllreduce" if what == "allreduce"
                              else "HorovodGroupedAllreduce", staged, ps)

        def compute(*arrays):
            if len(arrays) == 1:
                return [core.allreduce(arrays[0], op, key, pre, post, process_set=ps)]
            return core.grouped_allreduce(list(arrays), op, key, pre, post, process_set=ps)
        return tuple(_run(compute, staged, [(x.shape, x.dtype) for x in xs], what))

    def bwd(_, dys):
        idx = [i for i, d in enumerate(dys) if not _zero_cotangent(d)]
        out: list[Any] = [None] * len(dys)
        if idx:
            for i, r in zip(idx, _grouped_allreduce([dys[i] for i in idx], op, pre, post,
                                                    None, ps, what)):
                out[i] = r
        return tuple(out)
    return list(_differentiable(primal, bwd)(*xs))


@_eager_only(messages.ALLREDUCE)
def allreduce(tensor: Any, average: Optional[bool] = None, compression: Any = Compression.none,
              op: Optional[int] = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> Any:
    """Average (default) or reduce an array, or every leaf of a pytree, over the ranks;
    differentiable.

    Args:
        tensor: a ``jax.Array`` (same shape and dtype on every rank), or a pytree of them
            (reduced as one grouped collective; the result has the same structure).
        average: deprecated (Horovod's); True means Average, False Sum.
        compression: ``Compression.none`` or ``Compression.fp16``.
        op: Average (default), Sum, Min, Max or Product.
        prescale_factor, postscale_factor: multiply before / after the reduction.
        name: names the collective (the same on every rank); automatic when None.
        process_set: reduce among its ranks only.

    Example:
        >>> loss = hvd.allreduce(loss)                    # the mean over the ranks
    """
    op = _resolve_op(op, average)
    _check_op(op, "allreduce")
    leaves, tree = jax.tree_util.tree_flatten(tensor)
    if not leaves:
        return tensor
    single = jax.tree_util.treedef_is_leaf(tree)
    pairs = [compression.compress(_check(x, "allreduce")) for x in leaves]
    outs = _grouped_allreduce([p[0] for p in pairs], op, prescale_factor, postscale_factor,
                              name, _ps(process_set),
                              "allreduce" if single else "grouped_allreduce")
    outs = [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs)]
    return jax.tree_util.tree_unflatten(tree, outs)


@_eager_only(messages.ALLREDUCE)
def grouped_allreduce(tensors: Sequence[Any], average: Optional[bool] = None,
                      compression: Any = Compression.none, op: Optional[int] = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set,
                      name: Optional[str] = None) -> list[jax.Array]:
    """Reduce a list of arrays as one collective; differentiable.  As :func:`allreduce`."""
    if not tensors:
        return list(tensors)
    return list(allreduce.__wrapped__(list(tensors), average, compression, op,
                                      prescale_factor, postscale_factor, name, process_set))


# -- allgather ---------------------------------------------------------------------------------
def _grouped_allgather(xs: list[jax.Array], name: Optional[str], ps: ProcessSet,
                       what: str) -> list[jax.Array]:
    def primal(*xs):
        staged = [_stage(x) for x in xs]
        key = collective_name(name, "HorovodAllgather" if what == "allgather"
                              else "HorovodGroupedAllgather", staged, ps)

        def compute(*arrays):
            if len(arrays) == 1:
                return [core.allgather(arrays[0], key, process_set=ps)]
            return core.grouped_allgather(list(arrays), key, process_set=ps)

        def compute_same_rows(*arrays):
            # the result's shape was fixed when tracing, from this rank's rows: every rank's
            # rows travel along, so that all ranks see a difference and raise alike
            rows = np.asarray([[rows_of(a.shape) for a in arrays]], np.int64)
            *outs, every = core.grouped_allgather([*arrays, rows], key, process_set=ps)
            if (every != every[0]).any():
                raise CollectiveMismatchError(
                    f"{what} {key!r} inside jax.jit: every rank must send the same number of "
                    f"rows (the result's shape is fixed when tracing), got "
                    f"{every.T.tolist()} by rank; call it outside jit for rows that differ")
            return outs
        if _is_traced(staged):
            specs = [((ps.size() * rows_of(x.shape),) + x.shape[1:], x.dtype) for x in xs]
            return tuple(_run(compute_same_rows, staged, specs, what))
        return tuple(_run(compute, staged, [(None, x.dtype) for x in xs], what))

    def bwd(xs, dys):
        # Horovod's: the output's cotangent averaged over the ranks, then this rank's rows
        idx = [i for i, d in enumerate(dys) if not _zero_cotangent(d)]
        out: list[Any] = [None] * len(dys)
        if not idx:
            return tuple(out)
        reduced = _grouped_allreduce([dys[i] for i in idx], Average, 1.0, 1.0, None, ps,
                                     "grouped_allreduce")
        dims = jnp.asarray([[rows_of(xs[i].shape) for i in idx]], dtype=jnp.int32)
        every = _grouped_allgather([dims], None, ps, "allgather")[0]     # (ranks, tensors)
        offsets = jnp.sum(every[:ps.rank()], axis=0)
        for j, (i, g) in enumerate(zip(idx, reduced)):
            mine = jax.lax.dynamic_slice_in_dim(g, offsets[j], rows_of(xs[i].shape), axis=0)
            out[i] = mine.reshape(xs[i].shape)
        return tuple(out)
    return list(_differentiable(primal, bwd, keep_inputs=True)(*xs))


@_eager_only(messages.ALLGATHER)
def allgather(tensor: Any, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> jax.Array:
    """Every rank's ``tensor`` concatenated along the first dimension, in rank order;
    differentiable.  Eagerly the first dimension may differ by rank; inside ``jit`` it must
    not (the result's shape is fixed when tracing)."""
    return _grouped_allgather([_check(tensor, "allgather")], name, _ps(process_set),
                              "allgather")[0]


@_eager_only(messages.ALLGATHER)
def grouped_allgather(tensors: Sequence[Any], name: Optional[str] = None,
                      process_set: ProcessSet = global_process_set) -> list[jax.Array]:
    """Allgather each array of a list (one call); differentiable."""
    if not tensors:
        return []
    return _grouped_allgather([_check(t, "grouped_allgather") for t in tensors], name,
                              _ps(process_set), "grouped_allgather")


# -- broadcast ---------------------------------------------------------------------------------
def _broadcast_leaves(xs: list[jax.Array], root: int, name: Optional[str],
                      ps: ProcessSet) -> list[jax.Array]:
    def primal(*xs):
        staged = [_stage(x) for x in xs]
        key = collective_name(name, "HorovodBroadcast", staged, ps)

        def compute(*arrays):
            if len(arrays) == 1:
                return [core.broadcast(arrays[0], root, key, process_set=ps)]
            base = key if key is not None else core.ops.auto_name(messages.BROADCAST,
                                                                  set_id_of(ps))
            handles = core.submit_deferred(lambda: [
                core.broadcast_async(a, root, f"{base}.{i}", process_set=ps)
                for i, a in enumerate(arrays)])
            return [h.wait() for h in handles]
        return tuple(_run(compute, staged, [(x.shape, x.dtype) for x in xs], "broadcast"))

    def bwd(_, dys):
        idx = [i for i, d in enumerate(dys) if not _zero_cotangent(d)]
        out: list[Any] = [None] * len(dys)
        if idx:
            reduced = _grouped_allreduce([dys[i] for i in idx], Average, 1.0, 1.0, None, ps,
                                         "grouped_allreduce")
            for i, r in zip(idx, reduced):
                # the same ops on every rank, so every rank traces the same collectives
                out[i] = r * jnp.asarray(core.rank() == root, r.dtype)
        return tuple(out)
    return list(_differentiable(primal, bwd)(*xs))


@_eager_only(messages.BROADCAST)
def broadcast(tensor: Any, root_rank: int, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> Any:
    """``root_rank``'s ``tensor`` (an array, or a pytree of them) on every rank;
    differentiable: the root gets the average of the ranks' cotangents, the others zeros.
    ``root_rank`` is a global rank."""
    if isinstance(root_rank, bool) or not isinstance(root_rank, (int, np.integer)):
        raise TypeError(f"broadcast: root_rank must be an int, got {root_rank!r}")
    leaves, tree = jax.tree_util.tree_flatten(tensor)
    if not leaves:
        return tensor
    outs = _broadcast_leaves([_check(x, "broadcast") for x in leaves], int(root_rank), name,
                             _ps(process_set))
    return jax.tree_util.tree_unflatten(tree, outs)


# -- alltoall, reducescatter -------------------------------------------------------------------
@_eager_only(messages.ALLTOALL)
def alltoall(tensor: Any, splits: Any = None, name: Optional[str] = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send rows ``splits[j]`` of ``tensor`` to rank j (an even split when None) and gather
    what every rank sent here, in rank order.  Returns the received array, and also the
    received splits (int32) when ``splits`` is given (Horovod's convention).  Inside ``jit``
    only the even split of same-shaped arrays is possible.  Not differentiable."""
    x = _stage(_check(tensor, "alltoall"))
    dtype, ps = jnp.asarray(tensor).dtype, _ps(process_set)
    key = collective_name(name, "HorovodAlltoall", [x], ps)
    if _is_traced([x]):
        if splits is not None:
            raise NotImplementedError("alltoall: splits inside jax.jit (the received rows "
                                      "are not known when tracing); call it eagerly")
        return _run(lambda a: [core.alltoall(a, None, key, process_set=ps)[0]], [x],
                    [(x.shape, x.dtype)], "alltoall")[0].astype(dtype)
    sp = None if splits is None else np.asarray(splits).reshape(-1)
    out, received = core.alltoall(np.asarray(x), sp, key, process_set=ps)
    out = jnp.asarray(out).astype(dtype)
    return out if splits is None else (out, jnp.asarray(received, dtype=jnp.int32))


def _grouped_reducescatter(xs: list[jax.Array], op: int, pre: float, post: float,
                           name: Optional[str], ps: ProcessSet, what: str) -> list[jax.Array]:
    def primal(*xs):
        staged = [_stage(x) for x in xs]
        key = collective_name(name, "HorovodReducescatter", staged, ps)

        def compute(*arrays):
            if len(arrays) == 1:
                return [core.reducescatter(arrays[0], op, key, pre, post, process_set=ps)]
            return core.grouped_reducescatter(list(arrays), op, key, pre, post,
                                              process_set=ps)
        specs = [((block_rows(x.shape[0], ps.size(), ps.rank()),) + x.shape[1:], x.dtype)
                 for x in xs]
        return tuple(_run(compute, staged, specs, what))

    def bwd(_, dys):
        # every rank's cotangent, scaled and gathered
        factor = reducescatter_grad_factor(op, pre, post, ps.size())
        idx = [i for i, d in enumerate(dys) if not _zero_cotangent(d)]
        out: list[Any] = [None] * len(dys)
        if idx:
            gathered = _grouped_allgather([dys[i] * factor for i in idx], None, ps,
                                          "grouped_allgather")
            for i, g in zip(idx, gathered):
                out[i] = g
        return tuple(out)
    return list(_differentiable(primal, bwd)(*xs))


def _reducescatter_inputs(tensors, what):
    xs = [_check(t, what) for t in tensors]
    if any(x.ndim == 0 for x in xs):
        raise ValueError(f"{what}: needs at least one dimension (got a 0-d array)")
    return xs


@_eager_only(messages.REDUCESCATTER)
def reducescatter(tensor: Any, compression: Any = Compression.none, op: int = Average,
                  name: Optional[str] = None, process_set: ProcessSet = global_process_set,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> jax.Array:
    """This rank's block of the reduction of every rank's ``tensor`` along the first
    dimension (the first ``rows % size`` ranks get one extra row); differentiable."""
    _check_op(op, "reducescatter")
    x, ctx = compression.compress(_reducescatter_inputs([tensor], "reducescatter")[0])
    out = _grouped_reducescatter([x], op, prescale_factor, postscale_factor, name,
                                 _ps(process_set), "reducescatter")[0]
    return compression.decompress(out, ctx)


@_eager_only(messages.REDUCESCATTER)
def grouped_reducescatter(tensors: Sequence[Any], compression: Any = Compression.none,
                          op: int = Average, process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                          name: Optional[str] = None) -> list[jax.Array]:
    """Reducescatter each array of a list (one call); differentiable."""
    if not tensors:
        return []
    _check_op(op, "grouped_reducescatter")
    pairs = [compression.compress(x) for x in
             _reducescatter_inputs(tensors, "grouped_reducescatter")]
    outs = _grouped_reducescatter([p[0] for p in pairs], op, prescale_factor,
                                  postscale_factor, name, _ps(process_set),
                                  "grouped_reducescatter")
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs)]


# -- barrier, join -----------------------------------------------------------------------------
def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Return once every rank of ``process_set`` has reached the barrier (inside ``jit``: the
    call's place in the program's ordered effects)."""
    ps = _ps(process_set)

    def compute():
        core.barrier(process_set=ps)
        return [np.zeros((), np.int32)]
    _run(compute, [], [((), jnp.int32)], "barrier", traced=_tracing())


def join() -> jax.Array:
    """This rank has no more data: until every rank has joined it takes part in the others'
    allreduces with zeros.  Returns the last rank to join (an int32 scalar)."""
    return _run(lambda: [np.asarray(core.join(), np.int32)], [], [((), jnp.int32)], "join",
                traced=_tracing())[0]


# -- asynchronous forms (eager only) ------------------------------------------------------------
class _Handle:
    """A core handle whose result comes back as ``jax.Array``\\ s of the input's dtype."""

    def __init__(self, handle: Any, dtype: Any):
        self._handle, self._dtype = handle, dtype

    def poll(self) -> bool:
        return self._handle.poll()

    def wait(self, timeout: Optional[float] = None) -> Any:
        out = self._handle.wait(timeout)
        if isinstance(out, tuple):                       # alltoall: (received, splits)
            return jnp.asarray(out[0]).astype(self._dtype), jnp.asarray(out[1], jnp.int32)
        return jnp.asarray(out).astype(self._dtype)


def _start(what: str, tensor: Any, start: Callable[[np.ndarray], Any]) -> _Handle:
    x = _check(tensor, what)
    if _is_traced([x]):
        raise TypeError(f"{what}_async: runs eagerly only; inside jax.jit use {what}()")
    return _Handle(start(np.asarray(_stage(x))), x.dtype)


def allreduce_async(tensor: Any, average: Optional[bool] = None, name: Optional[str] = None,
                    op: Optional[int] = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> _Handle:
    """Start an allreduce (eagerly); :func:`synchronize` returns the result."""
    op = _resolve_op(op, average)
    return _start("allreduce", tensor, lambda a: core.allreduce_async(
        a, op, name, prescale_factor, postscale_factor, process_set=process_set))


def allgather_async(tensor: Any, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> _Handle:
    """Start an allgather (eagerly)."""
    return _start("allgather", tensor,
                  lambda a: core.allgather_async(a, name, process_set=process_set))


def broadcast_async(tensor: Any, root_rank: int, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> _Handle:
    """Start a broadcast (eagerly)."""
    return _start("broadcast", tensor, lambda a: core.broadcast_async(
        a, root_rank, name, process_set=process_set))


def alltoall_async(tensor: Any, splits: Any = None, name: Optional[str] = None,
                   process_set: ProcessSet = global_process_set) -> _Handle:
    """Start an alltoall (eagerly); the result is ``(received, received_splits)``."""
    return _start("alltoall", tensor, lambda a: core.alltoall_async(
        a, splits, name, process_set=process_set))


def reducescatter_async(tensor: Any, op: int = Average, name: Optional[str] = None,
                        process_set: ProcessSet = global_process_set,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> _Handle:
    """Start a reducescatter (eagerly)."""
    return _start("reducescatter", tensor, lambda a: core.reducescatter_async(
        a, op, name, prescale_factor, postscale_factor, process_set=process_set))


def poll(handle: _Handle) -> bool:
    """True when the collective behind ``handle`` has finished."""
    return handle.poll()


def synchronize(handle: _Handle, timeout: Optional[float] = None) -> Any:
    """Wait for ``handle``'s collective and return its result (raises its error)."""
    return handle.wait(timeout)
