"""``import hora.keras as hvd``: Horovod's Keras API on Keras 3, for its TensorFlow, torch and JAX
backends alike (``KERAS_BACKEND``).

The classic Horovod Keras script runs unchanged but for its import::

    import hora.keras as hvd            # or: import hora.tensorflow.keras as hvd
    hvd.init()
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.001 * hvd.size()))
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy", jit_compile=False)
    model.fit(x_shard, y_shard, callbacks=[
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(0.001 * hvd.size(), warmup_epochs=3),
    ], verbose=1 if hvd.rank() == 0 else 0)

Keras 2 (``tf_keras``, TensorFlow's ``tf.keras`` with ``TF_USE_LEGACY_KERAS=1``) is served
too, by :mod:`hora.keras.keras2`: ``DistributedOptimizer`` wraps a tf_keras optimizer as
Horovod does, and when ``tf.keras`` is tf_keras the callbacks, ``load_model``,
``broadcast_global_variables`` and the value collectives of a ``tf.compat.v1`` graph are
Keras 2's (see that module for how the family is decided).

``jit_compile=False`` on TensorFlow: hora's collectives run in Python, which XLA cannot
compile there (Keras turns XLA on by itself on a GPU; on a CPU it stays off).  On JAX the
train step may be jitted (Keras' default): hora.jax's collectives are host callbacks inside
it.  On another Keras backend importing this module raises ImportError naming it.

Layer: keras (a binding).
"""
from __future__ import annotations

from typing import Any, Optional

from . import backend as _backend

_backend.check_served()

import keras  # noqa: E402
import numpy as np  # noqa: E402

from hora import core as _core  # noqa: E402
from hora.core import (ProcessSet, add_process_set, cross_rank, cross_size,  # noqa: E402
                       global_process_set, init, is_homogeneous, is_initialized, local_rank,
                       local_size, rank, remove_process_set, shutdown, size)
from hora.core.build_info import (ccl_built, cuda_built, ddl_built,  # noqa: E402,F401
                                  gloo_built, gloo_enabled, mpi_built, mpi_enabled,
                                  mpi_threads_supported, nccl_built, rocm_built,
                                  start_timeline, stop_timeline)
from hora.core.messages import Average, Sum  # noqa: E402
from hora.errors import HoraError, HoraInternalError, HorovodInternalError  # noqa: E402

from . import callbacks, elastic, keras2  # noqa: E402
from .callbacks import broadcast_keras_variables  # noqa: E402
from .compression import Compression, to_tensorflow  # noqa: E402
from .optimizer import DistributedOptimizer, PartialDistributedOptimizer  # noqa: E402


def broadcast_global_variables(root_rank: int, model: Any = None) -> Any:
    """Give every rank ``root_rank``'s variables.

    On the TensorFlow backend in a ``tf.compat.v1`` graph, every global variable (Horovod's
    meaning; returns the op).  Keras 3 keeps no global list of variables, so eagerly pass
    ``model=``: its weights and its optimizer's state are broadcast (what
    :class:`callbacks.BroadcastGlobalVariablesCallback` does when training starts).  On
    Keras 2 (:func:`keras2.in_use`) a graph's broadcast runs in tf_keras' session.
    """
    if keras2.in_use():
        return keras2.broadcast_global_variables(root_rank, model)
    if model is not None:
        variables = list(model.variables)
        if model.optimizer is not None and model.optimizer.built:
            variables += list(model.optimizer.variables)
        broadcast_keras_variables(variables, root_rank)
        return None
    if _backend.name() == "tensorflow":
        import hora.tensorflow as _tf
        return _tf.broadcast_global_variables(root_rank)
    raise RuntimeError("hvd.broadcast_global_variables(root_rank): Keras 3 keeps no global "
                       "list of variables; pass model= (or use "
                       "hvd.callbacks.BroadcastGlobalVariablesCallback)")


def _keras2_graph() -> bool:
    """Keras 2 in a ``tf.compat.v1`` graph: the value collectives run in its session."""
    if not keras2.in_use():
        return False
    import tensorflow as tf
    return not tf.executing_eagerly()


def _in_session(collective: str, value: Any, **kwargs: Any) -> Any:
    """hora.tensorflow's ``collective`` of ``value``, run in tf_keras' session (Horovod's
    Keras functions in graph mode)."""
    import tensorflow as tf

    import hora.tensorflow as hvd_tf
    return keras2.evaluate(getattr(hvd_tf, collective)(tf.constant(value), **kwargs))


def _tensor(value: Any) -> Any:
    return keras.ops.convert_to_tensor(value)


def _array(value: Any) -> np.ndarray:
    return np.asarray(keras.ops.convert_to_numpy(value))


def allreduce(value: Any, name: Optional[str] = None, average: Optional[bool] = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              op: Optional[int] = None, compression: Any = Compression.none) -> Any:
    """The reduction over every rank of a tensor-like ``value`` (default: the average), as a
    backend tensor.  ``compression`` applies to floating-point values."""
    if average is not None and op is not None:
        raise ValueError("pass either op= or the deprecated average=, not both")
    if op is None:
        op = Sum if average is False else Average
    if _keras2_graph():
        return _in_session("allreduce", value, name=name, op=op, prescale_factor=prescale_factor,
                           postscale_factor=postscale_factor,
                           compression=to_tensorflow(compression))
    sent, ctx = compression.compress(_tensor(value))
    out = _core.allreduce(_array(sent), op=op, name=name, prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor)
    return compression.decompress(_tensor(out), ctx)


def allgather(value: Any, name: Optional[str] = None) -> Any:
    """Every rank's ``value`` concatenated along the first dimension, in rank order."""
    if _keras2_graph():
        return _in_session("allgather", value, name=name)
    return _tensor(_core.allgather(_array(value), name=name))


def broadcast(value: Any, root_rank: int, name: Optional[str] = None) -> Any:
    """``root_rank``'s ``value``, on every rank."""
    if _keras2_graph():
        return _in_session("broadcast", value, root_rank=root_rank, name=name)
    return _tensor(_core.broadcast(_array(value), root_rank, name=name))


def reducescatter(value: Any, name: Optional[str] = None, op: int = Average) -> Any:
    """This rank's block (along the first dimension) of the reduction of every rank's
    ``value``."""
    if _keras2_graph():
        return _in_session("reducescatter", value, name=name, op=op)
    return _tensor(_core.reducescatter(_array(value), op=op, name=name))


def load_model(filepath: Any, custom_optimizers: Optional[list] = None,
               custom_objects: Optional[dict] = None, compression: Any = Compression.none,
               legacy_opts: bool = False) -> Any:
    """Load a saved Keras model, its optimizer wrapped in a :class:`DistributedOptimizer`.

    A model saved while compiled with a DistributedOptimizer loads with it again, options
    included; one saved with a plain optimizer gets it wrapped (with ``compression``),
    keeping the optimizer state read from the file.

    Args:
        filepath: the ``.keras`` file.
        custom_optimizers: optimizer classes of your own that the file uses.
        custom_objects: as for ``keras.models.load_model``.
        compression: for an optimizer that was saved unwrapped.
        legacy_opts: Keras 2: the optimizer family when the file does not say (Keras 3 has
            no legacy optimizers).

    When ``tf.keras`` is tf_keras (:func:`keras2.in_use`), a Keras 2 model (h5 file or
    SavedModel directory) is loaded by :func:`keras2.load_model`.
    """
    if keras2.in_use():
        return keras2.load_model(filepath, custom_optimizers, custom_objects, compression,
                                 legacy_opts)
    objects = {"DistributedOptimizer": DistributedOptimizer}
    for cls in custom_optimizers or []:
        objects[cls.__name__] = cls
    objects.update(custom_objects or {})
    model = keras.models.load_model(filepath, custom_objects=objects)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and not isinstance(optimizer, DistributedOptimizer):
        wrapped = DistributedOptimizer(optimizer, compression=compression)
        if optimizer.built:
            wrapped.build(model.trainable_variables)
        model.optimizer = wrapped
        model.train_function = None          # the next fit() traces its step with it
    return model


__all__ = [
    "init", "shutdown", "is_initialized", "size", "local_size", "cross_size", "rank",
    "local_rank", "cross_rank", "is_homogeneous", "mpi_threads_supported", "mpi_enabled",
    "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built",
    "cuda_built", "rocm_built", "start_timeline", "stop_timeline", "ProcessSet",
    "global_process_set", "add_process_set", "remove_process_set", "Average", "Sum",
    "Compression", "DistributedOptimizer", "PartialDistributedOptimizer",
    "broadcast_global_variables", "allreduce",
    "allgather", "broadcast", "reducescatter", "load_model", "callbacks", "elastic",
    "HorovodInternalError", "HoraInternalError", "HoraError",
]
