"""Horovod's ``horovod.tensorflow`` collectives on TensorFlow tensors, on hora's core engine.

The binding only converts: a tensor becomes a NumPy array (bfloat16 is staged through
float32, which NumPy lacks), hora's core runs the collective synchronously, and the result
comes back as a tensor of the input's dtype.  Every op works both ways TensorFlow runs:

- **Eagerly**, the core is called at once.
- **Inside** ``tf.function`` (graph mode), the call is a ``tf.numpy_function`` node whose
  output shapes are set as far as they are known at trace time (an allreduce keeps its
  input's shape; an allgather's first dimension is unknown).  An unnamed collective is named
  when it is traced, after its function and its place among that function's collectives
  on its process set (``HorovodAllreduce.<function>.<k>``; ``...<function>.ps<id>.<k>`` on
  set ``id``), so every rank that traced the same function agrees on the names whatever
  order the graph runs them in, and a set's collectives, traced on its members only, do not
  shift the global set's names.  TensorFlow runs a function's
  stateful ops (``numpy_function`` is one) in program order, so the collectives of one
  function run one at a time, in the order they were written.

Gradients are Horovod's (``_allreduce_grad``, ``_allgather_grad``, ...), through
``tf.custom_gradient``: ``tf.GradientTape`` differentiates them eagerly and in
``tf.function``.

XLA cannot compile Python: a collective traced inside ``tf.function(jit_compile=True)``
raises ``NotImplementedError`` at trace time, on every rank alike, naming the op and what
to do instead (never a hang).

Errors.  Horovod TensorFlow raises ``tf.errors.*``; hora raises its own types, each also an
instance of Horovod's: a ``CollectiveMismatchError`` (or ``CollectiveAbortedError``,
``DuplicateNameError``) is also a ``tf.errors.FailedPreconditionError`` (Horovod's type for
mismatched ranks), a ``HoraInternalError`` (a dead peer, a rank that shut down) also a
``tf.errors.UnknownError`` (what Horovod's elastic TensorFlow catches), a
``CollectiveTimeoutError`` also a ``tf.errors.DeadlineExceededError``, and a collective on a
process set without this rank raises ``hora.InvalidArgumentError``, also a
``tf.errors.InvalidArgumentError``: ``except`` clauses written for either keep working, the
same eagerly, inside ``tf.function`` and in a ``tf.compat.v1`` session (see
:mod:`hora.tensorflow.tf_errors` for how).  Argument checks (dtype, op) raise
``TypeError``/``ValueError`` at the call, eagerly, or when the function is traced.

DEADLOCK HAZARD (graph mode).  A running collective blocks the TensorFlow thread that runs
its node until every rank has submitted it.  hora's coordinator lets ranks submit in
different orders, so this only matters when *every* thread of TensorFlow's inter-op pool is
blocked on a collective that another rank has not reached yet: collectives in separate
``tf.function``\\ s run concurrently from several Python threads, or in branches of
``tf.cond``/``tf.while_loop`` that run in a different order on different ranks.  A grouped
op (``grouped_allreduce``: one node for many tensors) avoids it, and is what gradients
should use.

Layer: tensorflow (a binding: it converts tensors and never touches a socket).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

import numpy as np
import tensorflow as tf

from .. import core
from ..core import messages
from ..core.gradients import block_rows, reducescatter_grad_factor
from ..core.ops import auto_name
from ..core.process_sets import ProcessSet, global_process_set, set_id_of
from .bridge import (check_tensor, collective_name, refuse_xla, rows_shape, run, stage,
                     tells_peers_eagerly, unstage)
from .compression import Compression, Compressor
from .topology_ops import __all__ as _topology_all
from .topology_ops import *  # noqa: F401,F403 (Horovod's mpi_ops holds them too)

__all__ = [
    "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast",
    "broadcast_", "alltoall", "reducescatter", "grouped_reducescatter", *_topology_all,
]

Average, Sum, Adasum = messages.Average, messages.Sum, messages.Adasum
Min, Max, Product = messages.Min, messages.Max, messages.Product

def _ps(process_set: ProcessSet | None) -> ProcessSet:
    return global_process_set if process_set is None else process_set


def _zeros_for(grads: Sequence[Any], outputs: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    """Upstream gradients, zeros where an output got none."""
    return [tf.zeros_like(o) if g is None else g for g, o in zip(grads, outputs)]


def _resolve_op(op: int | None, average: bool | None) -> int:
    if average is not None:
        if op is not None:
            raise ValueError("pass either op= or the deprecated average=, not both")
        return Average if average else Sum
    return Average if op is None else op


# -- allreduce ---------------------------------------------------------------------------------
def _allreduce(tensor: tf.Tensor, name: str | None = None, op: int = Sum,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               ignore_name_scope: bool = False,
               process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """The allreduce of one dense tensor, with Horovod's gradient: the gradients are reduced
    the same way (same op and scale factors)."""
    return _grouped_allreduce([tensor], name, op, prescale_factor, postscale_factor,
                              ignore_name_scope, process_set, "allreduce")[0]


def _grouped_allreduce(tensors: Sequence[tf.Tensor], name: str | None = None, op: int = Sum,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       ignore_name_scope: bool = False,
                       process_set: ProcessSet = global_process_set,
                       what: str = "grouped_allreduce") -> list[tf.Tensor]:
    """One collective (one graph node) for all of ``tensors``; differentiable."""
    tensors = [check_tensor(t, what) for t in tensors]

    @tf.custom_gradient
    def reduce(*xs):
        staged = [stage(x) for x in xs]
        key = collective_name(name, "HorovodAllreduce" if what == "allreduce"
                              else "HorovodGroupedAllreduce", process_set)

        def compute(*arrays):
            if len(arrays) == 1:
                return [core.allreduce(arrays[0], op, key, prescale_factor, postscale_factor,
                                       process_set=process_set)]
            return core.grouped_allreduce(list(arrays), op, key, prescale_factor,
                                          postscale_factor, process_set=process_set)
        outs = run(compute, staged, [s.dtype for s in staged], [s.shape for s in staged],
                   what, process_set)
        outs = [unstage(o, x.dtype) for o, x in zip(outs, xs)]

        def grad(*dys):
            return _grouped_allreduce(_zeros_for(dys, outs), None, op, prescale_factor,
                                      postscale_factor, ignore_name_scope, process_set, what)
        return outs, grad
    return list(reduce(*tensors))


def _check_op(op: int, what: str) -> None:
    if op == Adasum:
        raise NotImplementedError(f"{what}: the Adasum op is not implemented in hora yet")
    if op not in messages.OP_NAMES:
        raise ValueError(f"{what}: unknown reduce op {op!r}")


def _sparse_allreduce(slices: tf.IndexedSlices, op: int, prescale_factor: float,
                      postscale_factor: float, process_set: ProcessSet) -> tf.IndexedSlices:
    """Horovod's sparse allreduce: every rank's values and indices, gathered."""
    _sparse_checks(op, prescale_factor, postscale_factor)
    values = allgather(slices.values, process_set=process_set)
    indices = allgather(slices.indices, process_set=process_set)
    if op == Average:
        values = values / tf.cast(_ps(process_set).size(), dtype=values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


def _sparse_checks(op: int, prescale_factor: float, postscale_factor: float) -> None:
    if op == Adasum:
        raise NotImplementedError("The Adasum reduction does not currently support sparse "
                                  "tensors. As a workaround please pass sparse_as_dense=True "
                                  "to DistributedOptimizer")
    if op not in (Sum, Average):
        raise NotImplementedError("Only Sum and Average ops are supported with "
                                  "tf.IndexedSlices")
    if prescale_factor != 1.0 or postscale_factor != 1.0:
        raise NotImplementedError("Pre/postscale_factor are not supported with "
                                  "tf.IndexedSlices")


@tells_peers_eagerly(messages.ALLREDUCE)
def allreduce(tensor: Any, average: bool | None = None, device_dense: str = "",
              device_sparse: str = "", compression: type[Compressor] = Compression.none,
              op: int | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, name: str | None = None,
              process_set: ProcessSet = global_process_set,
              ignore_name_scope: bool = False) -> Any:
    """Average (default) or reduce a ``tf.Tensor``/``tf.Variable`` over the ranks;
    differentiable.  A ``tf.IndexedSlices`` is reduced by gathering every rank's values and
    indices (two allgathers; Sum or Average only).

    Args:
        tensor: same shape and dtype on every rank.
        average: deprecated (Horovod's); True means Average, False Sum.
        device_dense, device_sparse: accepted for Horovod compatibility (hora reduces on
            the host).
        compression: ``Compression.none`` or ``Compression.fp16``.
        op: Average (default), Sum, Min, Max or Product.
        prescale_factor, postscale_factor: multiply before / after the reduction.
        name: names the collective (the same on every rank); automatic when None.
        process_set: reduce among its ranks only.
        ignore_name_scope: accepted for Horovod compatibility.

    Returns:
        A tensor of the input's shape and dtype (``tf.IndexedSlices`` for one).

    Example:
        >>> loss = hvd.allreduce(loss, name="loss")       # the mean over the ranks
    """
    op = _resolve_op(op, average)
    if isinstance(tensor, tf.IndexedSlices):
        return _sparse_allreduce(tensor, op, prescale_factor, postscale_factor, process_set)
    _check_op(op, "allreduce")
    compressed, ctx = compression.compress(check_tensor(tensor, "allreduce"))
    out = _allreduce(compressed, name, op, prescale_factor, postscale_factor,
                     ignore_name_scope, process_set)
    return compression.decompress(out, ctx)


@tells_peers_eagerly(messages.ALLREDUCE)
def grouped_allreduce(tensors: Sequence[Any], average: bool | None = None,
                      device_dense: str = "", device_sparse: str = "",
                      compression: type[Compressor] = Compression.none,
                      op: int | None = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set,
                      ignore_name_scope: bool = False, name: str | None = None) -> list[Any]:
    """Reduce a list of tensors as one collective (one graph node); differentiable.
    ``tf.IndexedSlices`` among them are gathered as in :func:`allreduce`.  Arguments as for
    :func:`allreduce`."""
    if not tensors:
        return tensors
    op = _resolve_op(op, average)
    out: list[Any] = [None] * len(tensors)
    sparse = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
    dense = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    if sparse:
        _sparse_checks(op, prescale_factor, postscale_factor)
        values = grouped_allgather([tensors[i].values for i in sparse], process_set=process_set)
        indices = grouped_allgather([tensors[i].indices for i in sparse],
                                    process_set=process_set)
        for i, v, ix in zip(sparse, values, indices):
            if op == Average:
                v = v / tf.cast(_ps(process_set).size(), dtype=v.dtype)
            out[i] = tf.IndexedSlices(v, ix, dense_shape=tensors[i].dense_shape)
    if dense:
        _check_op(op, "grouped_allreduce")
        pairs = [compression.compress(check_tensor(tensors[i], "grouped_allreduce"))
                 for i in dense]
        reduced = _grouped_allreduce([p[0] for p in pairs], name, op, prescale_factor,
                                     postscale_factor, ignore_name_scope, process_set)
        for i, r, (_, ctx) in zip(dense, reduced, pairs):
            out[i] = compression.decompress(r, ctx)
    return out


# -- allgather ---------------------------------------------------------------------------------
@tells_peers_eagerly(messages.ALLGATHER)
def allgather(tensor: Any, name: str | None = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Every rank's ``tensor`` concatenated along the first dimension, in rank order (that
    dimension may differ by rank, the others must agree); differentiable: the gradient is
    the average over the ranks of the output's gradient, this rank's rows."""
    return _grouped_allgather([check_tensor(tensor, "allgather")], name, process_set,
                              "allgather")[0]


@tells_peers_eagerly(messages.ALLGATHER, grouped=True)
def grouped_allgather(tensors: Sequence[Any], name: str | None = None,
                      ignore_name_scope: bool = False,
                      process_set: ProcessSet = global_process_set) -> list[tf.Tensor]:
    """Allgather each tensor of a list, as one graph node; differentiable; returns a list."""
    if not tensors:
        return []
    return _grouped_allgather([check_tensor(t, "grouped_allgather") for t in tensors], name,
                              process_set, "grouped_allgather")


def _grouped_allgather(tensors: list[tf.Tensor], name: str | None, process_set: ProcessSet,
                       what: str) -> list[tf.Tensor]:
    @tf.custom_gradient
    def gather(*xs):
        staged = [stage(x) for x in xs]
        key = collective_name(name, "HorovodAllgather" if what == "allgather"
                              else "HorovodGroupedAllgather", process_set)

        def compute(*arrays):
            if len(arrays) == 1:
                return [core.allgather(arrays[0], key, process_set=process_set)]
            return core.grouped_allgather(list(arrays), key, process_set=process_set)
        outs = run(compute, staged, [s.dtype for s in staged],
                   [rows_shape(s) for s in staged], what, process_set)
        outs = [unstage(o, x.dtype) for o, x in zip(outs, xs)]

        def grad(*dys):
            return _allgather_grads(_zeros_for(dys, outs), xs, process_set)
        return outs, grad
    return list(gather(*tensors))


def _allgather_grads(grads: list[tf.Tensor], xs: Sequence[tf.Tensor],
                     process_set: ProcessSet) -> list[tf.Tensor]:
    """Horovod's: the output's gradient averaged over the ranks, then this rank's rows."""
    reduced = _grouped_allreduce(grads, op=Average, process_set=process_set)
    dims = tf.stack([tf.shape(x)[0] if x.shape.rank != 0 else 1 for x in xs])
    every = _grouped_allgather([tf.reshape(tf.cast(dims, tf.int64), [1, -1])], None,
                               process_set, "allgather")[0]         # (ranks, tensors)
    offsets = tf.reduce_sum(every[:_ps(process_set).rank()], axis=0)
    out = []
    for i, (g, x) in enumerate(zip(reduced, xs)):
        mine = g[offsets[i]:offsets[i] + tf.cast(dims[i], tf.int64)]
        out.append(tf.reshape(mine, tf.shape(x)))
    return out


# -- broadcast ---------------------------------------------------------------------------------
@tells_peers_eagerly(messages.BROADCAST)
def broadcast(tensor: Any, root_rank: int, name: str | None = None,
              ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """``root_rank``'s ``tensor`` on every rank (same shape and dtype everywhere);
    differentiable: the root gets the average of the ranks' gradients, the others zeros.
    ``root_rank`` is a global rank."""
    tensor = check_tensor(tensor, "broadcast")

    @tf.custom_gradient
    def bcast(x):
        staged = stage(x)
        key = collective_name(name, "HorovodBroadcast", process_set)

        def compute(a):
            return [core.broadcast(a, root_rank, key, process_set=process_set)]
        (out,) = run(compute, [staged], [staged.dtype], [staged.shape], "broadcast",
                     process_set)
        out = unstage(out, x.dtype)

        def grad(dy):
            reduced = _allreduce(dy, op=Average, process_set=process_set)
            # the same ops on every rank: a graph that differs by rank is a trap (see _name)
            return reduced * tf.cast(core.rank() == root_rank, reduced.dtype)
        return out, grad
    return bcast(tensor)


@tells_peers_eagerly(messages.BROADCAST, grouped=True)
def broadcast_(variables: Sequence[Any], root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> list[tf.Tensor]:
    """In-place broadcast: assign ``root_rank``'s value of each variable to it on every rank
    of ``process_set``, eagerly or inside ``tf.function``.

    Every variable's broadcast is submitted before any is waited for (in a graph, from one
    node), under ``<name>.<i>`` for the i-th variable (an automatic base name when ``name``
    is None).  Not differentiable.

    Args:
        variables: tf.Variables (or Keras variables), the same number in the same order,
            with the same shapes and dtypes, on every rank.
        root_rank: the global rank whose values everyone takes.
        name: the base of the collectives' names (the same on every rank).
        process_set: broadcast among its ranks only.

    Returns:
        The variables' values after the assignment (a list of tensors), as Horovod's.

    Example:
        >>> hvd.broadcast_(model.trainable_variables, root_rank=0)
    """
    if _is_variable(variables) or not hasattr(variables, "__iter__"):
        raise TypeError(f"broadcast_: expected a list of variables, got "
                        f"{type(variables).__name__}")
    variables = list(variables)
    for v in variables:
        if not _is_variable(v):
            raise TypeError(f"broadcast_: updates variables in place, got a "
                            f"{type(v).__name__}; use broadcast() for tensors")
    if not isinstance(root_rank, (int, np.integer)) or isinstance(root_rank, bool):
        raise TypeError(f"broadcast_: root_rank must be an int, got {root_rank!r}")
    if name is not None and not isinstance(name, str):
        raise TypeError(f"broadcast_: name must be a str, got {type(name).__name__}")
    if not variables:
        return []
    tensors = [check_tensor(v, "broadcast_") for v in variables]
    staged = [stage(t) for t in tensors]
    set_id = set_id_of(process_set)                 # checked before a name is drawn
    base = collective_name(name, "HorovodBroadcastInplace", process_set)
    if base is None:                # eagerly and unnamed: the core's next name on the set
        base = auto_name(messages.BROADCAST, set_id)
    names = [f"{base}.{i}" for i in range(len(variables))]
    root = int(root_rank)

    def compute(*arrays):
        handles = core.submit_deferred(lambda: [
            core.broadcast_async(a, root, n, process_set=process_set)
            for a, n in zip(arrays, names)])
        return [h.wait() for h in handles]
    values = run(compute, staged, [s.dtype for s in staged], [s.shape for s in staged],
                 "broadcast_", process_set)
    assigns = [_assign(v, unstage(x, t.dtype)) for v, x, t in zip(variables, values, tensors)]
    if tf.executing_eagerly():
        return [_read(v) for v in variables]
    # a tf.compat.v1 graph orders nothing by itself: read after the assignments
    with tf.control_dependencies([a for a in assigns if a is not None]):
        return [_read(v) for v in variables]


def _is_variable(v: Any) -> bool:
    return isinstance(v, tf.Variable) or (hasattr(v, "assign") and hasattr(v, "dtype"))


def _assign(variable: Any, value: tf.Tensor) -> Any:
    """Assign ``value``; in a graph, the op (or tensor) that does it."""
    if isinstance(variable, tf.Variable):
        return variable.assign(value, read_value=False)
    return variable.assign(value)                   # a Keras variable


def _read(variable: Any) -> tf.Tensor:
    return (variable.read_value() if isinstance(variable, tf.Variable)
            else tf.identity(tf.convert_to_tensor(variable)))


# -- alltoall ----------------------------------------------------------------------------------
@tells_peers_eagerly(messages.ALLTOALL)
def alltoall(tensor: Any, splits: Any = None, name: str | None = None,
             ignore_name_scope: bool = False,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send rows ``splits[j]`` of ``tensor`` to rank j (an even split of the first dimension
    when ``splits`` is None) and gather what every rank sent here, in rank order;
    differentiable (the gradient goes back the way the rows came).

    Returns:
        The received tensor, and also the received splits (int32, one per rank) when
        ``splits`` is given (Horovod's convention).
    """
    tensor = check_tensor(tensor, "alltoall")
    splits_t = (tf.constant([], dtype=tf.int32) if splits is None
                else tf.reshape(tf.cast(splits, tf.int32), [-1]))
    n = _ps(process_set).size()

    @tf.custom_gradient
    def exchange(x, s):
        staged = stage(x)
        key = collective_name(name, "HorovodAlltoall", process_set)

        def compute(a, sp):
            out, received = core.alltoall(a, sp if sp.size else None, key,
                                          process_set=process_set)
            return [out, received]
        out, received = run(compute, [staged, s], [staged.dtype, tf.int32],
                            [rows_shape(staged), tf.TensorShape([n])], "alltoall",
                            process_set)
        out = unstage(out, x.dtype)

        def grad(dout, unused_dsplits=None):
            dout = tf.zeros_like(out) if dout is None else dout
            back = alltoall(dout, splits=received, process_set=process_set)[0]
            return back, None
        return (out, received), grad
    out, received = exchange(tensor, splits_t)
    return out if splits is None else (out, received)


# -- reducescatter -----------------------------------------------------------------------------
def _block_rows(t: tf.Tensor, process_set: ProcessSet) -> int | None:
    """This rank's rows of a reducescatter of ``t``, when known at trace time."""
    rows = t.shape[0] if t.shape.rank else None
    if rows is None or not _ps(process_set).included():
        return None
    return block_rows(rows, _ps(process_set).size(), _ps(process_set).rank())


def _grouped_reducescatter(tensors: list[tf.Tensor], name: str | None, op: int,
                           process_set: ProcessSet, prescale_factor: float,
                           postscale_factor: float, what: str) -> list[tf.Tensor]:
    @tf.custom_gradient
    def scatter(*xs):
        staged = [stage(x) for x in xs]
        key = collective_name(name, "HorovodReducescatter" if what == "reducescatter"
                              else "HorovodGroupedReducescatter", process_set)

        def compute(*arrays):
            if len(arrays) == 1:
                return [core.reducescatter(arrays[0], op, key, prescale_factor,
                                           postscale_factor, process_set=process_set)]
            return core.grouped_reducescatter(list(arrays), op, key, prescale_factor,
                                              postscale_factor, process_set=process_set)
        shapes = [rows_shape(s, _block_rows(s, process_set)) for s in staged]
        outs = run(compute, staged, [s.dtype for s in staged], shapes, what, process_set)
        outs = [unstage(o, x.dtype) for o, x in zip(outs, xs)]

        def grad(*dys):
            # every rank's output gradient, scaled and gathered
            factor = reducescatter_grad_factor(op, prescale_factor, postscale_factor,
                                               _ps(process_set).size())
            dys = [g * tf.cast(factor, g.dtype) if factor != 1 else g
                   for g in _zeros_for(dys, outs)]
            return _grouped_allgather(dys, None, process_set, "grouped_allgather")
        return outs, grad
    return list(scatter(*tensors))


@tells_peers_eagerly(messages.REDUCESCATTER)
def reducescatter(tensor: Any, device_dense: str = "",
                  compression: type[Compressor] = Compression.none, op: int = Average,
                  name: str | None = None, process_set: ProcessSet = global_process_set,
                  ignore_name_scope: bool = False, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> tf.Tensor:
    """This rank's block of the reduction of every rank's ``tensor`` along the first
    dimension (the first ``rows % size`` ranks get one extra row); differentiable."""
    _check_op(op, "reducescatter")
    compressed, ctx = compression.compress(check_tensor(tensor, "reducescatter"))
    out = _grouped_reducescatter([compressed], name, op, process_set, prescale_factor,
                                 postscale_factor, "reducescatter")[0]
    return compression.decompress(out, ctx)


@tells_peers_eagerly(messages.REDUCESCATTER, grouped=True)
def grouped_reducescatter(tensors: Sequence[Any], device_dense: str = "",
                          compression: type[Compressor] = Compression.none,
                          op: int = Average, process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                          name: str | None = None) -> list[tf.Tensor]:
    """Reducescatter each tensor of a list, as one graph node; differentiable."""
    if not tensors:
        return tensors
    _check_op(op, "grouped_reducescatter")
    pairs = [compression.compress(check_tensor(t, "grouped_reducescatter")) for t in tensors]
    outs = _grouped_reducescatter([p[0] for p in pairs], name, op, process_set,
                                  prescale_factor, postscale_factor, "grouped_reducescatter")
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs)]
