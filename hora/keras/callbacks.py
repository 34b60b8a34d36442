"""Keras callbacks for distributed training, with Horovod's names and semantics.

- :class:`BroadcastGlobalVariablesCallback`: every rank starts from the root's weights and
  optimizer state.
- :class:`MetricAverageCallback`: the epoch's logged metrics, averaged over the ranks.
- :class:`LearningRateScheduleCallback` and :class:`LearningRateWarmupCallback`: the
  learning rate as a function of the (fractional) epoch, and the gradual warm-up from
  ``lr / size`` to ``lr`` that large-batch training needs.
- :class:`BestModelCheckpoint`: Keras' best-only ``ModelCheckpoint``, written by rank 0
  alone.

They run eagerly between train steps, on any Keras backend hora serves.  Their logic is
written once, in the ``*Logic`` mixins of :mod:`hora.keras.callback_logic`; the classes here
put it on Keras 3's ``Callback``, and :mod:`hora.keras.keras2_callbacks` on Keras 2's.
When ``tf.keras`` is tf_keras (``TF_USE_LEGACY_KERAS=1``, see :func:`hora.keras.keras2.in_use`)
this module's names are the Keras 2 classes, as Horovod's ``tf.keras`` callbacks then are.

Layer: keras (a binding).
"""
from __future__ import annotations

from typing import Any

import keras

from .callback_logic import (BroadcastLogic, LearningRateScheduleLogic,  # noqa: F401
                             LearningRateWarmupLogic, MetricAverageLogic, RankZeroSaves,
                             _compiled, broadcast_keras_variables)

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback",
           "LearningRateScheduleCallback", "LearningRateWarmupCallback", "BestModelCheckpoint"]


class BroadcastGlobalVariablesCallback(BroadcastLogic, keras.callbacks.Callback):
    """Give every rank ``root_rank``'s model weights and optimizer state when training starts.

    The broadcast happens at ``on_train_begin`` once the model and its optimizer are built
    (``fit`` builds them first), so the first step already starts from the same weights
    everywhere (Horovod broadcasts after the first batch); for a model that ``fit`` cannot
    build before its first batch, after that batch, as Horovod does.

    Args:
        root_rank: the rank whose weights everyone takes.
        device: accepted for Horovod's signature.
        local_variables: a variable or a list of them that keep their own value on every
            rank (as :meth:`register_local_var`).
    """

    def _broadcast_now(self) -> None:
        optimizer = self.model.optimizer
        if optimizer is not None and not optimizer.built:
            optimizer.build(self.model.trainable_variables)
        variables = [v for v in self.model.variables if id(v) not in self._local_vars]
        if optimizer is not None:
            variables += list(optimizer.variables)
        broadcast_keras_variables(variables, self.root_rank)


class MetricAverageCallback(MetricAverageLogic, keras.callbacks.Callback):
    """At each epoch's end, replace every metric in the logs by its average over the ranks,
    for the callbacks after this one (put it before them) and the progress bar.

    Every rank must log the same metrics: when validation runs on some ranks only (one gave
    ``fit`` ``validation_data``, another did not), every rank raises
    :class:`hora.errors.CollectiveMismatchError` naming the ranks and the metrics.

    Args:
        device: accepted for Horovod's signature.
    """


class _Keras3Values:
    """How the schedule reads and sets values on Keras 3."""

    def _read(self, value: Any) -> float:
        return float(keras.ops.convert_to_numpy(value))

    def _set_lr(self, value: float) -> None:
        self.model.optimizer.learning_rate = value

    def _set_momentum(self, optimizer: Any, value: float) -> None:
        optimizer.momentum = value

    def _momentum_live(self, momentum: Any) -> bool:
        return not _compiled(self.model)


class LearningRateScheduleCallback(_Keras3Values, LearningRateScheduleLogic,
                                   keras.callbacks.Callback):
    """Set the learning rate to ``initial_lr * multiplier(epoch)`` from ``start_epoch`` until
    ``end_epoch``.

    Args:
        initial_lr: the learning rate the multiplier scales (required, as in Horovod).
        multiplier: a function of the epoch, or a number ``m`` for ``m ** (epoch -
            start_epoch)`` (exponential decay).
        start_epoch, end_epoch: the epochs it acts on (``end_epoch`` None: to the end).
        staircase: True: change it at each epoch's start; False: at every batch, with the
            fractional epoch ``epoch + batch / steps_per_epoch``.
        momentum_correction: when the rate changes, scale SGD's momentum by new/old rate for
            that batch (Goyal et al.), where the optimizer reads its momentum at each step
            (the torch backend, ``run_eagerly=True``, or a Keras 2 legacy optimizer, whose
            momentum is a variable); a compiled TensorFlow or JAX train step has a Keras 3
            optimizer's momentum baked in, and a warning says it is left alone.
        steps_per_epoch: batches per epoch, for ``staircase=False`` (default: from ``fit``).
    """


class LearningRateWarmupCallback(_Keras3Values, LearningRateWarmupLogic,
                                 keras.callbacks.Callback):
    """Ramp the learning rate from ``initial_lr / size`` to ``initial_lr`` over the first
    ``warmup_epochs`` epochs, a little at every batch (Goyal et al.'s gradual warm-up for
    large batches: scale the rate by ``size`` and warm it up).

    Args:
        initial_lr: the rate reached at the end of the warm-up (usually ``lr * size``).
        warmup_epochs: the warm-up's length in epochs.
        momentum_correction, steps_per_epoch: as for :class:`LearningRateScheduleCallback`.
        verbose: > 0: rank 0 prints when the warm-up ends.
    """


class BestModelCheckpoint(RankZeroSaves, keras.callbacks.ModelCheckpoint):
    """Keras' ``ModelCheckpoint`` keeping the best model by ``monitor``, written by rank 0
    only (the other ranks hold the same weights).

    Args:
        monitor, verbose, save_weights_only, mode, save_freq: as Keras'.
        filepath: where to write (Horovod leaves it to be set later, as its Spark estimator
            does); default ``best_model.keras`` (``best_model.weights.h5`` with
            ``save_weights_only``) in the working directory.
    """

    def __init__(self, monitor: str = "val_loss", verbose: int = 0,
                 save_weights_only: bool = False, mode: str = "auto",
                 save_freq: str | int = "epoch", filepath: str | None = None) -> None:
        if filepath is None:
            filepath = "best_model.weights.h5" if save_weights_only else "best_model.keras"
        super().__init__(filepath=filepath, monitor=monitor, verbose=verbose,
                         save_best_only=True, save_weights_only=save_weights_only, mode=mode,
                         save_freq=save_freq)


from . import keras2 as _keras2  # noqa: E402

if _keras2.in_use():                                  # tf.keras is tf_keras: Keras 2's
    from .keras2_callbacks import *  # noqa: E402,F401,F403
