"""Keras 2 (``tf_keras``) in ``hora.keras`` and ``hora.tensorflow.keras``: Horovod's Keras API
for the scripts that TensorFlow >= 2.16 runs on ``tf-keras`` with ``TF_USE_LEGACY_KERAS=1``.

Which Keras a call serves is decided by what it is given:

- ``DistributedOptimizer`` and ``PartialDistributedOptimizer``: by the optimizer's class.
  One of ``tf_keras``' (``tf_keras.optimizers.*``, ``tf_keras.optimizers.legacy.*``, or a
  subclass of their bases) is wrapped here; a Keras 3 one by :mod:`hora.keras.optimizer`.
- The callbacks, ``load_model``, ``broadcast_global_variables`` and the value collectives
  in a ``tf.compat.v1`` graph, which are given no optimizer: by ``tf.keras``.  When
  ``TF_USE_LEGACY_KERAS`` makes ``tf.keras`` tf_keras (TensorFlow's own rule, read the same
  way, on the TensorFlow backend), they are Keras 2's (:func:`in_use`).

The wrapper.  Keras 2 reads an optimizer's hyper-parameters through the optimizer's own
class (the legacy optimizers keep ``learning_rate``, ``momentum`` and ``decay`` in ``_hyper``
and answer ``lr`` for ``learning_rate``), saves it by its class name and restores its slots
by position.  So, as in Horovod, ``DistributedOptimizer(opt)`` is an optimizer of ``opt``'s
own class, made from ``opt.get_config()``: an instance of ``class SGD(_Distributed, SGD)``,
built once per class.  :class:`_Distributed` calls the class behind it through ``super()``,
never through ``self.__class__``, so the result can itself be subclassed.  A model saved
with it loads without hora.

Where gradients are reduced: in ``compute_gradients``/``_compute_gradients`` (what
``minimize`` and so ``fit``'s train step call, for the new and the legacy optimizers) and in
``get_gradients`` (what a ``tf.compat.v1`` graph's ``fit`` calls), as Horovod does; a custom
loop calls ``opt.minimize(loss, variables, tape=tape)`` or ``opt.compute_gradients`` and
``opt.apply_gradients``.  Gradients handed straight to ``apply_gradients`` are not reduced
(a ``hvd.DistributedGradientTape`` does that).  The reduction is
:class:`hora.tensorflow.training._Reducer`, through :func:`hora.keras.backend.make_reducer`.

``backward_passes_per_step`` > 1: each ``compute_gradients`` adds its gradients to local
sums; the one that completes a step returns them reduced (divided by the number of passes
with ``average_aggregated_gradients``), the others return the sums so far, and
``apply_gradients`` applies on the completing pass only and then zeroes the sums (so an
infinite gradient does not outlive its step).  As in Horovod, ``iterations`` counts every
``apply_gradients`` call, applied or not.

Layer: keras (a binding).  Imports TensorFlow and tf_keras only when called, so that
``hora.keras`` on the torch or JAX backend never does.
"""
from __future__ import annotations

import os
from typing import Any, Callable

from hora.core.gradients import LocalAccumulation, check_reduce_options, resolve_groups
from hora.core.messages import Average
from hora.core.process_sets import ProcessSet, global_process_set

from . import backend
from .compression import to_tensorflow
from .local import local_layer_list, reduce_keeping_local, with_local_layers

__all__ = ["in_use", "is_optimizer", "DistributedOptimizer", "PartialDistributedOptimizer",
           "load_model", "broadcast_model", "broadcast_variables", "broadcast_global_variables",
           "evaluate", "made_by_tf_keras", "build_optimizer", "optimizer_variables"]

# TensorFlow's switch to tf_keras, and the values it takes as "on"
LEGACY_SWITCH = "TF_USE_LEGACY_KERAS"
_ON = ("true", "True", "1")


def in_use() -> bool:
    """Whether ``tf.keras`` is Keras 2 in this process: ``TF_USE_LEGACY_KERAS`` on, tf_keras
    installed, and Keras (3) on its TensorFlow backend."""
    if os.environ.get(LEGACY_SWITCH) not in _ON or backend.name() != "tensorflow":
        return False
    try:
        import tf_keras  # noqa: F401
    except ImportError:
        return False
    return True


def made_by_tf_keras(obj: Any) -> bool:
    """Whether ``obj`` is of a tf_keras class (an optimizer of either family, a model, a
    layer), told without importing tf_keras."""
    return any(c.__module__.startswith("tf_keras.") for c in type(obj).__mro__)


def is_optimizer(obj: Any) -> bool:
    """Whether ``obj`` is a tf_keras optimizer (of either family)."""
    return made_by_tf_keras(obj) and hasattr(obj, "apply_gradients")


def _session() -> Any:
    """tf_keras' session (``tf.compat.v1.keras.backend.get_session()`` when ``tf.keras`` is
    tf_keras), which also initializes the variables Keras made."""
    from tf_keras.src import backend as k2_backend
    return k2_backend.get_session()


def evaluate(result: Any) -> Any:
    """``result`` (a tensor or an op) as a value: itself eagerly, run in tf_keras' session in
    a ``tf.compat.v1`` graph (Horovod's Keras functions return values there too)."""
    import tensorflow as tf
    if tf.executing_eagerly() or result is None:
        return result
    return _session().run(result)


# -- the optimizer --------------------------------------------------------------------------
def _is_variable(v: Any) -> bool:
    return hasattr(v, "assign") and hasattr(v, "dtype")


class _Sync:
    """What a Keras 2 DistributedOptimizer adds to its optimizer: the reduction, the local
    variables, and for ``backward_passes_per_step`` > 1 the local sums.  A plain object, so
    that TensorFlow's tracking does not save the sums in the optimizer's checkpoints."""

    def __init__(self, reduce: Callable, passes: LocalAccumulation, process_set: ProcessSet,
                 scale_local: bool) -> None:
        self.reduce = reduce
        self.passes = passes
        self.process_set = process_set
        self.scale_local = scale_local
        self.local: set[int] = set()
        self.sums: dict[Any, Any] = {}
        # the passes since the last applied step (a variable; None before the first), under
        # Horovod's name: its tests read it as ``opt._agg_helper.counter``
        self.counter: Any = None

    def reduced(self, grads: list, variables: list) -> list:
        return reduce_keeping_local(self.reduce, grads, variables, self.local,
                                    self.scale_local, self.process_set)

    def gradients(self, grads: list, variables: list) -> list:
        """What ``compute_gradients`` returns: the reduced gradients, or with several passes
        the local sums (reduced on the pass that completes a step)."""
        if self.passes.passes == 1:
            return self.reduced(grads, variables)
        return self._accumulate(grads, variables)

    def _sums_for(self, variables: list) -> list:
        import tensorflow as tf
        with tf.init_scope():                 # variables of their own, outside any function
            if self.counter is None:
                self.counter = tf.Variable(0, dtype=tf.int32, trainable=False,
                                           name="hora_passes")
            for v in variables:
                if v.ref() not in self.sums:
                    self.sums[v.ref()] = tf.Variable(tf.zeros(v.shape, v.dtype),
                                                     trainable=False, name="hora_sum")
        return [self.sums[v.ref()] for v in variables]

    def _accumulate(self, grads: list, variables: list) -> list:
        import tensorflow as tf
        present = [i for i, g in enumerate(grads) if g is not None]
        sums = self._sums_for([variables[i] for i in present])
        added = [s.assign_add(tf.convert_to_tensor(grads[i]))    # sparse rows: dense sums
                 for s, i in zip(sums, present)]
        with tf.control_dependencies(added):
            count = self.counter.assign_add(1)
        divisor = self.passes.divisor

        def reduce() -> list:
            totals = [s.read_value() / divisor if divisor != 1.0 else s.read_value()
                      for s in sums]
            out = self.reduced(totals, [variables[i] for i in present])
            return [tf.convert_to_tensor(g) for g in out]

        def keep() -> list:
            return [s.read_value() for s in sums]

        if not present:
            return list(grads)
        due = tf.equal(count, self.passes.passes)      # the same pass on every rank
        values = tf.cond(due, reduce, keep)
        out = list(grads)
        for i, value in zip(present, values if isinstance(values, (list, tuple))
                            else [values]):
            out[i] = value
        return out

    def apply_when_due(self, apply: Callable[[], Any], iterations: Any) -> Any:
        """``apply()`` on the pass that completes a step, then the sums zeroed (assigned,
        not subtracted: an infinite sum minus itself is NaN); on the others, ``iterations``
        counted alone."""
        import tensorflow as tf
        if self.counter is None:                # no gradients went through compute_gradients
            return apply()
        sums = list(self.sums.values())

        def step() -> Any:
            applied = apply()
            deps = [applied] if isinstance(applied, (tf.Operation, tf.Tensor)) else []
            with tf.control_dependencies(deps):
                resets = [s.assign(tf.zeros_like(s)) for s in sums]
                resets.append(self.counter.assign(0))
            with tf.control_dependencies(resets):
                return tf.identity(iterations)

        def skip() -> Any:
            return tf.identity(iterations.assign_add(1))

        return tf.cond(tf.equal(self.counter, self.passes.passes), step, skip)


class _Distributed:
    """hora's part of a Keras 2 DistributedOptimizer, placed in front of the user's optimizer
    class (see the module docstring)."""

    _hora: _Sync

    def compute_gradients(self, loss: Any, var_list: Any, tape: Any = None) -> list:
        """The ``(gradient, variable)`` pairs, the gradients reduced over the ranks."""
        return self._compute_gradients(loss, var_list, tape=tape)

    def _compute_gradients(self, loss: Any, var_list: Any, grad_loss: Any = None,
                           tape: Any = None) -> list:
        base = super()
        if hasattr(base, "_compute_gradients"):            # the legacy optimizers
            pairs = base._compute_gradients(loss, var_list, grad_loss=grad_loss, tape=tape)
        else:
            pairs = base.compute_gradients(loss, var_list, tape=tape)
        pairs = list(pairs)
        if not pairs:
            return pairs
        grads, variables = (list(t) for t in zip(*pairs))
        return list(zip(self._hora.gradients(grads, variables), variables))

    def get_gradients(self, loss: Any, params: Any) -> list:
        """The gradients of a ``tf.compat.v1`` graph's ``fit``, reduced over the ranks."""
        import tensorflow as tf
        grads = list(super().get_gradients(loss, params))
        return self._hora.gradients(grads, tf.nest.flatten(params))

    def apply_gradients(self, grads_and_vars: Any, *args: Any, **kwargs: Any) -> Any:
        """The optimizer's ``apply_gradients``; with ``backward_passes_per_step`` > 1 only on
        the pass that completes a step."""
        apply = super().apply_gradients
        if self._hora.passes.passes == 1:
            return apply(grads_and_vars, *args, **kwargs)
        grads_and_vars = list(grads_and_vars)       # a zip would be spent by the first use
        iterations = self.iterations                 # created outside the condition
        return self._hora.apply_when_due(lambda: apply(grads_and_vars, *args, **kwargs),
                                         iterations)

    @property
    def _agg_helper(self) -> _Sync:
        """What counts the backward passes, under Horovod's name for it (its tests read the
        count of passes since the last applied step as ``_agg_helper.counter``)."""
        return self._hora

    def register_local_var(self, var: Any) -> None:
        """Leave ``var``'s gradient local: not reduced, and divided by the number of ranks
        unless ``scale_local_gradients=False``."""
        self._hora.local.add(id(var))


_CLASSES: dict[type, type] = {}


def distributed_class(cls: type) -> type:
    """``cls`` with :class:`_Distributed` in front, under ``cls``'s name and module (so that
    Keras 2 saves it as ``cls``); one class per ``cls``."""
    if issubclass(cls, _Distributed):
        return cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(cls.__name__, (_Distributed, cls),
                             {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
    return _CLASSES[cls]


def DistributedOptimizer(optimizer: Any, name: str | None = None, device_dense: str = "",
                         device_sparse: str = "", compression: Any = None,
                         sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                         op: int = Average, backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups: Any = None, process_set: ProcessSet = global_process_set,
                         scale_local_gradients: bool = True) -> Any:
    """Horovod's ``DistributedOptimizer`` for a tf_keras optimizer: a new optimizer of its
    class, from its config, whose gradients are averaged over the ranks (arguments as
    :class:`hora.keras.DistributedOptimizer`'s; ``name`` renames the optimizer).

    Example:
        >>> opt = hvd.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(lr=0.01 * hvd.size()))
        >>> model.compile(optimizer=opt, loss="mse")
    """
    del device_dense, device_sparse
    if isinstance(optimizer, _Distributed):
        raise ValueError("this optimizer is already a DistributedOptimizer")
    check_reduce_options(op, gradient_predivide_factor)
    groups = resolve_groups(num_groups, groups, _is_variable, "tf.Variables")
    config = optimizer.get_config()
    if name:
        config["name"] = name
    wrapped = distributed_class(type(optimizer)).from_config(config)
    compression = to_tensorflow(compression)
    reduce = backend.make_reducer(compression, sparse_as_dense, op, gradient_predivide_factor,
                                  groups, process_set, config.get("name", "optimizer"))
    # past the optimizers' __setattr__ (the legacy ones route some names to hyper-parameters)
    object.__setattr__(wrapped, "_hora", _Sync(
        reduce, LocalAccumulation(backward_passes_per_step, average_aggregated_gradients),
        process_set, scale_local_gradients))
    return wrapped


def PartialDistributedOptimizer(optimizer: Any, name: str | None = None,
                                local_layers: Any = None, scale_local_gradients: bool = True,
                                **options: Any) -> Any:
    """:func:`DistributedOptimizer` whose ``local_layers``' trainable weights keep their
    gradients local (Horovod's ``PartialDistributedOptimizer``)."""
    import tf_keras

    layers = local_layer_list(local_layers, tf_keras.layers.Layer)
    return with_local_layers(DistributedOptimizer(
        optimizer, name=name, scale_local_gradients=scale_local_gradients, **options), layers)


# -- loading --------------------------------------------------------------------------------
def _optimizer_classes(legacy: bool) -> dict[str, type]:
    """tf_keras' optimizer classes by name, of one family."""
    import tf_keras
    module = tf_keras.optimizers.legacy if legacy else tf_keras.optimizers
    base = module.Optimizer
    return {name: cls for name, cls in vars(module).items()
            if isinstance(cls, type) and issubclass(cls, base) and cls is not base}


def load_model(filepath: Any, custom_optimizers: list | None = None,
               custom_objects: dict | None = None, compression: Any = None,
               legacy_opts: bool = False) -> Any:
    """A tf_keras model (h5 file or SavedModel directory), its optimizer a
    :func:`DistributedOptimizer` of the saved class, with the saved state.

    The family of a built-in optimizer is tf_keras' choice: the legacy one unless the saved
    config says otherwise (``is_legacy_optimizer``), and always in a ``tf.compat.v1`` graph
    or with ``legacy_opts=True``."""
    import tensorflow as tf
    import tf_keras

    def factory(cls_name: str, fixed: type | None) -> Callable[..., Any]:
        def make(**config: Any) -> Any:
            saved = config.pop("is_legacy_optimizer", True)
            legacy = bool(legacy_opts or saved or not tf.executing_eagerly())
            cls = fixed or _optimizer_classes(legacy)[cls_name]
            return DistributedOptimizer(cls.from_config(config), compression=compression)
        return make

    objects: dict[str, Any] = {}
    for cls_name in set(_optimizer_classes(False)) | set(_optimizer_classes(True)):
        objects[cls_name] = objects[cls_name.lower()] = factory(cls_name, None)
    for cls in custom_optimizers or []:
        objects[cls.__name__] = factory(cls.__name__, cls)
    objects.update(custom_objects or {})
    return tf_keras.models.load_model(filepath, custom_objects=objects)


# -- broadcasts -----------------------------------------------------------------------------
def build_optimizer(optimizer: Any, variables: list) -> None:
    """Create ``optimizer``'s slots for ``variables`` now (Keras 2 would on the first update),
    so that the first step starts from the root's state."""
    if hasattr(optimizer, "_create_all_weights"):          # the legacy optimizers
        optimizer._create_all_weights(variables)
    elif hasattr(optimizer, "build"):
        optimizer.build(variables)


def optimizer_variables(optimizer: Any) -> list:
    """``optimizer``'s variables (a legacy optimizer's ``variables()``, a new one's
    ``variables``)."""
    found = optimizer.variables
    return list(found() if callable(found) else found)


def broadcast_model(model: Any, root_rank: int, local_ids: set | frozenset = frozenset(),
                    build: bool = True) -> None:
    """Give every rank ``root_rank``'s weights of ``model`` (less those whose ``id`` is in
    ``local_ids``) and its optimizer's variables, eagerly or in tf_keras' session."""
    variables = [v for v in model.variables if id(v) not in local_ids]
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        if build:
            build_optimizer(optimizer, model.trainable_variables)
        variables += optimizer_variables(optimizer)
    broadcast_variables(variables, root_rank)


def broadcast_variables(variables: list, root_rank: int) -> None:
    """Assign ``root_rank``'s value of each TensorFlow variable to it, eagerly or in
    tf_keras' session."""
    import hora.tensorflow as hvd_tf
    evaluate(hvd_tf.broadcast_variables(variables, root_rank))


def broadcast_global_variables(root_rank: int, model: Any = None) -> Any:
    """``model``'s variables (eagerly), or every global variable of a ``tf.compat.v1`` graph
    run in tf_keras' session (Horovod's ``hvd.broadcast_global_variables``)."""
    import tensorflow as tf

    import hora.tensorflow as hvd_tf
    if model is not None:
        broadcast_model(model, root_rank)
        return None
    if tf.executing_eagerly():
        raise RuntimeError("hvd.broadcast_global_variables(root_rank) needs a tf.compat.v1 "
                           "graph; eagerly, pass model= (or use "
                           "hvd.callbacks.BroadcastGlobalVariablesCallback)")
    return evaluate(hvd_tf.broadcast_global_variables(root_rank))
