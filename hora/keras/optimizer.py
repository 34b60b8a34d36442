"""``DistributedOptimizer`` for Keras 3: any Keras optimizer, with its gradients averaged over
the ranks before each update.

The wrapper is a Keras optimizer that holds the one it wraps (``inner_optimizer``), as Keras'
own ``LossScaleOptimizer`` does: ``apply`` (which ``fit``'s train step calls, through
``apply_gradients`` on TensorFlow) reduces the gradients and hands them to the inner
optimizer; the learning rate, the iteration count and the slot variables are the inner
optimizer's.  It is a registered Keras object (``hora>DistributedOptimizer``), so a model
saved while compiled with it loads with it again (in a process that imported hora.keras).
Horovod instead builds a subclass of the wrapped class at run time (see STYLE.md for why
hora does not), which Keras 3 no longer supports.

Layer: keras (a binding).
"""
from __future__ import annotations

from typing import Any

import keras
from keras import ops

from hora.core.gradients import LocalAccumulation, check_reduce_options, resolve_groups
from hora.core.messages import Average
from hora.core.process_sets import ProcessSet, global_process_set

from . import backend, keras2
from .compression import Compression, from_tensorflow
from .local import local_layer_list, reduce_keeping_local, with_local_layers

__all__ = ["DistributedOptimizer", "PartialDistributedOptimizer"]


def _is_variable(v: Any) -> bool:
    return isinstance(v, keras.Variable) or hasattr(v, "assign")


@keras.saving.register_keras_serializable(package="hora", name="DistributedOptimizer")
class DistributedOptimizer(keras.optimizers.Optimizer):
    """Wrap ``optimizer`` so that every update applies gradients averaged over the ranks.

    Args:
        optimizer: any Keras 3 optimizer (``keras.optimizers.SGD(...)``, ``Adam``, ...).
            Keep using the wrapper; it shares the inner optimizer's learning rate,
            iterations and slot variables.
        name: the optimizer's name (default ``Distributed<inner name>``); it also names the
            collectives.
        device_dense, device_sparse: accepted for Horovod's signature (hora reduces on the
            host).
        compression: ``Compression.none`` or ``Compression.fp16`` (send float gradients as
            float16).
        sparse_as_dense: (TensorFlow backend) reduce ``tf.IndexedSlices`` gradients as dense
            tensors instead of gathering their rows.
        gradient_predivide_factor: with Average, scale by ``1/f`` before the sum and by
            ``f/size`` after it.
        op: ``Average`` (default) or ``Sum``.
        backward_passes_per_step: gradients of this many ``apply`` calls (train steps) are
            summed locally and reduced and applied once, on the last of them; the calls in
            between change no weight.
        average_aggregated_gradients: divide those sums by ``backward_passes_per_step``.
        num_groups: deprecated, as ``groups=num_groups``.
        groups: None: every gradient in one grouped allreduce.  An int n: n grouped
            allreduces of contiguous gradients.  A list of lists of variables: one each, then
            one per variable in none of them.
        process_set: reduce over these ranks only (default: every rank).
        scale_local_gradients: divide the gradients of variables given to
            :meth:`register_local_var` (which are not reduced) by the number of ranks.

    Example:
        >>> opt = keras.optimizers.Adam(0.001 * hvd.size())
        >>> model.compile(optimizer=hvd.DistributedOptimizer(opt), loss=..., jit_compile=False)
    """

    def __new__(cls, optimizer: Any = None, *args: Any, **kwargs: Any) -> Any:
        """A Keras 2 (``tf_keras``) optimizer is wrapped by :mod:`hora.keras.keras2` (an
        optimizer of its own class, not of this one); a Keras 3 one by this class."""
        if cls is DistributedOptimizer and keras2.is_optimizer(optimizer):
            return keras2.DistributedOptimizer(optimizer, *args, **kwargs)
        return super().__new__(cls)

    def __init__(self, optimizer: keras.optimizers.Optimizer, name: str | None = None,
                 device_dense: str = "", device_sparse: str = "",
                 compression: Any = Compression.none, sparse_as_dense: bool = False,
                 gradient_predivide_factor: float = 1.0, op: int = Average,
                 backward_passes_per_step: int = 1,
                 average_aggregated_gradients: bool = False, num_groups: int = 0,
                 groups: Any = None, process_set: ProcessSet = global_process_set,
                 scale_local_gradients: bool = True, **kwargs: Any) -> None:
        del device_dense, device_sparse
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise TypeError(f"DistributedOptimizer wraps a Keras 3 optimizer, got "
                            f"{type(optimizer).__name__}")
        if isinstance(optimizer, DistributedOptimizer):
            raise ValueError("this optimizer is already a DistributedOptimizer")
        kwargs.pop("learning_rate", None)          # from a saved config: the inner one's
        if kwargs:
            raise TypeError(f"DistributedOptimizer got unexpected arguments "
                            f"{', '.join(sorted(kwargs))}")
        check_reduce_options(op, gradient_predivide_factor)
        groups = resolve_groups(num_groups, groups, _is_variable, "Keras variables")
        super().__init__(learning_rate=0.0,
                         name=name or f"Distributed{type(optimizer).__name__}")
        self.inner_optimizer = optimizer
        self.compression = compression
        self.sparse_as_dense = sparse_as_dense
        self.gradient_predivide_factor = gradient_predivide_factor
        self.op = op
        self.backward_passes_per_step = backward_passes_per_step
        self.average_aggregated_gradients = average_aggregated_gradients
        self.process_set = process_set
        self.scale_local_gradients = scale_local_gradients
        self._passes = LocalAccumulation(backward_passes_per_step, average_aggregated_gradients)
        # past Keras' attribute tracking: a list of the model's variables assigned to an
        # optimizer would join the optimizer's own variables (saved with it, and on JAX
        # passed to the train step twice)
        object.__setattr__(self, "_groups", groups)
        self._local_vars: set[int] = set()
        self._reduce = backend.make_reducer(compression, sparse_as_dense, op,
                                            gradient_predivide_factor, groups, process_set,
                                            self.name)

    # -- the inner optimizer's state, shared ------------------------------------------------
    @property
    def learning_rate(self) -> Any:
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate: Any) -> None:
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self) -> Any:
        """The inner optimizer's update count: applied updates, not ``apply`` calls, when
        ``backward_passes_per_step`` > 1."""
        return self.inner_optimizer.iterations

    @property
    def variables(self) -> list:
        return self._variables + self.inner_optimizer.variables

    def scale_loss(self, loss: Any) -> Any:
        """The wrapped optimizer's ``scale_loss``."""
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list: Any) -> None:
        """The wrapped optimizer's ``finalize_variable_values``."""
        self.inner_optimizer.finalize_variable_values(var_list)

    def register_local_var(self, var: Any) -> None:
        """Leave ``var``'s gradient local: not reduced, and divided by the number of ranks
        unless ``scale_local_gradients=False`` (Horovod's rule for local layers)."""
        self._local_vars.add(id(var))

    # -- building ---------------------------------------------------------------------------
    def build(self, var_list: list) -> None:
        """Build the inner optimizer on ``var_list``, and with ``backward_passes_per_step``
        > 1 a zeroed sum per variable and a pass counter."""
        if self.built:
            return
        if not self.inner_optimizer.built:
            self.inner_optimizer.build(var_list)
        super().build(var_list)
        self._sums: list = []
        if self._passes.passes > 1:
            self._sums = [self.add_variable_from_reference(v, name="hora_sum")
                          for v in var_list]
            self._count = self.add_variable(shape=(), dtype="int32", initializer="zeros",
                                            aggregation="none", name="hora_passes")

    # -- the update -------------------------------------------------------------------------
    def apply(self, grads: Any, trainable_variables: Any = None) -> None:
        """Reduce ``grads`` over the ranks and apply them with the inner optimizer (with
        ``backward_passes_per_step`` > 1: add them to the local sums, and reduce and apply
        the sums on every ``backward_passes_per_step``-th call)."""
        grads = list(grads)
        if not self.built:
            if trainable_variables is None:
                raise ValueError("DistributedOptimizer.apply: pass trainable_variables on "
                                 "the first call (the optimizer is not built yet)")
            with keras.name_scope(self.name, caller=self):
                self.build(list(trainable_variables))
            self.built = True
        variables = (list(trainable_variables) if trainable_variables is not None
                     else list(self._trainable_variables))
        if len(grads) != len(variables):
            raise ValueError(f"DistributedOptimizer.apply: {len(grads)} gradients for "
                             f"{len(variables)} variables")
        if self._passes.passes == 1:
            self.inner_optimizer.apply(self._reduced(grads, variables), variables)
            return
        sums = [self._sums[self._get_variable_index(v)] for v in variables]
        if keras.backend.backend() == "jax":
            self._apply_passes_jax(grads, variables, sums)
            return
        for s, g in zip(sums, grads):
            if g is not None:
                s.assign_add(g)
        self._count.assign_add(1)

        def update():
            divisor = self._passes.divisor
            total = [None if g is None else (s.value / divisor if divisor != 1.0 else s.value)
                     for s, g in zip(sums, grads)]
            self.inner_optimizer.apply(self._reduced(total, variables), variables)
            for s in sums:
                s.assign(ops.zeros_like(s))
            self._count.assign(0)

        ops.cond(ops.equal(self._count, self._passes.passes), update, lambda: None)

    def _apply_passes_jax(self, grads: list, variables: list, sums: list) -> None:
        """``backward_passes_per_step`` > 1 on Keras' JAX backend, whose train step is a pure
        function: a variable assigned inside a ``lax.cond`` branch would leak a tracer, so
        (as Keras' own gradient accumulation does there) the inner optimizer's update runs
        on every call and its results are kept only on the last pass.  The reduction alone
        is a branch of a ``lax.cond``: it runs on that pass only, and since every rank
        counts its passes alike, on every rank at once."""
        import jax
        import jax.numpy as jnp
        count = self._count.value + 1
        due = count == self._passes.passes
        totals = [None if g is None else s.value + g for s, g in zip(sums, grads)]
        divisor = self._passes.divisor

        def reduce():
            return self._reduced([None if t is None else t / divisor for t in totals],
                                 variables)

        def skip():
            return [None if t is None else jnp.zeros_like(t) for t in totals]

        if isinstance(due, jax.core.Tracer):
            reduced = jax.lax.cond(due, reduce, skip)
        else:
            reduced = reduce() if bool(due) else skip()
        inner = self.inner_optimizer
        before = [v.value for v in variables] + [v.value for v in inner.variables]
        inner.apply(reduced, variables)
        for v, old in zip(list(variables) + list(inner.variables), before):
            v.assign(jnp.where(due, v.value, old))
        for s, t in zip(sums, totals):
            if t is not None:
                s.assign(jnp.where(due, jnp.zeros_like(t), t))
        self._count.assign(jnp.where(due, 0, count))

    def _reduced(self, grads: list, variables: list) -> list:
        """``grads`` reduced over the ranks, the registered local variables' kept."""
        return reduce_keeping_local(self._reduce, grads, variables, self._local_vars,
                                    self.scale_local_gradients, self.process_set)

    # -- saving -----------------------------------------------------------------------------
    def get_config(self) -> dict[str, Any]:
        """The inner optimizer's config and the options that are plain values (a process
        set other than the global one, groups of variables and custom compressors are not
        saved: pass them again when wrapping a loaded optimizer)."""
        return {
            "name": self.name,
            "optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "compression": "fp16" if self.compression is Compression.fp16 else "none",
            "sparse_as_dense": self.sparse_as_dense,
            "gradient_predivide_factor": self.gradient_predivide_factor,
            "op": self.op,
            "backward_passes_per_step": self.backward_passes_per_step,
            "average_aggregated_gradients": self.average_aggregated_gradients,
            "groups": self._groups if isinstance(self._groups, int) else None,
            "scale_local_gradients": self.scale_local_gradients,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: Any = None
                    ) -> "DistributedOptimizer":
        """Rebuild the wrapper and the optimizer it wraps from ``get_config()``'s output, options
        included (how a saved model loads it again)."""
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("optimizer"),
                                                      custom_objects=custom_objects)
        compression = Compression.fp16 if config.pop("compression", "none") == "fp16" \
            else Compression.none
        return cls(inner, compression=compression, **config)


def PartialDistributedOptimizer(optimizer: keras.optimizers.Optimizer, name: str | None = None,
                                local_layers: Any = None, scale_local_gradients: bool = True,
                                **options: Any) -> DistributedOptimizer:
    """A :class:`DistributedOptimizer` whose ``local_layers`` (a Keras layer or a list of them)
    keep their gradients local: their trainable weights are not reduced, and their gradients
    are divided by the number of ranks unless ``scale_local_gradients=False`` (Horovod's
    ``PartialDistributedOptimizer``).  ``options`` are DistributedOptimizer's.  A Keras 2
    (``tf_keras``) optimizer gets :func:`hora.keras.keras2.PartialDistributedOptimizer`."""
    if keras2.is_optimizer(optimizer):
        return keras2.PartialDistributedOptimizer(
            optimizer, name=name, local_layers=local_layers,
            scale_local_gradients=scale_local_gradients, **options)
    layers = local_layer_list(local_layers, keras.layers.Layer)
    return with_local_layers(DistributedOptimizer(
        optimizer, name=name, scale_local_gradients=scale_local_gradients, **options), layers)


def _from_tensorflow(optimizer: Any, compression: Any = Compression.none,
                     **options: Any) -> Any:
    """``hora.tensorflow.DistributedOptimizer`` of a Keras optimizer (Horovod's hand-off):
    this module's wrapper, with hora.tensorflow's compressor as the same one under Keras'
    casts."""
    return DistributedOptimizer(optimizer, compression=from_tensorflow(compression), **options)


if backend.name() == "tensorflow":
    from hora.tensorflow import training_v1 as _tf_training_v1
    _tf_training_v1.serve_keras_optimizers(_from_tensorflow)
