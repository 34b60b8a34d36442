"""``import hora.jax as hvd``: Horovod-style data-parallel training for JAX, on hora.

Horovod has no JAX binding; this one follows its torch and TensorFlow APIs::

    import hora.jax as hvd
    hvd.init()
    params = hvd.broadcast_parameters(params, root_rank=0)
    tx = hvd.DistributedOptimizer(optax.sgd(0.1 * hvd.size()))
    total = hvd.allreduce(jnp.ones(3), op=hvd.Sum)

The collectives work eagerly and inside ``jax.jit`` (see :mod:`hora.jax.mpi_ops` for how);
``DistributedOptimizer`` wraps an optax ``GradientTransformation``.

Layer: jax (a binding: it converts arrays and never touches a socket).
"""
from __future__ import annotations

from ..core import (ProcessSet, add_process_set, cross_rank, cross_size, global_process_set,
                    init, is_homogeneous, is_initialized, local_rank, local_size, rank,
                    remove_process_set, shutdown, size)
from ..core import allgather_object, broadcast_object
from ..core.build_info import (ccl_built, cuda_built, ddl_built, gloo_built,  # noqa: F401
                               gloo_enabled, mpi_built, mpi_enabled, mpi_threads_supported,
                               nccl_built, rocm_built, start_timeline, stop_timeline)
from ..errors import HoraError, HoraInternalError, HorovodInternalError
from .mpi_ops import *  # noqa: F401,F403
from .mpi_ops import __all__ as _ops_all
from .optimizer import DistributedOptimizer, DistributedState, broadcast_parameters


__all__ = [
    "init", "shutdown", "is_initialized", "size", "local_size", "cross_size", "rank",
    "local_rank", "cross_rank", "is_homogeneous", "mpi_threads_supported", "mpi_enabled",
    "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built",
    "cuda_built", "rocm_built", "start_timeline", "stop_timeline", "ProcessSet",
    "global_process_set", "add_process_set", "remove_process_set", "broadcast_object",
    "allgather_object", "HorovodInternalError", "HoraInternalError", "HoraError",
    "DistributedOptimizer", "DistributedState", "broadcast_parameters", *_ops_all,
]
