"""The job's basics that every framework binding exports, as Horovod's bindings do.

``import hora.torch as hvd``, ``hora.tensorflow``, ``hora.keras``, ``hora.jax`` and
``hora.mxnet`` each carry the same queries (``init``, ``size``, ``rank``, ...), build flags,
process-set functions, object collectives and error types; they are named here once, and a
binding star-imports this module and adds :data:`__all__` to its own.  A binding whose
framework changes one (torch's ``nccl_built``; TensorFlow's ``broadcast_object`` with a
``session``) defines it after the import.

Layer: core (no framework).
"""
from __future__ import annotations

from ..errors import HoraError, HoraInternalError, HorovodInternalError
from .build_info import (ccl_built, cuda_built, ddl_built, gloo_built, gloo_enabled, mpi_built,
                         mpi_enabled, mpi_threads_supported, nccl_built, rocm_built,
                         start_timeline, stop_timeline)
from .lifecycle import init, shutdown
from .objects import allgather_object, broadcast_object
from .process_sets import (ProcessSet, add_process_set, global_process_set,
                           remove_process_set)
from .state import (cross_rank, cross_size, is_homogeneous, is_initialized, local_rank,
                    local_size, rank, size)

__all__ = [
    "init", "shutdown", "is_initialized", "size", "local_size", "cross_size", "rank",
    "local_rank", "cross_rank", "is_homogeneous", "mpi_threads_supported", "mpi_enabled",
    "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built",
    "cuda_built", "rocm_built", "start_timeline", "stop_timeline", "ProcessSet",
    "global_process_set", "add_process_set", "remove_process_set", "broadcast_object",
    "allgather_object", "HorovodInternalError", "HoraInternalError", "HoraError",
]

# the queries and build flags, which Horovod's mpi_ops modules carry too (a literal list
# above, not one built of parts: mypy reads a module's exports from string literals only)
JOB = __all__[:__all__.index("ProcessSet")]
