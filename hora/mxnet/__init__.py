"""``import hora.mxnet as hvd``: Horovod's ``horovod.mxnet`` API on hora.

A Gluon script written for Horovod runs unchanged but for that import::

    import hora.mxnet as hvd
    hvd.init()
    net.initialize(ctx=mx.cpu())
    hvd.broadcast_parameters(net.collect_params(), root_rank=0)
    trainer = hvd.DistributedTrainer(net.collect_params(), "sgd",
                                     {"learning_rate": 0.01 * hvd.size()})

MXNet 1.9.1 (its last release) needs ``numpy<1.24``: install it in a venv of its own
(``pip install 'hora[mxnet]'``).  Arrays travel through host memory; ``priority`` is accepted
and ignored.

Layer: mxnet (a binding: it converts arrays and never touches a socket).
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
from .optimizer import DistributedOptimizer, DistributedTrainer, broadcast_parameters


__all__ = [
    "init", "shutdown", "is_initialized", "size", "local_size", "cross_size", "rank",
    "local_rank", "cross_rank", "is_homogeneous", "mpi_threads_supported", "mpi_enabled",
    "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built",
    "cuda_built", "rocm_built", "start_timeline", "stop_timeline", "ProcessSet",
    "global_process_set", "add_process_set", "remove_process_set", "broadcast_object",
    "allgather_object", "HorovodInternalError", "HoraInternalError", "HoraError",
    "DistributedOptimizer", "DistributedTrainer", "broadcast_parameters", *_ops_all,
]
