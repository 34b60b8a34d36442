"""``hvd.elastic``: Horovod's elastic training names for TensorFlow 2.

``TensorFlowState`` (a list of ``tf.Variable``\\ s) and ``TensorFlowKerasState`` (a Keras
model and its optimizer) commit, restore and sync like ``hora.elastic.ObjectState``, plus
plain values given as keywords.  ``run`` is the recovery loop of :mod:`hora.elastic`, with one
more translation: a hora error raised inside a ``tf.function`` reaches Python as a
``tf.errors.UnknownError`` that only names it, and ``run`` treats one that names a
``HoraInternalError`` (a rank failed) as that error.

Eager TensorFlow only: the TensorFlow 1 session forms (``session=``, a ``tf.compat.v1``
graph) raise ``NotImplementedError``.

Layer: tensorflow (a binding).
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import tensorflow as tf

from ..core import broadcast_object, rank
from ..elastic import ObjectState, State
from ..elastic import run as _elastic_run
from ..elastic import unwrap_internal_errors
from .training import broadcast_variables

__all__ = ["run", "State", "ObjectState", "TensorFlowState", "TensorFlowKerasState"]


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate an elastic training function ``func(state, ...)`` (Horovod's ``run``).

    The wrapper syncs ``state`` from rank 0 and calls ``func``; when a rank fails it restores
    the last commit, re-forms the job and calls ``func`` again; when hosts are added or
    removed it re-forms the job without the restore (see :func:`hora.elastic.run_fn`).  A
    ``tf.errors.OpError`` whose message names a ``HoraInternalError`` (raised by a
    collective inside a ``tf.function``, such as Keras' train step) counts as a failed rank.

    Example::

        @hvd.elastic.run
        def train(state):
            for state.epoch in range(state.epoch, epochs):
                train_one_epoch(state.model)
                state.commit()
    """
    return _elastic_run(unwrap_internal_errors(func, (tf.errors.OpError,)))


def _eager_only(what: str, session: Any = None) -> None:
    if session is not None or not tf.executing_eagerly():
        raise NotImplementedError(
            f"hvd.elastic.{what}: TensorFlow 1 sessions and tf.compat.v1 graphs are not "
            f"supported; create the state eagerly (TensorFlow 2's default) without session=")


def _copy(variable: Any) -> np.ndarray:
    """The variable's value now, as a NumPy array of its own (later assigns leave it)."""
    return np.array(tf.convert_to_tensor(variable).numpy(), copy=True)


def _optimizer_variables(optimizer: Any, model: Any) -> list:
    """``optimizer``'s variables, building it for ``model`` first when it is not built yet
    (a Keras 3 optimizer makes its slots on the first update: without this, slots made
    after a commit would keep their trained values through a restore)."""
    if optimizer is None:
        return []
    if getattr(optimizer, "built", True) is False and hasattr(optimizer, "build"):
        optimizer.build(model.trainable_variables)
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


class TensorFlowState(ObjectState):
    """Elastic state of a list of TensorFlow variables, and plain values.

    :meth:`commit` keeps a NumPy copy of each variable, :meth:`restore` assigns the copies
    back, :meth:`sync` assigns rank 0's current values on every rank
    (``broadcast_variables``) and commits them.  Keywords are handled as in
    ``hora.elastic.ObjectState``.

    Args:
        variables: the ``tf.Variable``\\ s (the same list, in the same order, on every rank).
            None: none (TensorFlow 2 keeps no global collection of variables).
        session: TensorFlow 1's session: not supported (``NotImplementedError``).
        **kwargs: plain attributes and their initial values.

    Example::

        state = hvd.elastic.TensorFlowState(model.variables + optimizer.variables, epoch=0)
    """

    def __init__(self, variables: Any = None, session: Any = None, **kwargs: Any) -> None:
        _eager_only("TensorFlowState", session)
        self.variables = list(variables) if variables is not None else []
        self.session = None
        self._save_variables()
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **kwargs)

    def save(self) -> None:
        self._save_variables()
        super().save()

    def restore(self) -> None:
        for variable, value in zip(self.variables, self._values):
            variable.assign(value)
        super().restore()

    def sync(self) -> None:
        broadcast_variables(self.variables, root_rank=0)
        self._save_variables()
        super().sync()

    def _save_variables(self) -> None:
        self._values = [_copy(v) for v in self.variables]


class TensorFlowKerasState(ObjectState):
    """Elastic state of a Keras model (on TensorFlow) and its optimizer, and plain values.

    :meth:`commit` keeps a NumPy copy of the model's weights (``model.weights``: trainable
    and not) and of the optimizer's variables (its slots, iteration count and learning
    rate), :meth:`restore` assigns them back, :meth:`sync` assigns rank 0's current values on
    every rank and commits them.  An optimizer that is not built yet (Keras 3 builds it on
    the first update) is built for the model's trainable variables first, so that its
    slots are part of every commit from the start.  Keywords are handled as in
    ``hora.elastic.ObjectState``.

    Args:
        model: a built Keras model (``ValueError`` otherwise).
        optimizer: its optimizer; default ``model.optimizer`` (none, as before ``compile``:
            the weights only).
        backend: accepted for Horovod's signature (its TensorFlow 1 session source); a
            state created outside eager execution raises ``NotImplementedError``.
        **kwargs: plain attributes and their initial values.

    Example::

        state = hvd.elastic.TensorFlowKerasState(model, epoch=0, batch=0)
    """

    def __init__(self, model: Any, optimizer: Any = None, backend: Any = None,
                 **kwargs: Any) -> None:
        _eager_only("TensorFlowKerasState")
        if getattr(model, "built", True) is False:
            raise ValueError("hvd.elastic.TensorFlowKerasState: build the model first "
                             "(model.build(input_shape), or call it on a batch)")
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        self.backend = backend
        self._save_model()
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **kwargs)

    def _variables(self) -> list:
        return list(self.model.weights) + _optimizer_variables(self.optimizer, self.model)

    def save(self) -> None:
        self._save_model()
        super().save()

    def restore(self) -> None:
        for variable, value in self._saved_variables:
            variable.assign(value)
        super().restore()

    def sync(self) -> None:
        broadcast_variables(self._variables(), root_rank=0)
        self._save_model()
        super().sync()

    def _save_model(self) -> None:
        # (variable, value) pairs: a restore puts each value back where it came from
        self._saved_variables = [(v, _copy(v)) for v in self._variables()]
