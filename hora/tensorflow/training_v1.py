"""Training with ``tf.compat.v1`` graphs and sessions, with Horovod's names.

``DistributedOptimizer`` wraps a ``tf.compat.v1.train.Optimizer`` so that
``compute_gradients`` (and so ``minimize``) returns gradients averaged over the ranks;
``broadcast_global_variables`` and ``BroadcastGlobalVariablesHook`` give every rank the root's
global variables.  Keras optimizers belong to ``hora.tensorflow.keras``.

Layer: tensorflow (a framework binding).  Imports hora.core and ``training`` only.
"""
from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf

from hora.core.messages import Adasum, Average
from hora.core.process_sets import ProcessSet, global_process_set

from .aggregation import LocalAggregation
from .compression import Compression
from .training import _check_grouping, _Reducer, broadcast_variables

__all__ = ["DistributedOptimizer", "broadcast_global_variables", "BroadcastGlobalVariablesHook"]

_LegacyOptimizer = tf.compat.v1.train.Optimizer


def broadcast_global_variables(root_rank: int, process_set: ProcessSet = global_process_set):
    """The op that assigns ``root_rank``'s value to every global variable (``tf.compat.v1``
    graphs only; eagerly, use ``broadcast_variables`` with the model's variables)."""
    if tf.executing_eagerly():
        raise RuntimeError("hvd.broadcast_global_variables() does not support eager execution; "
                           "use hvd.broadcast_variables(<model/optimizer variables>) instead")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank, process_set)


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """A SessionRunHook that broadcasts every global variable from ``root_rank`` once the
    session is created: every rank starts from the same weights, random or restored.

    Example:
        >>> hooks = [hvd.BroadcastGlobalVariablesHook(0)]
        >>> with tf.compat.v1.train.MonitoredTrainingSession(hooks=hooks) as sess: ...
    """

    def __init__(self, root_rank: int, device: str = '',
                 process_set: ProcessSet = global_process_set):
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.process_set = process_set
        self.bcast_op = None

    def begin(self):
        """Build the broadcast of every global variable in the session's graph."""
        if self.bcast_op is None or self.bcast_op.graph != tf.compat.v1.get_default_graph():
            with tf.device(self.device):
                self.bcast_op = broadcast_global_variables(self.root_rank, self.process_set)

    def after_create_session(self, session, coord):
        """Run the broadcast: every rank starts from ``root_rank``'s variables."""
        session.run(self.bcast_op)


class _DistributedOptimizer(_LegacyOptimizer):
    """Wraps a tf.compat.v1 optimizer: gradients are reduced over the ranks before they are
    applied.  Everything else is the wrapped optimizer's."""

    def __init__(self, optimizer, reducer, name=None, use_locking=False, aggregation=None):
        super().__init__(name=name or f"Distributed{type(optimizer).__name__}",
                         use_locking=use_locking)
        self._optimizer = optimizer
        self._reduce = reducer
        self._aggregation = aggregation

    def compute_gradients(self, *args, **kwargs):
        """The wrapped optimizer's ``(gradient, variable)`` pairs, the gradients reduced over
        the ranks (None stays None); with ``backward_passes_per_step > 1``, see
        :mod:`hora.tensorflow.aggregation`."""
        pairs = self._optimizer.compute_gradients(*args, **kwargs)
        if not pairs:
            return pairs
        grads, variables = zip(*pairs)
        if self._aggregation is not None:
            return list(zip(self._aggregation.compute_gradients(grads, variables), variables))
        return list(zip(self._reduce(grads, list(variables)), variables))

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        if self._aggregation is not None:
            grads_and_vars = list(grads_and_vars)
            return self._aggregation.apply_gradients(
                lambda: self._optimizer.apply_gradients(grads_and_vars, global_step, name),
                self._optimizer, grads_and_vars, global_step)
        return self._optimizer.apply_gradients(grads_and_vars, global_step, name)

    def get_slot(self, *args, **kwargs):
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args, **kwargs):
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args, **kwargs):
        return self._optimizer.variables(*args, **kwargs)


def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense='',
                         device_sparse='', compression=Compression.none,
                         sparse_as_dense=False, backward_passes_per_step=1,
                         op=Average, gradient_predivide_factor=1.0,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=global_process_set):
    """Wrap a ``tf.compat.v1.train.Optimizer`` so that its gradients are averaged over the
    ranks before they are applied (``minimize`` and ``compute_gradients``).

    Args:
        optimizer: a tf.compat.v1 optimizer; a Keras optimizer (Keras 3 or ``tf_keras``) is
            handed to ``hora.keras.DistributedOptimizer``, as Horovod hands it to its
            Keras wrapper (once hora.keras or hora.tensorflow.keras is imported: else
            TypeError saying so).
        name, use_locking: as the wrapped optimizer's.
        compression, sparse_as_dense, op, gradient_predivide_factor, num_groups, groups,
            process_set: as :func:`DistributedGradientTape`'s.
        device_dense, device_sparse: accepted for Horovod's signature.
        backward_passes_per_step: sum the gradients of that many steps on each rank, and
            reduce and apply them on the last (``tf.compat.v1`` graphs only; the sums are
            local variables: run ``tf.compat.v1.local_variables_initializer()``).
        average_aggregated_gradients: divide those sums by ``backward_passes_per_step``.

    Example:
        >>> opt = tf.compat.v1.train.GradientDescentOptimizer(0.01 * hvd.size())
        >>> train_op = hvd.DistributedOptimizer(opt).minimize(loss)
    """
    if not isinstance(optimizer, _LegacyOptimizer):
        return _keras_optimizer(
            optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
            compression=compression, sparse_as_dense=sparse_as_dense, op=op,
            gradient_predivide_factor=gradient_predivide_factor,
            backward_passes_per_step=backward_passes_per_step,
            average_aggregated_gradients=average_aggregated_gradients,
            num_groups=num_groups, groups=groups, process_set=process_set)
    del device_dense, device_sparse
    if op == Adasum:
        raise NotImplementedError("DistributedOptimizer: op=Adasum is not supported yet")
    groups = _check_grouping(op, gradient_predivide_factor, num_groups, groups)
    reducer = _Reducer(compression, sparse_as_dense, op, gradient_predivide_factor, groups,
                       process_set)
    aggregation = None
    if backward_passes_per_step != 1:
        if tf.executing_eagerly():
            raise ValueError("DistributedOptimizer: backward_passes_per_step > 1 is supported "
                             "in tf.compat.v1 graphs only (as in Horovod)")
        aggregation = LocalAggregation(backward_passes_per_step, reducer, sparse_as_dense,
                                       average_aggregated_gradients, name or "")
    return _DistributedOptimizer(optimizer, reducer, name, use_locking, aggregation)


# Keras optimizers are hora.keras' to wrap: it imports this binding, so this binding does not
# import it; once imported (hora.keras, hora.tensorflow.keras) it hands its wrapper here
_keras_wrapper: list[Callable[..., Any]] = []


def serve_keras_optimizers(wrap: Callable[..., Any]) -> None:
    """``wrap(optimizer, **options)`` wraps the Keras optimizers given to
    :func:`DistributedOptimizer` from now on (hora.keras calls this when imported)."""
    _keras_wrapper[:] = [wrap]


def _keras_optimizer(optimizer, **options):
    """A Keras optimizer, wrapped by hora.keras' wrapper."""
    if options["op"] == Adasum:
        raise ValueError("DistributedOptimizer: op=Adasum is not supported with Keras "
                         "optimizers")
    if not _keras_wrapper:
        raise TypeError(
            f"hora.tensorflow.DistributedOptimizer got a Keras optimizer "
            f"({type(optimizer).__name__}): its wrapper is hora.keras', which is not imported "
            f"in this process yet.  `import hora.tensorflow.keras` (or hora.keras) before "
            f"this call, or wrap it with hora.tensorflow.keras.DistributedOptimizer.")
    return _keras_wrapper[0](optimizer, **options)
