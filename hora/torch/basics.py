"""The two basics that depend on this PyTorch, ``nccl_built`` and ``cuda_built``: they stand
in for the core's (:mod:`hora.core.basics`) in ``hora.torch`` and its ``mpi_ops``.
Layer: torch.
"""
from __future__ import annotations

__all__ = ["nccl_built", "cuda_built"]


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
