"""The job's basics as ``horovod.torch`` and its ``mpi_ops`` carry them: core's queries
(``init``, ``size``, ``rank``, ...), the build flags, and the two that depend on this
PyTorch (``nccl_built``, ``cuda_built``).  Scripts import them from either module
(``from horovod.torch.mpi_ops import size``).  Layer: torch.
"""
from __future__ import annotations

from ..core import (cross_rank, cross_size, init, is_homogeneous, is_initialized, local_rank,
                    local_size, rank, shutdown, size)
from ..core.build_info import (ccl_built, ddl_built, gloo_built, gloo_enabled, mpi_built,
                               mpi_enabled, mpi_threads_supported, rocm_built, start_timeline,
                               stop_timeline)

__all__ = [
    "init", "shutdown", "is_initialized", "size", "local_size", "cross_size", "rank",
    "local_rank", "cross_rank", "is_homogeneous", "mpi_threads_supported", "mpi_enabled",
    "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built",
    "cuda_built", "rocm_built", "start_timeline", "stop_timeline",
]


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
