"""``DistributedOptimizer`` for optax, and ``broadcast_parameters``.

``DistributedOptimizer(tx)`` is an optax ``GradientTransformation`` whose ``update`` first
reduces the gradient pytree over the ranks (averages it, by default) and then calls ``tx``'s
``update`` on the result, so the update is the one a single process would compute on the
whole global batch.  It works eagerly and inside ``jax.jit`` (the reduction is one ordered
host callback per bucket, :mod:`hora.jax.mpi_ops`).  The rules are hora.core's: option
checks, ``groups`` and buckets, predivide scaling, ``backward_passes_per_step``
(:class:`~hora.core.gradients.LocalAccumulation`'s rule, written as a ``lax.cond`` on a
counter kept in the optimizer state, which every rank counts alike), compression.

Layer: jax (a binding).
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

from ..config import env_value
from ..core.fusion import plan_buckets
from ..core.gradients import (LocalAccumulation, check_reduce_options, plan_groups,
                              predivide_scales, resolve_groups)
from ..core.messages import Average
from ..core.process_sets import ProcessSet, global_process_set
from . import mpi_ops
from .mpi_ops import Compression

__all__ = ["DistributedOptimizer", "DistributedState", "broadcast_parameters"]


class DistributedState(NamedTuple):
    """The wrapped transformation's state, and the gradients summed over the backward passes
    of the current step (``backward_passes_per_step > 1``; else None and 0)."""
    inner: Any
    acc: Any
    count: Any


class _Reducer:
    """The gradient pytree reduced over the ranks: leaves in buckets (or ``groups``), one
    grouped allreduce each, under names that are the same every step (the engine's response
    cache then skips negotiation)."""

    def __init__(self, compression, op, gradient_predivide_factor, groups, process_set,
                 name):
        self.compression = compression
        self.op = op
        self.groups = groups
        self.process_set = process_set
        self.name = name
        self.prescale, self.postscale = predivide_scales(op, gradient_predivide_factor)

    def _plan(self, leaves):
        if self.groups is not None:
            return plan_groups(leaves, self.groups)
        sizes = [int(x.size) * x.dtype.itemsize for x in leaves]
        return plan_buckets(sizes, int(env_value("BUCKET_CAP_MB") * (1 << 20)))

    def __call__(self, grads):
        if self.process_set.size() == 1:      # nothing to reduce (Horovod's _allreduce_cond)
            return grads
        leaves, tree = jax.tree_util.tree_flatten(grads)
        out = list(leaves)
        for k, bucket in enumerate(self._plan(leaves)):
            pairs = [self.compression.compress(leaves[i]) for i in bucket]
            reduced = mpi_ops._grouped_allreduce(
                [p[0] for p in pairs], self.op, self.prescale, self.postscale,
                f"{self.name}.grads.{k}", self.process_set, "grouped_allreduce")
            for i, r, (_, ctx) in zip(bucket, reduced, pairs):
                out[i] = self.compression.decompress(r, ctx)
        return jax.tree_util.tree_unflatten(tree, out)


def DistributedOptimizer(optimizer: Any,
                         compression: Any = Compression.none,
                         backward_passes_per_step: int = 1, op: int = Average,
                         gradient_predivide_factor: float = 1.0,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups: Optional[int] = None,
                         process_set: ProcessSet = global_process_set,
                         name: str = "DistributedOptimizer") -> Any:
    """Wrap an optax transformation so that it sees gradients reduced over the ranks.

    Args:
        optimizer: any optax ``GradientTransformation`` (``optax.sgd(...)``,
            ``optax.adam(...)``, a chain).
        compression: ``Compression.none`` or ``Compression.fp16`` (send float gradients as
            float16).
        backward_passes_per_step: ``update`` calls whose gradients are summed locally before
            one reduction and one update of the wrapped transformation, on the last of them;
            the calls in between return zero updates.
        op: ``Average`` (default) or ``Sum`` (or Min, Max, Product).
        gradient_predivide_factor: with Average, scale by ``1/f`` before the sum and by
            ``f/size`` after it.
        average_aggregated_gradients: divide the summed passes by
            ``backward_passes_per_step``.
        num_groups: deprecated, as ``groups=num_groups``.
        groups: None: the leaves packed in reverse order into buckets of
            ``HORA_BUCKET_CAP_MB`` (one grouped allreduce each); an int n: n grouped
            allreduces of contiguous leaves.
        process_set: reduce over these ranks only (default: every rank).
        name: the base of the collectives' names (the same on every rank; give two
            optimizers used in one job different names).

    Returns:
        An ``optax.GradientTransformation``; its state is a :class:`DistributedState`.

    Example:
        >>> tx = hvd.DistributedOptimizer(optax.adam(1e-3 * hvd.size()))
        >>> opt_state = tx.init(params)
        >>> updates, opt_state = tx.update(grads, opt_state, params)   # inside jax.jit too
        >>> params = optax.apply_updates(params, updates)
    """
    if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
        raise TypeError(f"DistributedOptimizer wraps an optax GradientTransformation, got "
                        f"{type(optimizer).__name__}")
    check_reduce_options(op, gradient_predivide_factor)
    resolved = resolve_groups(num_groups, groups, lambda m: False,
                              "arrays (hora.jax takes groups as an int)")
    rule = LocalAccumulation(backward_passes_per_step, average_aggregated_gradients)
    reduce = _Reducer(compression, op, gradient_predivide_factor, resolved, process_set, name)

    def init(params):
        acc = jax.tree_util.tree_map(jnp.zeros_like, params) if rule.passes > 1 else None
        return DistributedState(optimizer.init(params), acc, jnp.zeros((), jnp.int32))

    def update(grads, state, params=None):
        if rule.passes == 1:
            updates, inner = optimizer.update(reduce(grads), state.inner, params)
            return updates, DistributedState(inner, None, state.count)
        acc = jax.tree_util.tree_map(jnp.add, state.acc, grads)
        count = state.count + 1

        def apply(acc, inner):
            summed = jax.tree_util.tree_map(lambda a: a / rule.divisor, acc)
            updates, inner = optimizer.update(reduce(summed), inner, params)
            return updates, inner, jax.tree_util.tree_map(jnp.zeros_like, acc)

        def skip(acc, inner):
            return jax.tree_util.tree_map(jnp.zeros_like, grads), inner, acc

        # every rank counts alike, so every rank takes the same branch: the reduction runs
        # on the step's last pass only, on every rank
        done = count >= rule.passes
        if isinstance(done, jax.core.Tracer):
            updates, inner, acc = jax.lax.cond(done, apply, skip, acc, state.inner)
        else:
            updates, inner, acc = (apply if bool(done) else skip)(acc, state.inner)
        return updates, DistributedState(inner, acc, jnp.where(done, 0, count))

    import optax            # only here: hora.jax's collectives need JAX alone
    return optax.GradientTransformation(init, update)


def broadcast_parameters(params: Any, root_rank: int = 0,
                         process_set: ProcessSet = global_process_set) -> Any:
    """``root_rank``'s value of every leaf of ``params`` (any pytree: model parameters, an
    optax state), on every rank; returns a pytree of the same structure.  Every leaf's
    broadcast is submitted before any is waited for.

    Example:
        >>> params = hvd.broadcast_parameters(params, root_rank=0)
    """
    return mpi_ops.broadcast(params, root_rank, process_set=process_set)
