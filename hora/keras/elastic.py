"""``hvd.elastic``: Horovod's elastic training names for Keras 3, on every backend hora.keras
serves (tensorflow, torch, jax).

- :class:`KerasState`: a model's weights and its optimizer's variables, plus plain values,
  committed, restored and synced from rank 0.
- :class:`CommitStateCallback`, :class:`UpdateBatchStateCallback`,
  :class:`UpdateEpochStateCallback`: keep ``state.batch`` and ``state.epoch`` current during
  ``fit`` and commit the state every few batches and at each epoch's end.
- :func:`run`: the recovery loop of :mod:`hora.elastic`.

A typical script (Horovod's, but for the import)::

    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    callbacks = [hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.CommitStateCallback(state, batches_per_commit=10)]

    @hvd.elastic.run
    def train(state):
        state.model.fit(x, y, epochs=epochs - state.epoch, callbacks=callbacks)

    train(state)

Layer: keras (a binding).
"""
from __future__ import annotations

from typing import Any, Callable

import keras
import numpy as np

from hora.core import broadcast_object, rank
from hora.elastic import ObjectState, State
from hora.elastic import run as _elastic_run
from hora.elastic import unwrap_internal_errors

from . import keras2
from .callbacks import broadcast_keras_variables

__all__ = ["run", "State", "ObjectState", "KerasState", "CommitStateCallback",
           "UpdateBatchStateCallback", "UpdateEpochStateCallback"]


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate an elastic training function ``func(state, ...)`` (Horovod's ``run``).

    The wrapper syncs ``state`` from rank 0 and calls ``func``; when a rank fails it restores
    the last commit, re-forms the job and calls ``func`` again; when hosts are added or
    removed it re-forms the job without the restore (see :func:`hora.elastic.run_fn`).  A
    hora collective that fails inside a compiled train step reaches Python wrapped in the
    backend's own error (TensorFlow's ``UnknownError``, JAX's runtime error), which only
    names it: one that names a ``HoraInternalError`` counts as a failed rank.
    """
    return _elastic_run(unwrap_internal_errors(func))


def _copy(variable: Any) -> np.ndarray:
    """The variable's value now, as a NumPy array of its own (on torch a CPU tensor's NumPy
    view shares its memory, which the next update would change).  Through ``ops.copy``: a
    TensorFlow variable handed to NumPy directly warns with NumPy 2.  A tf_keras model's
    variables are TensorFlow's own, which read their value themselves."""
    if not isinstance(variable, keras.Variable):
        return np.array(variable.numpy(), copy=True)
    return np.array(keras.ops.convert_to_numpy(keras.ops.copy(variable)), copy=True)


class KerasState(ObjectState):
    """Elastic state of a Keras model and its optimizer, and plain values.

    :meth:`commit` keeps NumPy copies of the model's weights (``model.get_weights()``:
    trainable and not) and of the optimizer's variables (its slots, iteration count and
    learning rate); :meth:`restore` puts them back (``model.set_weights``, ``assign``);
    :meth:`sync` gives every rank rank 0's current values (one broadcast per variable) and
    commits them.  An optimizer that is not built yet (Keras 3 builds it on the first
    update) is built for the model's trainable variables first, so that its slots are part
    of every commit from the start.  Keywords are handled as in
    ``hora.elastic.ObjectState``.

    Args:
        model: a built Keras model (``ValueError`` otherwise).
        optimizer: its optimizer; default ``model.optimizer`` (none, as before ``compile``:
            the weights only).
        **kwargs: plain attributes and their initial values (``epoch``, ``batch`` for the
            callbacks of this module).

    Example::

        state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    """

    def __init__(self, model: Any, optimizer: Any = None, **kwargs: Any) -> None:
        if not model.built:
            raise ValueError("hvd.elastic.KerasState: build the model first "
                             "(model.build(input_shape), or call it on a batch)")
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        self._save_model()
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **kwargs)

    def _optimizer_variables(self) -> list:
        if self.optimizer is None:
            return []
        if keras2.is_optimizer(self.optimizer):
            keras2.build_optimizer(self.optimizer, self.model.trainable_variables)
            return keras2.optimizer_variables(self.optimizer)
        if not self.optimizer.built:
            self.optimizer.build(self.model.trainable_variables)
        return list(self.optimizer.variables)

    def save(self) -> None:
        self._save_model()
        super().save()

    def restore(self) -> None:
        self.model.set_weights(self._saved_weights)
        for variable, value in self._saved_optimizer:
            variable.assign(value)
        super().restore()

    def sync(self) -> None:
        variables = list(self.model.weights) + self._optimizer_variables()
        if keras2.made_by_tf_keras(self.model):
            keras2.broadcast_variables(variables, 0)
        else:
            broadcast_keras_variables(variables, 0)
        self._save_model()
        super().sync()

    def _save_model(self) -> None:
        self._saved_weights = [np.array(w, copy=True) for w in self.model.get_weights()]
        # (variable, value) pairs: a restore puts each value back where it came from
        self._saved_optimizer = [(v, _copy(v)) for v in self._optimizer_variables()]


def _model_synced(callback: keras.callbacks.Callback) -> None:
    """Bring the model's variables up to date: on JAX, ``fit`` keeps the training state
    outside them between steps, and reading ``callback.model`` writes it back."""
    callback.model  # noqa: B018 - the property's side effect is the point


class CommitStateCallback(keras.callbacks.Callback):
    """Commit ``state`` every ``batches_per_commit`` training batches and at each epoch's end.

    The count starts again at every ``fit`` (so that, after a reset, every rank commits at
    the same batches).  Put it after :class:`UpdateBatchStateCallback` and
    :class:`UpdateEpochStateCallback`, so that a commit holds the batch and epoch just
    finished.

    Args:
        state: the state to commit.
        batches_per_commit: batches between two commits (default 1: every batch).
    """

    def __init__(self, state: State, batches_per_commit: int = 1) -> None:
        super().__init__()
        if batches_per_commit < 1:
            raise ValueError(f"batches_per_commit must be at least 1, got "
                             f"{batches_per_commit}")
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs: Any = None) -> None:
        self.batches_remaining = self.batches_per_commit

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.commit()

    def commit(self) -> None:
        """Commit the state (its model's variables brought up to date first)."""
        _model_synced(self)
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Set ``state.batch`` to the index of each training batch when it ends, and back to 0 at
    each epoch's end.

    When ``fit`` knows its steps per epoch, the ``steps`` in the callbacks' ``params`` (what
    the progress bar shows) is lowered by ``state.batch`` at each epoch's start, as
    Horovod does.  Keras 3 runs the epoch's full length regardless: to resume in the middle
    of an epoch, give ``fit`` the shorter ``steps_per_epoch`` yourself.

    Args:
        state: a state with a ``batch`` attribute.
    """

    def __init__(self, state: Any) -> None:
        super().__init__()
        self.state = state
        self.steps_per_epoch: int | None = None

    def on_train_begin(self, logs: Any = None) -> None:
        self.steps_per_epoch = None

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        steps = (self.params or {}).get("steps")
        if steps:
            if self.steps_per_epoch is None:
                self.steps_per_epoch = steps
            self.params["steps"] = self.steps_per_epoch - self.state.batch

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.state.batch = batch

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Set ``state.epoch`` at each epoch's end to the number of epochs finished, counted over
    every ``fit`` call and reset: the value it had when ``fit`` started, plus the epochs of
    this ``fit`` so far.

    Keras numbers a ``fit``'s epochs from 0 (or ``initial_epoch``): call ``fit`` with
    ``epochs=total - state.epoch`` and no ``initial_epoch``, as Horovod's examples do.

    Args:
        state: a state with an ``epoch`` attribute.
    """

    def __init__(self, state: Any) -> None:
        super().__init__()
        self.state = state
        self.initial_epoch = state.epoch

    def on_train_begin(self, logs: Any = None) -> None:
        self.initial_epoch = self.state.epoch

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        # + 1: a reset right after this epoch (state.batch is 0 again) starts the next one
        self.state.epoch = self.initial_epoch + epoch + 1
