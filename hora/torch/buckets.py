"""The torch optimizer's buckets: which parameters' gradients travel together in one
collective, and each bucket's flat buffer.

Without ``groups`` the parameters are packed, in the reverse of their order (the order in
which backward fills them), into buckets of ``HORA_BUCKET_CAP_MB``; the first, which
backward fills first, holds ``HORA_FIRST_BUCKET_CAP_MB``, by default small only where a CPU
is free to reduce it while backward goes on (:func:`spare_cpu`).  With ``groups`` the
caller's split is kept.  A :class:`Group` of dense gradients of one dtype and device is
reduced as one flat buffer, kept from step to step, which its gradients then become views
of (DDP's ``gradient_as_bucket_view``).

Layer: torch.  Knows nothing of hooks, names or collectives.
"""
import torch

from .. import core
from ..config import env_value
from ..core.fusion import plan_buckets, split_even
from ..core.topology import usable_cpus

__all__ = ["DEFAULT_FIRST_MB", "Group", "copy_all", "flattenable", "group_chunks",
           "param_buckets", "spare_cpu", "unflatten"]

DEFAULT_FIRST_MB = 1.0      # the first bucket with a CPU to spare (DDP's)


class Group:
    """Parameters whose gradients travel in one grouped allreduce, and how many of them are
    ready this step.  Hashed by identity: a dict lookup costs one pointer, not a hash of
    every tensor in the group (which would make each gradient hook O(group size))."""

    __slots__ = ("params", "ready", "_flat", "_views")

    def __init__(self, params):
        self.params = tuple(params)
        self.ready = 0
        self._flat = None
        self._views = None

    def forget_buffer(self):
        """Drop the flat buffer (the group's parameters changed)."""
        self._flat = self._views = None

    def flat_buffer(self, grads):
        """A flat tensor for ``grads`` (dense, one dtype and device) and its views shaped
        like each of them; kept from step to step (remade when the gradients change dtype
        or device)."""
        first, flat = grads[0], self._flat
        if flat is None or flat.dtype != first.dtype or flat.device != first.device:
            flat = torch.empty(sum(g.numel() for g in grads), dtype=first.dtype,
                               device=first.device)
            self._flat, self._views = flat, unflatten(flat, grads)
        return flat, self._views

    def holds_grads(self):
        """Whether every parameter's ``.grad`` is its view of the flat buffer."""
        views = self._views
        return views is not None and all(p.grad is v for p, v in zip(self.params, views))

    def zero(self):
        with torch.no_grad():
            self._flat.zero_()


def group_chunks(spec, params):
    """The parameters split into the chunks reduced together, and whether to reduce them
    only once backward is over (no CPU to spare; see :func:`spare_cpu`).

    ``spec`` is the optimizer's ``groups``: None (buckets by size), an int (that many even
    groups) or lists of parameters (parameters in none form chunks of their own)."""
    defer = False
    first = env_value("FIRST_BUCKET_CAP_MB")
    if first is None:           # auto: reduce during backward only with a CPU to spare
        defer = not spare_cpu(params)
        first = 0 if defer else DEFAULT_FIRST_MB
    if spec is None:
        cap = env_value("BUCKET_CAP_MB") * (1 << 20)
        return param_buckets(params, cap, first * (1 << 20)), defer
    if isinstance(spec, int):
        return split_even(params, spec), defer
    wanted = {id(p) for p in params}
    chunks = [[p for p in group if id(p) in wanted] for group in spec]
    placed = {id(p) for chunk in chunks for p in chunk}
    chunks += [[p] for p in params if id(p) not in placed]
    return chunks, defer


def spare_cpu(params):
    """Whether a gradient's allreduce can run beside the rest of backward on a CPU that
    backward does not use: when the model is on an accelerator, or when this host's ranks
    times torch's threads per rank leave a CPU free.  Where backward already keeps every
    CPU busy (CPU training with as many ranks x threads as CPUs), reducing during backward
    only takes CPU time from it and makes its threads wait, while the first rank to finish
    backward idles anyway: the reduction is better left for then."""
    if any(p.device.type != "cpu" for p in params):
        return True
    ranks = core.local_size() if core.is_initialized() else 1
    return ranks * torch.get_num_threads() < usable_cpus()


def param_buckets(params, cap, first_cap=None):
    """Without ``groups``: the parameters packed into buckets of at most ``cap`` bytes in
    the reverse of their order, the first of at most ``first_cap``, each reduced as one
    collective (:func:`hora.core.fusion.plan_buckets`).  ``cap`` 0: one per tensor."""
    sizes = [p.numel() * p.element_size() for p in params]
    return [[params[i] for i in bucket] for bucket in plan_buckets(sizes, cap, first_cap)]


try:        # views of a flat tensor shaped like others, in one C++ call (DDP's helper)
    from torch._utils import _unflatten_dense_tensors as unflatten
except ImportError:                                     # pragma: no cover
    def unflatten(flat, like):
        return [v.view_as(t) for v, t in zip(flat.split([t.numel() for t in like]), like)]


def copy_all(dst, src):
    """dst[i].copy_(src[i]) for every i, in one call where torch has one."""
    with torch.no_grad():
        if hasattr(torch, "_foreach_copy_"):
            torch._foreach_copy_(dst, src)
        else:                                           # torch < 2.2
            for d, s in zip(dst, src):
                d.copy_(s)


def flattenable(grads):
    """Dense gradients of one dtype on one device (they can share one flat buffer)."""
    first = grads[0]
    return all(not g.is_sparse and g.dtype == first.dtype and g.device == first.device
               for g in grads)
