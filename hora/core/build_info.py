"""What a framework binding answers about how hora was built (Horovod's ``*_built`` and
``*_enabled`` queries) and the timeline calls, the same for every binding.  ``nccl_built``
and ``cuda_built`` here are the answers of a binding that stages every tensor through host
memory (hora.tensorflow, hora.keras, hora.jax, hora.mxnet); hora.torch, which can run
collectives on the GPUs through NCCL, answers ``nccl_built`` itself.

Layer: core.
"""

__all__ = ["mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built",
           "ddl_built", "ccl_built", "rocm_built", "nccl_built", "cuda_built", "start_timeline",
           "stop_timeline"]


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


def ddl_built() -> bool:
    """False: hora does not use IBM DDL."""
    return False


def ccl_built() -> bool:
    """False: hora does not use oneCCL."""
    return False


def rocm_built() -> bool:
    """False: hora has no ROCm kernels."""
    return False


def nccl_built() -> bool:
    """False: this binding stages every tensor through host memory; it has no NCCL path."""
    return False


def cuda_built() -> bool:
    """False: hora has no CUDA kernels of its own; GPU tensors are staged through host
    memory."""
    return False


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing the timeline to ``file_path`` (rank 0 writes every rank's events; call
    it on every rank): see :mod:`hora.core.timeline`.  A running timeline stops first.

    Raises:
        NotInitializedError: before ``init()``.
    """
    from .lifecycle import start_timeline as start
    start(file_path, mark_cycles)


def stop_timeline() -> None:
    """Stop the timeline (rank 0 closes its file); nothing when none runs."""
    from . import timeline
    timeline.stop()
