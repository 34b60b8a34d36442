"""``import hora.torch as hvd``: Horovod's ``horovod.torch`` API on hora.

A script written for Horovod runs unchanged but for that import::

    import hora.torch as hvd
    hvd.init()
    torch.set_num_threads(1)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

Layer: torch (a binding: it converts tensors and never touches a socket).
"""
from __future__ import annotations

from ..core import (ProcessSet, add_process_set, cross_rank, cross_size, global_process_set,
                    init, is_homogeneous, is_initialized, local_rank, local_size, rank,
                    remove_process_set, shutdown, size)
from ..core.build_info import (ccl_built, ddl_built, gloo_built, gloo_enabled,  # noqa: F401
                               mpi_built, mpi_enabled, mpi_threads_supported, rocm_built,
                               start_timeline, stop_timeline)
from ..errors import HoraError, HoraInternalError, HorovodInternalError
from . import elastic
from .compression import Compression
from .functions import (allgather_object, average_metrics, broadcast_object,
                        broadcast_optimizer_state, broadcast_parameters)
from .mpi_ops import *  # noqa: F401,F403
from .mpi_ops import __all__ as _ops_all
from .optimizer import DistributedOptimizer
from .sync_batch_norm import SyncBatchNorm


def nccl_built() -> bool:
    """Whether this PyTorch has NCCL: with HORA_BACKEND=nccl, allreduce, broadcast and
    allgather of CUDA tensors in the global process set then run on the GPUs through it
    (other collectives of CUDA tensors, and every one without it, are staged through host
    memory)."""
    import torch.distributed as dist
    return bool(dist.is_available() and dist.is_nccl_available())


def cuda_built() -> bool:
    """False: hora has no CUDA kernels of its own.  CUDA tensors work: through NCCL on the
    GPUs with HORA_BACKEND=nccl (see :func:`nccl_built`), else staged through host memory."""
    return False


__all__ = [
    "init", "shutdown", "is_initialized", "size", "local_size", "cross_size", "rank",
    "local_rank", "cross_rank", "is_homogeneous", "mpi_threads_supported", "mpi_enabled",
    "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built",
    "cuda_built", "rocm_built", "start_timeline", "stop_timeline", "ProcessSet",
    "global_process_set", "add_process_set", "remove_process_set", "Compression",
    "broadcast_parameters", "broadcast_optimizer_state", "broadcast_object",
    "allgather_object", "average_metrics", "DistributedOptimizer", "SyncBatchNorm",
    "HorovodInternalError",
    "HoraInternalError", "HoraError", "elastic", *_ops_all,
]
