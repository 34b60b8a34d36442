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

import logging

from ..core import (ProcessSet, add_process_set, cross_rank, cross_size, global_process_set,
                    init, is_homogeneous, is_initialized, local_rank, local_size, rank,
                    remove_process_set, shutdown, size)
from ..errors import HoraError, HoraInternalError, HorovodInternalError
from . import elastic
from .compression import Compression
from .functions import (allgather_object, broadcast_object, broadcast_optimizer_state,
                        broadcast_parameters)
from .mpi_ops import *  # noqa: F401,F403
from .mpi_ops import __all__ as _ops_all
from .optimizer import DistributedOptimizer
from .sync_batch_norm import SyncBatchNorm


def mpi_threads_supported() -> bool:
    """False: hora offers no MPI threading mode; its own engine runs the collectives, over
    MPI (mpi4py) only with HORA_BACKEND=mpi."""
    return False


def mpi_enabled() -> bool:
    """False: hora's controller is its own, not MPI's.  With HORA_BACKEND=mpi, under mpirun,
    its collectives' data goes through MPI (mpi4py)."""
    return False


def mpi_built() -> bool:
    """False: hora is not built against MPI.  It runs under mpirun, and HORA_BACKEND=mpi
    moves data through mpi4py's MPI (``hora[mpi]``)."""
    return False


def gloo_enabled() -> bool:
    """False: hora's controller is its own, not Gloo's.  With HORA_BACKEND=gloo its
    collectives' data goes through torch.distributed's Gloo."""
    return False


def gloo_built() -> bool:
    """False: hora is not built against Gloo; HORA_BACKEND=gloo uses the Gloo that PyTorch
    ships."""
    return False


def nccl_built() -> bool:
    """Whether this PyTorch has NCCL: with HORA_BACKEND=nccl, allreduce, broadcast and
    allgather of CUDA tensors in the global process set then run on the GPUs through it
    (other collectives of CUDA tensors, and every one without it, are staged through host
    memory)."""
    import torch.distributed as dist
    return bool(dist.is_available() and dist.is_nccl_available())


def ddl_built() -> bool:
    """False: hora does not use IBM DDL."""
    return False


def ccl_built() -> bool:
    """False: hora does not use oneCCL."""
    return False


def cuda_built() -> bool:
    """False: hora has no CUDA kernels of its own.  CUDA tensors work: through NCCL on the
    GPUs with HORA_BACKEND=nccl (see :func:`nccl_built`), else staged through host memory."""
    return False


def rocm_built() -> bool:
    """False: hora has no ROCm kernels."""
    return False


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Accepted for Horovod compatibility; the timeline is not implemented yet: says so, in
    one log line, and writes no file."""
    logging.getLogger(__name__).warning("start_timeline(%r): hora records no timeline yet; "
                                        "no file will be written", file_path)


def stop_timeline() -> None:
    """Accepted for Horovod compatibility; the timeline is not implemented yet."""


__all__ = [
    "init", "shutdown", "is_initialized", "size", "local_size", "cross_size", "rank",
    "local_rank", "cross_rank", "is_homogeneous", "mpi_threads_supported", "mpi_enabled",
    "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built",
    "cuda_built", "rocm_built", "start_timeline", "stop_timeline", "ProcessSet",
    "global_process_set", "add_process_set", "remove_process_set", "Compression",
    "broadcast_parameters", "broadcast_optimizer_state", "broadcast_object",
    "allgather_object", "DistributedOptimizer", "SyncBatchNorm", "HorovodInternalError",
    "HoraInternalError", "HoraError", "elastic", *_ops_all,
]
