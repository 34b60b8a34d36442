"""``import hora.torch as hvd``: Horovod's ``horovod.torch`` API on hora.

A script written for Horovod runs unchanged but for that import::

    import hora.torch as hvd
    hvd.init()
    torch.set_num_threads(1)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

Importing it also registers ``"hora"`` as a ``torch.distributed`` backend
(:mod:`hora.torch.distributed`): ``dist.init_process_group("hora")``.

Layer: torch (a binding: it converts tensors and never touches a socket).
"""
from __future__ import annotations

from ..core.basics import *  # noqa: F401,F403
from ..core.basics import __all__ as _basics_all
from . import elastic
from .basics import cuda_built, nccl_built  # noqa: F401 (for the core's)
from .compression import Compression
from .functions import (allgather_object, average_metrics, broadcast_object,
                        broadcast_optimizer_state, broadcast_parameters)
from .mpi_ops import *  # noqa: F401,F403
from .mpi_ops import __all__ as _ops_all
from .optimizer import DistributedOptimizer
from .sync_batch_norm import SyncBatchNorm
from . import distributed as _distributed

_distributed.register()         # torch.distributed's backend "hora" (hora.torch.distributed)


__all__ = [
    *_basics_all, "Compression", "broadcast_parameters", "broadcast_optimizer_state",
    "average_metrics", "DistributedOptimizer", "SyncBatchNorm", "elastic", *_ops_all,
]
