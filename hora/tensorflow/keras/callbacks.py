"""``hora.tensorflow.keras.callbacks``: :mod:`hora.keras.callbacks` under Horovod's module name.
Layer: tensorflow (a binding)."""
from hora.keras.callbacks import *  # noqa: F401,F403
from hora.keras.callbacks import __all__  # noqa: F401
