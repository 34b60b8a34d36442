"""Local gradient aggregation for the ``tf.compat.v1`` ``DistributedOptimizer``
(``backward_passes_per_step > 1``): gradients are summed on each rank for that many steps
and reduced over the ranks once, on the last; the wrapped optimizer applies them on that
step only.  Graph mode only (a ``tf.compat.v1`` graph run by a session), as in Horovod.

The behaviour is Horovod's (``LocalGradientAggregationHelper``):

- ``compute_gradients`` returns, on the step that completes a round, the reduction of the
  round's sums (divided by the number of steps with ``average_aggregated_gradients``);
  on the other steps this step's gradients unreduced (they are not applied).
- ``apply_gradients`` applies on the round's last step only; on the others it advances
  ``global_step`` (and an optimizer's ``iterations``) instead, so that it counts steps as
  without aggregation.
- The sums and the step counter are local variables (``tf.compat.v1.GraphKeys.
  LOCAL_VARIABLES``): ``tf.compat.v1.local_variables_initializer()`` (or a
  ``MonitoredTrainingSession``) initializes them.

Layer: tensorflow (a binding).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import tensorflow as tf

__all__ = ["LocalAggregation"]


class LocalAggregation:
    """Sums gradients over ``steps`` calls, and reduces them with ``reduce`` on the last.

    Args:
        steps: the number of backward passes per reduction (>= 1).
        reduce: ``reduce(grads, variables)``, the reduction of a list of gradients.
        sparse_as_dense: densify ``tf.IndexedSlices`` (required for them: a sum of slices
            is kept dense).
        average: divide the sums by ``steps`` before they are returned.
        name: distinguishes the variables of several optimizers in one graph.
    """

    def __init__(self, steps: int, reduce: Callable[[list[Any], list[Any]], list[Any]],
                 sparse_as_dense: bool, average: bool, name: str = "") -> None:
        if steps <= 0:
            raise ValueError(f"backward_passes_per_step must be > 0, got {steps}")
        self.steps = steps
        self._reduce = reduce
        self._sparse_as_dense = sparse_as_dense
        self._average = average
        self._name = name
        self.counter = None
        self._sums: list[Any] = []

    def _dense(self, grad: Any) -> Any:
        if isinstance(grad, tf.IndexedSlices):
            if not self._sparse_as_dense:
                raise ValueError("DistributedOptimizer: tf.IndexedSlices gradients need "
                                 "sparse_as_dense=True when backward_passes_per_step > 1")
            return tf.convert_to_tensor(grad)
        return grad

    def _local(self, name: str, initial: tf.Tensor) -> tf.Variable:
        return tf.compat.v1.Variable(initial, name=name, trainable=False,
                                     collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES])

    def compute_gradients(self, grads: Sequence[Any], variables: Sequence[Any]) -> list[Any]:
        """Add ``grads`` to the sums; the reduced sums on a round's last step, else
        ``grads`` (None stays None)."""
        if tf.executing_eagerly():
            raise ValueError("backward_passes_per_step > 1 is supported in tf.compat.v1 "
                             "graphs only (Horovod's rule); eagerly, accumulate the "
                             "gradients yourself or use DistributedGradientTape")
        present = [i for i, g in enumerate(grads) if g is not None]
        dense = [self._dense(grads[i]) for i in present]
        with tf.compat.v1.name_scope(f"hora_aggregation_{self._name}"):
            self.counter = self._local("steps", tf.constant(0, tf.int32))
            self._sums = [self._local(f"sum_{i}", tf.zeros(g.shape, g.dtype))
                          for i, g in zip(present, dense)]
        # a new round starts from zero, then this step's gradients are added and counted
        clear = tf.cond(tf.equal(self.counter, 0),
                        lambda: tf.group(*[s.assign(tf.zeros_like(s)) for s in self._sums]),
                        tf.no_op)
        with tf.control_dependencies([clear]):
            added = tf.group(*[s.assign_add(g) for s, g in zip(self._sums, dense)])
        with tf.control_dependencies([added]):
            counted = self.counter.assign_add(1)
        with tf.control_dependencies([counted]):
            out = tf.cond(tf.equal(self.counter, self.steps),
                          lambda: self._round_end([variables[i] for i in present]),
                          lambda: [tf.identity(g) for g in dense])
        out = list(out) if isinstance(out, (list, tuple)) else [out]
        result: list[Any] = [None] * len(grads)
        for i, g in zip(present, out):
            result[i] = g
        return result

    def _round_end(self, variables: list[Any]) -> list[tf.Tensor]:
        """The reduction of the sums, divided with ``average``; the counter back to 0."""
        sums = [s.read_value() for s in self._sums]
        with tf.control_dependencies(sums):
            reduced = self._reduce(sums, variables)
        with tf.control_dependencies([r for r in reduced if r is not None]):
            reset = self.counter.assign(0)
        with tf.control_dependencies([reset]):
            if self._average:
                return [r / tf.cast(self.steps, r.dtype) for r in reduced]
            return [tf.identity(r) for r in reduced]

    def apply_gradients(self, apply: Callable[[], Any], optimizer: Any,
                        grads_and_vars: Sequence[tuple[Any, Any]],
                        global_step: Any = None) -> tf.Operation:
        """``apply()`` on a round's last step (the counter is back at 0); on the others,
        ``global_step`` and the optimizer's ``iterations`` (if it has them) move on."""
        def skip():
            iterations = getattr(optimizer, "iterations", None)
            return tf.no_op() if iterations is None else iterations.assign_add(1).op

        def step_on():
            if global_step is None:
                return tf.no_op()
            return global_step.assign_add(tf.constant(1, global_step.dtype.base_dtype),
                                          read_value=False)
        grads = [g for g, _ in grads_and_vars if g is not None]
        with tf.control_dependencies([tf.group(*grads)]):
            applied = tf.cond(tf.equal(self.counter, 0), lambda: tf.group(apply()), skip)
        with tf.control_dependencies([applied]):
            return tf.cond(tf.equal(self.counter, 0), tf.no_op, step_on)
