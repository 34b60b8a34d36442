"""``import hora.tensorflow as hvd``: Horovod's ``horovod.tensorflow`` API on hora.

A script written for Horovod runs unchanged but for that import::

    import hora.tensorflow as hvd
    hvd.init()
    total = hvd.allreduce(tf.constant([1.0, 2.0]), op=hvd.Sum)

The collectives work eagerly and inside ``tf.function`` (not under XLA); see
:mod:`hora.tensorflow.mpi_ops` for how, and for the one hazard of graph mode.

Layer: tensorflow (a binding: it converts tensors and never touches a socket).
"""
from __future__ import annotations

from typing import Any, Optional

from ..core import allgather_object as _allgather_object
from ..core import broadcast_object as _broadcast_object
from ..core.basics import *  # noqa: F401,F403 (broadcast_object, allgather_object: below)
from ..core.basics import ProcessSet, global_process_set
from ..core.basics import __all__ as _basics_all
from . import elastic
from .compression import Compression
from .mpi_ops import *  # noqa: F401,F403
from .mpi_ops import __all__ as _ops_all
from .partial import PartialDistributedGradientTape
from . import util  # noqa: F401 (horovod.tensorflow.util)
from .util import _executing_eagerly  # noqa: F401 (Horovod users' test helpers import it)
from . import threads
from .training import DistributedGradientTape, broadcast_variables
from .training_v1 import (BroadcastGlobalVariablesHook, DistributedOptimizer,
                          broadcast_global_variables)


threads.widen_default_pool()        # before TensorFlow makes its pools: see threads


def broadcast_object(obj: Any, root_rank: int = 0, session: Any = None,
                     name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """``root_rank``'s ``obj`` (anything picklable), on every rank.  ``session`` is accepted
    for Horovod's TensorFlow 1 signature and ignored."""
    return _broadcast_object(obj, root_rank, name, process_set)


def allgather_object(obj: Any, session: Any = None, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> list[Any]:
    """The list of every rank's ``obj``, in rank order.  ``session`` is accepted for
    Horovod's TensorFlow 1 signature and ignored."""
    return _allgather_object(obj, name, process_set)


__all__ = [
    *_basics_all, "Compression", "DistributedGradientTape", "PartialDistributedGradientTape",
    "DistributedOptimizer", "broadcast_variables", "broadcast_global_variables",
    "BroadcastGlobalVariablesHook", "elastic", *_ops_all,
]
