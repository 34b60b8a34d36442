"""``hora.tensorflow.keras.elastic``: :mod:`hora.keras.elastic` under Horovod's module name,
plus :class:`hora.tensorflow.elastic.TensorFlowKerasState`.  ``KerasState`` here is
hora.keras' (the same on every Keras backend), not a subclass of ``TensorFlowKerasState``
as Horovod's is; both hold the same variables.

Layer: tensorflow (a binding).
"""
from hora.keras.elastic import (CommitStateCallback, KerasState, ObjectState, State,  # noqa: F401
                                UpdateBatchStateCallback, UpdateEpochStateCallback, run)
from hora.tensorflow.elastic import TensorFlowKerasState  # noqa: F401

__all__ = ["run", "State", "ObjectState", "KerasState", "TensorFlowKerasState",
           "CommitStateCallback", "UpdateBatchStateCallback", "UpdateEpochStateCallback"]
