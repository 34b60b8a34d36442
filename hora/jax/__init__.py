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

from ..core.basics import *  # noqa: F401,F403
from ..core.basics import __all__ as _basics_all
from .mpi_ops import *  # noqa: F401,F403
from .mpi_ops import __all__ as _ops_all
from .optimizer import DistributedOptimizer, DistributedState, broadcast_parameters


__all__ = [*_basics_all, "DistributedOptimizer", "DistributedState", "broadcast_parameters",
           *_ops_all]
