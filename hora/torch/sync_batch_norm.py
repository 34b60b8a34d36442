"""``SyncBatchNorm``: batch normalization whose training statistics cover every rank's batch.

In training, each rank reduces its batch to three numbers per channel (count, mean, sum of
squared deviations), the ranks allgather them and combine them exactly (Chan et al.'s
parallel variance), and every rank normalizes with the global mean and variance.  The
backward pass sums two per-channel terms over the ranks, so input gradients are those of
batch norm over the concatenated batch.  Weight and bias gradients stay local, as in
Horovod: the DistributedOptimizer reduces them with the other parameters.  Layer: torch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from ..core.ops import wait_now as _now
from ..core.process_sets import ProcessSet, global_process_set
from .mpi_ops import Sum, allgather_async, allreduce_async

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(_BatchNorm):
    """A drop-in for ``torch.nn.BatchNorm1d/2d/3d`` that computes training statistics over
    all ranks (ranks may hold batches of different sizes).

    Args:
        num_features: ``C`` of an input shaped ``(N, C, ...)``.
        eps: added to the variance before its square root.
        momentum: weight of the new batch in the running statistics; ``None`` for a
            cumulative average.
        affine: learn a per-channel weight and bias.
        track_running_stats: keep running mean and variance (unbiased, over the global
            batch) and use them in eval mode, which then needs no communication.
        process_set: share statistics among the ranks of this process set only.

    Every rank of the set must run the layer's forward (and backward) in training mode
    together, in the same order as the other SyncBatchNorm layers.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), hvd.SyncBatchNorm(8))
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_set: ProcessSet = global_process_set) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalize ``input`` with the mean and variance of the whole batch, over every rank of
        the process set (in training; with the running statistics in eval)."""
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        tracked = self.num_batches_tracked       # a tensor when track_running_stats
        if self.training and self.track_running_stats and tracked is not None:
            tracked.add_(1)
            if self.momentum is None:            # cumulative moving average
                factor = 1.0 / float(tracked)
        batch_stats = self.training or not self.track_running_stats
        running = (self.running_mean, self.running_var) if self.track_running_stats else \
            (None, None)
        ps = self.process_set
        if not (self.training and ps.included() and ps.size() > 1):
            # eval mode, or nobody to share with: plain batch norm, no communication
            return F.batch_norm(input, *running, self.weight, self.bias, batch_stats, factor,
                                self.eps)
        return _SyncBatchNormFunction.apply(input, self.weight, self.bias, *running,
                                            self.eps, factor, ps)


def _stat_dtype(x):
    # half-precision inputs accumulate in float32, as torch's batch norm does
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


def _per_channel(v, x):
    """``v`` of shape (C,) shaped to broadcast against ``x`` of shape (N, C, ...)."""
    return v.view((1, -1) + (1,) * (x.dim() - 2))


class _SyncBatchNormFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, factor, process_set):
        dims = [0] + list(range(2, x.dim()))
        xs = x.to(_stat_dtype(x))
        channels = x.size(1)
        count = x.numel() // channels if channels else 0
        if count:
            mean = xs.mean(dims)
            m2 = (xs - _per_channel(mean, xs)).square().sum(dims)
        else:                                    # an empty batch on this rank
            mean = m2 = xs.new_zeros(channels)
        # combine in float64 (the count is exact there, and the stats are only 2C + 1
        # numbers); Apple's MPS has no float64
        wide = torch.float32 if x.device.type == "mps" else torch.float64
        mine = torch.cat([torch.full((1,), float(count), dtype=wide, device=x.device),
                          mean.to(wide), m2.to(wide)]).unsqueeze(0)
        every = _now(lambda: allgather_async(mine, name="sync_batch_norm.stats",
                                            process_set=process_set))
        counts, means, m2s = every[:, :1], every[:, 1:channels + 1], every[:, channels + 1:]
        total = float(counts.sum())
        if total <= 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got "
                             f"{int(total)} over all ranks")
        g_mean = (counts * means).sum(0) / total
        g_m2 = (m2s + counts * (means - g_mean).square()).sum(0)
        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1 - factor).add_(factor * g_mean.to(running_mean.dtype))
                running_var.mul_(1 - factor).add_(
                    factor * (g_m2 / (total - 1)).to(running_var.dtype))
        mean = g_mean.to(xs.dtype)
        invstd = torch.rsqrt(g_m2 / total + eps).to(xs.dtype)
        y = (xs - _per_channel(mean, xs)) * _per_channel(invstd, xs)
        if weight is not None:
            y = y * _per_channel(weight.to(xs.dtype), xs) + _per_channel(bias.to(xs.dtype), xs)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.total = total
        ctx.process_set = process_set
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, invstd = ctx.saved_tensors
        dims = [0] + list(range(2, x.dim()))
        dys = dy.to(mean.dtype)
        xhat = (x.to(mean.dtype) - _per_channel(mean, x)) * _per_channel(invstd, x)
        sum_dy = dys.sum(dims)
        sum_dy_xhat = (dys * xhat).sum(dims)
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            # d(mean) and d(var) collect dy from every rank's part of the batch
            both = _now(lambda: allreduce_async(torch.cat([sum_dy, sum_dy_xhat]), op=Sum,
                                               name="sync_batch_norm.grad_sums",
                                               process_set=ctx.process_set))
            g_sum_dy, g_sum_dy_xhat = both.split(sum_dy.numel())
            scale = invstd if weight is None else invstd * weight.to(invstd.dtype)
            grad_x = _per_channel(scale, x) * (
                dys - _per_channel(g_sum_dy / ctx.total, x)
                - xhat * _per_channel(g_sum_dy_xhat / ctx.total, x))
            grad_x = grad_x.to(x.dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = sum_dy_xhat.to(weight.dtype)
        if weight is not None and ctx.needs_input_grad[2]:
            grad_bias = sum_dy.to(weight.dtype)
        return grad_x, grad_weight, grad_bias, None, None, None, None, None
