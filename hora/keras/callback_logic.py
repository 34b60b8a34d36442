"""What hora's Keras callbacks do, written once for Keras 3 and Keras 2: the ``*Logic`` mixins
(and the functions they share) name no Keras class; :mod:`hora.keras.callbacks` puts them on
Keras 3's ``Callback``, :mod:`hora.keras.keras2_callbacks` on tf_keras'.

Layer: keras (a binding).
"""
from __future__ import annotations

import warnings
from typing import Any, Callable

import keras
import numpy as np

from hora import core
from hora.core import stall
from hora.core.gradients import broadcast_arrays
from hora.core.messages import Average
from hora.errors import CollectiveMismatchError

def broadcast_keras_variables(variables: list, root_rank: int,
                              process_set: core.ProcessSet = core.global_process_set) -> None:
    """Assign ``root_rank``'s value of each Keras variable to it, on every rank (eagerly,
    any backend): one broadcast per variable, all in flight together."""
    variables = list(variables)
    if not variables:
        return
    arrays = [np.array(keras.ops.convert_to_numpy(v.value), order="C") for v in variables]
    for v, value in zip(variables, broadcast_arrays(arrays, root_rank, process_set)):
        v.assign(value)

def _compiled(model: Any) -> bool:
    """Whether ``model``'s train step is traced once and run compiled (so Python-side
    hyper-parameters are constants in it): TensorFlow's tf.function unless it runs eagerly,
    JAX's jit when ``jit_compile`` is on."""
    backend = keras.backend.backend()
    if model.run_eagerly:
        return False
    return backend == "tensorflow" or (backend == "jax" and bool(model.jit_compile))

def _inner(optimizer: Any) -> Any:
    """The optimizer whose hyper-parameters are set: a DistributedOptimizer's inner one."""
    return getattr(optimizer, "inner_optimizer", optimizer)

class _DeclaresValidation:
    """(Logic, for a Callback class.)  Tells the stall inspector when this rank runs validation (or ``evaluate()``), so that a
    stall it causes is explained: the classic one is validation data given to some ranks
    only, which validate at each epoch's end while the others wait in the next epoch's
    allreduces.  Horovod's scripts always have the callbacks below, so they carry it."""

    _in_fit = False

    def on_train_begin(self, logs: Any = None) -> None:
        super().on_train_begin(logs)  # type: ignore[misc]
        self._in_fit = True

    def on_train_end(self, logs: Any = None) -> None:
        super().on_train_end(logs)  # type: ignore[misc]
        self._in_fit = False

    def on_test_begin(self, logs: Any = None) -> None:
        super().on_test_begin(logs)  # type: ignore[misc]
        if self._in_fit:
            stall.set_activity("running validation inside fit()", stall.VALIDATION_ADVICE)
        else:
            stall.set_activity("running evaluate()")

    def on_test_end(self, logs: Any = None) -> None:
        super().on_test_end(logs)  # type: ignore[misc]
        stall.set_activity(None)

class BroadcastLogic(_DeclaresValidation):
    """(Logic of :class:`BroadcastGlobalVariablesCallback`; a family gives
    ``_broadcast_now()``, which broadcasts the model's variables but the local ones.)"""

    def __init__(self, root_rank: int, device: str = "", local_variables: Any = None) -> None:
        super().__init__()
        del device
        self.root_rank = root_rank
        self.broadcast_done = False
        self._local_vars: set[int] = set()
        if local_variables is not None:
            many = isinstance(local_variables, (list, tuple, set))
            for var in (local_variables if many else [local_variables]):
                self.register_local_var(var)

    def register_local_var(self, var: Any) -> None:
        """Leave ``var`` out of the broadcast (a rank-local variable)."""
        self._local_vars.add(id(var))

    def _broadcast(self) -> None:
        self._broadcast_now()
        self.broadcast_done = True

    def on_train_begin(self, logs: Any = None) -> None:
        super().on_train_begin(logs)
        if not self.broadcast_done and self.model.built:
            self._broadcast()

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        super().on_train_batch_end(batch, logs)  # type: ignore[misc]
        if not self.broadcast_done:
            self._broadcast()

class MetricAverageLogic(_DeclaresValidation):
    """(Logic of :class:`MetricAverageCallback`.)"""

    def __init__(self, device: str = "") -> None:
        super().__init__()
        del device

    def _average_metrics_in_place(self, logs: Any) -> None:
        average_metrics_in_place(logs)

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        super().on_epoch_end(epoch, logs)  # type: ignore[misc]
        self._average_metrics_in_place(logs)

def average_metrics_in_place(logs: Any) -> None:
    """Replace every number in ``logs`` by its average over the ranks (in name order);
    CollectiveMismatchError naming the ranks when they log different metrics."""
    if logs is None or core.size() == 1:
        return
    names = sorted(k for k, v in logs.items() if _is_number(v))
    everyone = core.allgather_object(names, name="hora.keras.metric_names")
    if any(other != names for other in everyone):
        lines = "; ".join(f"rank {r}: {', '.join(n) or 'none'}"
                          for r, n in enumerate(everyone))
        raise CollectiveMismatchError(
            f"MetricAverageCallback: the ranks log different metrics ({lines}).  Give "
            f"every rank validation data (its own shard) or none, so that every rank "
            f"runs the same validation inside fit()")
    values = np.array([float(logs[k]) for k in names], dtype=np.float64)
    averaged = core.allreduce(values, op=Average, name="hora.keras.metric_average")
    for k, v in zip(names, averaged):
        logs[k] = float(v)

def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float, np.number)) or (np.ndim(v) == 0 and hasattr(v, "dtype"))

class LearningRateScheduleLogic:
    """(Logic of :class:`LearningRateScheduleCallback`; a family gives ``_read(value)``,
    ``_set_lr(value)``, ``_set_momentum(optimizer, value)`` and ``_momentum_live(momentum)``:
    whether a new momentum reaches the next train step.)"""

    def __init__(self, initial_lr: float, multiplier: float | Callable[[float], float],
                 start_epoch: int = 0, end_epoch: int | None = None, staircase: bool = True,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None) -> None:
        super().__init__()
        if initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")
        self.initial_lr = initial_lr
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = 0
        self.restore_momentum: float | None = None
        self._warned = False
        if callable(multiplier):
            self.multiplier = multiplier
        else:
            self.multiplier = lambda epoch: multiplier ** (epoch - start_epoch)

    def _steps(self) -> int:
        steps = (self.params or {}).get("steps")
        if not steps:
            raise ValueError(f"{type(self).__name__}: cannot tell the number of steps per "
                             f"epoch; pass steps_per_epoch=")
        return int(steps)

    def _lr(self) -> float:
        return self._read(self.model.optimizer.learning_rate)

    def _adjust_learning_rate(self, epoch: float) -> None:
        old = self._lr()
        new = self.initial_lr * self.multiplier(epoch)
        self._set_lr(new)
        inner = _inner(self.model.optimizer)
        momentum = getattr(inner, "momentum", None)
        if not self.momentum_correction or momentum is None:
            return
        value = self._read(momentum)
        if not value or old == 0 or new == old:
            return
        if not self._momentum_live(momentum):
            if not self._warned:
                warnings.warn(f"{type(self).__name__}: momentum_correction has no effect in a "
                              f"compiled train step (TensorFlow's graph or JAX's jit, where "
                              f"the optimizer's momentum is a constant); pass "
                              f"momentum_correction=False to silence this", stacklevel=2)
                self._warned = True
            return
        self.restore_momentum = value
        self._set_momentum(inner, value * new / old)

    def on_train_begin(self, logs: Any = None) -> None:
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._steps()

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        epoch = self.current_epoch
        if epoch < self.start_epoch or (self.end_epoch is not None and epoch >= self.end_epoch):
            return
        if self.staircase:
            if batch == 0:
                self._adjust_learning_rate(epoch)
        else:
            self._adjust_learning_rate(epoch + float(batch) / self.steps_per_epoch)

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if self.restore_momentum is not None:
            self._set_momentum(_inner(self.model.optimizer), self.restore_momentum)
            self.restore_momentum = None

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if logs is not None:
            logs["lr"] = self._lr()

def warmup_multiplier(callback: Any, warmup_epochs: int) -> Callable[[float], float]:
    """The warm-up's multiplier of the (fractional) epoch: from ``1 / size`` to 1 over
    ``warmup_epochs``, counted at each batch's end so that each epoch ends on a round
    number (``callback.steps_per_epoch`` is known by the first call)."""
    def multiplier(epoch: float) -> float:
        epoch += 1.0 / callback.steps_per_epoch
        size = core.size()
        return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1)
    return multiplier

class LearningRateWarmupLogic(LearningRateScheduleLogic):
    """(Logic of :class:`LearningRateWarmupCallback`.)"""

    def __init__(self, initial_lr: float, warmup_epochs: int = 5,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None,
                 verbose: int = 0) -> None:
        super().__init__(initial_lr, warmup_multiplier(self, warmup_epochs), start_epoch=0,
                         end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)
        self.verbose = verbose

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and core.rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{self._lr():g}.")

class RankZeroSaves:
    """(Logic of :class:`BestModelCheckpoint`: a ``ModelCheckpoint`` that writes on rank 0
    only.)"""

    def _save_model(self, epoch: int, batch: Any, logs: Any) -> None:
        if core.rank() == 0:
            super()._save_model(epoch, batch, logs)  # type: ignore[misc]
