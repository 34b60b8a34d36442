"""``import hora.tensorflow.keras as hvd``: Horovod's ``horovod.tensorflow.keras`` on Keras 3 with
the TensorFlow backend.  It is :mod:`hora.keras` (which serves the torch backend too),
under the name Horovod scripts import.

Layer: tensorflow (a binding).
"""
from __future__ import annotations

from hora.keras import backend as _backend

if _backend.name() != "tensorflow":
    raise ImportError(f"hora.tensorflow.keras runs Keras on TensorFlow; this process runs Keras "
                      f"on {_backend.name()!r} (KERAS_BACKEND).  Import hora.keras instead: it "
                      f"serves the tensorflow and torch backends")

from hora.keras import *  # noqa: E402,F401,F403
from hora.keras import __all__  # noqa: E402,F401
from hora.keras import callbacks  # noqa: E402,F401
# this package's own elastic (hora.keras' plus TensorFlowKerasState), not the one * bound
import hora.tensorflow.keras.elastic as elastic  # noqa: E402,F401
