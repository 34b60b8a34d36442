"""Horovod's Keras callbacks as Keras 2 (``tf_keras``) callbacks: the logic of
:mod:`hora.keras.callbacks` on ``tf_keras.callbacks.Callback``, with Keras 2's ways to reach
variables (``tf_keras.backend.get_value``/``set_value``, which also work in a
``tf.compat.v1`` graph's session).

:mod:`hora.keras.callbacks` binds its names to these classes when ``tf.keras`` is tf_keras
(``TF_USE_LEGACY_KERAS=1``; :func:`hora.keras.keras2.in_use`), so that
``hvd.callbacks.BroadcastGlobalVariablesCallback(0)`` is what a Keras 2 ``fit`` accepts.

Layer: keras (a binding).
"""
from __future__ import annotations

from typing import Any

import tensorflow as tf
import tf_keras

from . import keras2
from .callback_logic import (BroadcastLogic, LearningRateScheduleLogic,
                             LearningRateWarmupLogic, MetricAverageLogic, RankZeroSaves)

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback",
           "LearningRateScheduleCallback", "LearningRateWarmupCallback", "BestModelCheckpoint"]

_Callback = tf_keras.callbacks.Callback


class BroadcastGlobalVariablesCallback(BroadcastLogic, _Callback):
    """Give every rank ``root_rank``'s model weights and optimizer state when training starts
    (its optimizer's slots are made first), or after the first batch for a model that is
    not built before it.  In a ``tf.compat.v1`` graph, in tf_keras' session.

    Args:
        root_rank: the rank whose weights everyone takes.
        device: accepted for Horovod's signature.
        local_variables: a variable or a list of them that keep their own value on every
            rank.
    """

    def _broadcast_now(self) -> None:
        keras2.broadcast_model(self.model, self.root_rank, self._local_vars)


class MetricAverageCallback(MetricAverageLogic, _Callback):
    """At each epoch's end, replace every metric in the logs by its average over the ranks
    (put it before the callbacks that read them); every rank raises
    :class:`hora.errors.CollectiveMismatchError` when they log different metrics."""


class _Keras2Values:
    """How the schedule reads and sets values on Keras 2: a legacy optimizer's momentum is a
    variable, which a compiled train step reads at each step; the new optimizers' is a
    number baked into it, which only ``run_eagerly=True`` sees change."""

    def _read(self, value: Any) -> float:
        return float(tf_keras.backend.get_value(value) if _is_variable(value) else value)

    def _set_lr(self, value: float) -> None:
        optimizer = self.model.optimizer
        current = optimizer.learning_rate
        if _is_variable(current):
            tf_keras.backend.set_value(current, value)
        else:
            optimizer.learning_rate = value

    def _set_momentum(self, optimizer: Any, value: float) -> None:
        momentum = getattr(optimizer, "momentum")
        if _is_variable(momentum):
            tf_keras.backend.set_value(momentum, value)
        else:
            optimizer.momentum = value

    def _momentum_live(self, momentum: Any) -> bool:
        return _is_variable(momentum) or bool(self.model.run_eagerly)


def _is_variable(value: Any) -> bool:
    return isinstance(value, tf.Variable) or tf.is_tensor(value)


class LearningRateScheduleCallback(_Keras2Values, LearningRateScheduleLogic, _Callback):
    """Set the learning rate to ``initial_lr * multiplier(epoch)`` from ``start_epoch`` until
    ``end_epoch`` (arguments as :class:`hora.keras.callbacks.LearningRateScheduleCallback`'s)."""


class LearningRateWarmupCallback(_Keras2Values, LearningRateWarmupLogic, _Callback):
    """Ramp the learning rate from ``initial_lr / size`` to ``initial_lr`` over the first
    ``warmup_epochs`` epochs, a little at every batch (arguments as
    :class:`hora.keras.callbacks.LearningRateWarmupCallback`'s)."""


class BestModelCheckpoint(RankZeroSaves, tf_keras.callbacks.ModelCheckpoint):
    """tf_keras' ``ModelCheckpoint`` keeping the best model by ``monitor``, written by rank 0
    only.  ``filepath`` defaults to ``best_model.h5`` in the working directory."""

    def __init__(self, monitor: str = "val_loss", verbose: int = 0,
                 save_weights_only: bool = False, mode: str = "auto",
                 save_freq: str | int = "epoch", filepath: str | None = None) -> None:
        super().__init__(filepath=filepath or "best_model.h5", monitor=monitor,
                         verbose=verbose, save_best_only=True,
                         save_weights_only=save_weights_only, mode=mode, save_freq=save_freq)
