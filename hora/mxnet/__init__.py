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

from ..core.basics import *  # noqa: F401,F403
from ..core.basics import __all__ as _basics_all
from .mpi_ops import *  # noqa: F401,F403
from .mpi_ops import __all__ as _ops_all
from .optimizer import DistributedOptimizer, DistributedTrainer, broadcast_parameters


__all__ = [*_basics_all, "DistributedOptimizer", "DistributedTrainer", "broadcast_parameters",
           *_ops_all]
