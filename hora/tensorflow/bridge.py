"""The bridge under ``hora.tensorflow``'s collectives: tensors to NumPy arrays and back,
eagerly or as one ``tf.numpy_function`` node in a graph; names fixed at trace time; the
XLA refusal; the process-set membership check; hora's errors raised as Horovod TensorFlow's
``tf.errors`` types (:mod:`hora.tensorflow.tf_errors`).  See :mod:`hora.tensorflow.mpi_ops`
for what each of these means to a user.

Layer: tensorflow (a binding: it converts tensors and never touches a socket).
"""
from __future__ import annotations

import functools
import re
import weakref
from collections.abc import Sequence
from typing import Any, Callable

import numpy as np
import tensorflow as tf
from tensorflow.python.framework.func_graph import FuncGraph
from tensorflow.python.ops import control_flow_util

from ..core.ops import tells_peers
from ..core.process_sets import ProcessSet, global_process_set, member_set_id, set_id_of
from ..errors import HoraError
from .tf_errors import core_call, install_hooks, remember, tf_error
from . import threads

__all__ = ["SUPPORTED", "tf_error", "core_call", "tells_peers_eagerly", "check_tensor",
           "check_member", "stage", "unstage", "collective_name", "refuse_xla", "run",
           "rows_shape"]

# Horovod's ops take these (its allreduce fewer, its reducescatter fewer still); hora takes
# them all for every collective, and bfloat16, staged through float32
SUPPORTED = {tf.uint8, tf.int8, tf.uint16, tf.int16, tf.int32, tf.int64, tf.float16,
             tf.bfloat16, tf.float32, tf.float64, tf.bool}

install_hooks()         # errors of graph nodes come out as eagerly (see tf_errors)


def tells_peers_eagerly(kind: int, grouped: bool = False):
    """hora.core's ``tells_peers``, eagerly: a failed argument check is told to the other
    ranks.  While tracing nothing is submitted yet, so there is nothing to tell."""
    def wrap(fn):
        told = tells_peers(kind, grouped)(fn)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            return (told if tf.executing_eagerly() else fn)(*args, **kwargs)
        return call
    return wrap


# -- tensors <-> arrays, eagerly or as a graph node --------------------------------------------
def check_tensor(tensor: Any, what: str) -> tf.Tensor:
    if isinstance(tensor, tf.IndexedSlices):
        raise TypeError(f"{what}: tf.IndexedSlices are supported by allreduce and "
                        f"grouped_allreduce only")
    try:
        t = tf.convert_to_tensor(tensor)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what}: expected a tf.Tensor, got {type(tensor).__name__}") from e
    if t.dtype not in SUPPORTED:
        raise TypeError(f"{what}: unsupported dtype {t.dtype.name} (supported: "
                        f"{', '.join(sorted(d.name for d in SUPPORTED))})")
    return t


def stage(t: tf.Tensor) -> tf.Tensor:
    return tf.cast(t, tf.float32) if t.dtype == tf.bfloat16 else t


def unstage(t: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    return tf.cast(t, dtype) if t.dtype != dtype else t


def _normalize_name(name: str) -> str:
    """Horovod's rule: anything but letters, digits and _ becomes _."""
    return re.sub("[^a-zA-Z0-9_]", "_", name)


# collectives traced so far in each outermost function graph, per process set id (the
# graphs of tf.cond branches and loop bodies count in the function that holds them)
_traced: weakref.WeakKeyDictionary[Any, dict[int, int]] = weakref.WeakKeyDictionary()


def collective_name(name: str | None, prefix: str,
                    process_set: ProcessSet | None = None) -> str | None:
    """The collective's name: ``name``; eagerly None (hora's automatic names, counted in call
    order); in a graph ``<prefix>.<function>.<k>``, fixed when it is traced: the k-th
    collective on the global set traced in that function (``<prefix>.<function>.ps<id>.<k>``
    on process set ``id``: counted per set, as the core counts its automatic names, so a
    collective traced on the members of a set only does not shift the global set's names).
    Not named after its tensor as Horovod names it: a tensor's name counts every op built
    before it, and a graph that differs by rank (an op built on some ranks only) would shift
    the names of the collectives after it."""
    if name is not None or tf.executing_eagerly():
        return name
    ps = set_id_of(process_set)
    graph = _outermost(tf.compat.v1.get_default_graph())
    counts = _traced.setdefault(graph, {})
    k = counts.get(ps, 0)
    counts[ps] = k + 1
    if not isinstance(graph, FuncGraph):    # (a function's run one at a time: see threads)
        threads.note_collective(graph, sum(counts.values()))
    # a tf.function's graph has a name; a tf.compat.v1 graph has none (one per session)
    function = _normalize_name(getattr(graph, 'name', None) or 'graph')
    return f"{prefix}.{function}.{k}" if ps == 0 else f"{prefix}.{function}.ps{ps}.{k}"


def _outermost(graph: Any) -> Any:
    """The graph whose collectives ``graph``'s are counted in: the outermost function graph
    (a ``tf.cond`` branch or loop body counts in the function that holds it); in a
    ``tf.compat.v1`` graph, that graph itself.  Never a branch's own graph: its name carries
    a counter of the graphs this process built before, which may differ by rank."""
    while isinstance(getattr(graph, "outer_graph", None), FuncGraph):
        graph = graph.outer_graph
    outer = getattr(graph, "outer_graph", None)
    if outer is not None and not tf.compat.v1.executing_eagerly_outside_functions():
        graph = outer               # built under a tf.compat.v1 graph, not eagerly
    return graph


def refuse_xla(what: str) -> None:
    if control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
        raise NotImplementedError(
            f"hora.tensorflow.{what} cannot run in an XLA-compiled function: hora's "
            f"collectives run in Python (tf.numpy_function), which XLA cannot compile. Call "
            f"it outside the compiled function, or drop jit_compile=True from that "
            f"tf.function (Keras: model.compile(jit_compile=False)).")


def check_member(process_set: ProcessSet | None, what: str) -> None:
    """Raise :class:`~hora.errors.InvalidArgumentError` (:func:`run` makes it also a
    ``tf.errors.InvalidArgumentError``, as Horovod's) unless this rank is a member of
    ``process_set``: in a graph, before the node computes anything."""
    member_set_id(process_set, what)


def run(compute: Callable[..., Sequence[Any]], inputs: Sequence[tf.Tensor],
        touts: Sequence[tf.DType], shapes: Sequence[Any], what: str,
        process_set: ProcessSet | None = None) -> list[tf.Tensor]:
    """``compute(*arrays)`` (hora's core on NumPy arrays) on ``inputs``, on this rank's
    ``process_set`` (checked first): called at once eagerly; a ``tf.numpy_function`` node
    with outputs of ``touts`` shaped ``shapes`` in a graph."""
    dtypes = [t.as_numpy_dtype for t in touts]

    if tf.executing_eagerly():
        if process_set is not None and process_set is not global_process_set:
            core_call(check_member, process_set, what)
        outs = core_call(compute, *[t.numpy() for t in inputs])
        return [tf.convert_to_tensor(np.asarray(o, dtype=d)) for o, d in zip(outs, dtypes)]

    @tf.autograph.experimental.do_not_convert
    def call(*arrays):
        try:
            check_member(process_set, what)
            outs = compute(*arrays)
        except HoraError as e:
            raise remember(e) from e    # the type TensorFlow cannot keep (see tf_errors)
        return [np.asarray(o, dtype=d) for o, d in zip(outs, dtypes)]

    refuse_xla(what)
    outs = tf.numpy_function(call, list(inputs), list(touts), stateful=True,
                             name=f"Hora{what.title().replace('_', '')}")
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    for o, s in zip(outs, shapes):
        o.set_shape(s)
    return outs


def rows_shape(t: tf.Tensor, rows: int | None = None) -> tf.TensorShape:
    """``t``'s shape with the first dimension ``rows`` (unknown by default)."""
    if t.shape.rank is None:
        return tf.TensorShape(None)
    if t.shape.rank == 0:
        return tf.TensorShape([rows])
    return tf.TensorShape([rows]).concatenate(t.shape[1:])
