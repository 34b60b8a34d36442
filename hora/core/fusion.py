"""Tensor fusion: the arrays of one reduction as one flat buffer, and Horovod's scaling rule.

Every allreduce, on the host or on a device, goes through the same three steps here:

- :meth:`Fusion.pack` makes one contiguous 1-D buffer of the arrays.  A lone contiguous
  array reduced in place is its own buffer; a lone array otherwise is copied; several
  arrays are concatenated into a buffer kept per (device, dtype) from call to call when
  the results go back into the callers' arrays, else into a new one (the results are then
  views of it, which nothing else holds).
- :meth:`ArrayOps.scale` multiplies by the prescale factor before the reduction and by
  postscale / divisor after it, rounded as Horovod rounds.
- :meth:`Fusion.unpack` gives the results: views of the buffer, or with ``inplace`` the
  callers' arrays, into which the buffer was copied back.

The array library is reached through an :class:`ArrayOps`: :data:`NUMPY` for host arrays
here; a device plane brings its own (hora.backends.nccl: torch tensors on their device).
How the arrays are grouped into reductions is decided above this module: by the
coordinator (fused responses of up to HORA_FUSION_THRESHOLD bytes) and, for a framework's
optimizer, by :func:`plan_buckets`.

Layer: core.
"""
from typing import Any, Protocol

import numpy as np

from ..backends.ring import even_counts

__all__ = ["ArrayOps", "Fusion", "NUMPY", "plan_buckets", "scale", "split_even"]


class ArrayOps(Protocol):
    """What fusion needs of an array library.  ``dtype`` is the library's own dtype."""

    def numel(self, a: Any) -> int:
        """Number of elements of ``a``."""

    def flat_view(self, a: Any) -> Any | None:
        """``a`` as a 1-D view of its own memory, or None when ``a`` is not contiguous."""

    def flat_copy(self, a: Any, dtype: Any) -> Any:
        """A new contiguous 1-D copy of ``a`` in ``dtype``."""

    def empty(self, n: int, dtype: Any, like: Any) -> Any:
        """A new 1-D buffer of ``n`` elements of ``dtype`` where ``like`` lives."""

    def pool_key(self, dtype: Any, like: Any) -> Any:
        """The key of the reusable buffer for ``dtype`` where ``like`` lives."""

    def concat_into(self, arrays: list, out: Any) -> None:
        """``out[:] = the arrays, flattened and concatenated`` (cast to ``out``'s dtype)."""

    def view(self, part: Any, like: Any) -> Any:
        """The 1-D ``part`` of a buffer, shaped as ``like``."""

    def copy_back(self, dst: Any, part: Any, fused: bool) -> None:
        """Write the result ``part`` into the caller's ``dst`` unless ``part`` already is
        ``dst``'s memory (never the case when ``fused``: the buffer was a copy)."""

    def scale(self, buf: Any, factor: float, divisor: int) -> None:
        """``buf *= factor / divisor`` in place, rounded as Horovod rounds (see :func:`scale`)."""

    def dtype_of(self, a: Any) -> Any:
        """The dtype of ``a``."""


class Fusion:
    """Packs and unpacks the arrays of one reduction; owns the reusable buffers."""

    def __init__(self, ops: ArrayOps):
        self.ops = ops
        self._pool: dict = {}

    def pack(self, arrays: list, dtype: Any, inplace: bool) -> Any:
        """One contiguous 1-D buffer of ``dtype`` holding ``arrays`` (see the module)."""
        ops = self.ops
        if len(arrays) == 1:
            a = arrays[0]
            if inplace:
                view = ops.flat_view(a)
                if view is not None:
                    return view
            return ops.flat_copy(a, dtype)
        total = sum(ops.numel(a) for a in arrays)
        buf = self.reusable(dtype, total, arrays[0]) if inplace else ops.empty(total, dtype,
                                                                               arrays[0])
        ops.concat_into(arrays, buf)
        return buf

    def unpack(self, buf: Any, arrays: list, inplace: bool) -> list:
        """The results, one per array of ``arrays``: views of ``buf``; with ``inplace`` the
        arrays themselves, which now hold them."""
        ops = self.ops
        fused = len(arrays) > 1
        outs, offset = [], 0
        for a in arrays:
            n = ops.numel(a)
            part = ops.view(buf[offset:offset + n], a)
            offset += n
            if inplace:
                ops.copy_back(a, part, fused)
                part = a
            outs.append(part)
        return outs

    def reusable(self, dtype: Any, n: int, like: Any = None) -> Any:
        """``n`` elements of the buffer kept for ``dtype`` (where ``like`` lives), grown when
        too small.  Valid until the next call for the same key."""
        key = self.ops.pool_key(dtype, like)
        buf = self._pool.get(key)
        if buf is None or self.ops.numel(buf) < n:
            buf = self._pool[key] = self.ops.empty(max(n, 1), dtype, like)
        return buf[:n]

    def clear(self) -> None:
        self._pool.clear()


def scale(buf: np.ndarray, factor: float, divisor: int) -> None:
    """buf *= factor / divisor, in place, rounded as Horovod's CPU scaling rounds.

    The two make one factor, computed in double precision (Horovod folds an average into
    the postscale factor the same way).  float16 is multiplied in float32 and rounded back
    to the nearest float16; float32 by the factor rounded to float32; float64 (and complex)
    in their own precision; integers in float64, truncated toward zero as a C cast does.
    So hora's scaled results equal Horovod's bit for bit, not only to the last place.
    """
    factor = float(factor) / divisor
    if factor == 1:
        return
    if buf.dtype == np.float16:
        buf[...] = np.multiply(buf, np.float32(factor), dtype=np.float32)
    elif buf.size == 1 and buf.dtype.kind in "fc":
        # in place, numpy's multiply takes twice as long on one element (0.8 us)
        buf[...] = np.multiply(buf, np.float32(factor) if buf.dtype == np.float32 else factor)
    elif buf.dtype == np.float32:
        np.multiply(buf, np.float32(factor), out=buf)
    elif buf.dtype.kind in "fc":
        np.multiply(buf, factor, out=buf, casting="unsafe")
    else:
        buf[...] = np.trunc(buf.astype(np.float64) * factor).astype(buf.dtype)


class _NumpyOps:
    """:class:`ArrayOps` for NumPy arrays in host memory."""

    def numel(self, a):
        return a.size

    def flat_view(self, a):
        return a.reshape(-1) if a.flags.c_contiguous else None

    def flat_copy(self, a, dtype):
        return np.array(a, dtype=dtype, copy=True, order="C").reshape(-1)

    def empty(self, n, dtype, like):
        return np.empty(n, dtype=dtype)

    def pool_key(self, dtype, like):
        return np.dtype(dtype)

    def concat_into(self, arrays, out):
        np.concatenate([a.reshape(-1) for a in arrays], out=out, casting="unsafe")

    def view(self, part, like):
        return part.reshape(like.shape)

    def copy_back(self, dst, part, fused):
        if fused or not np.shares_memory(dst, part):
            np.copyto(dst, part)

    scale = staticmethod(scale)

    def dtype_of(self, a):
        return a.dtype


NUMPY: ArrayOps = _NumpyOps()


def plan_buckets(sizes: list[int], cap: int, first_cap: int | None = None) -> list[list[int]]:
    """Indices into ``sizes`` (bytes per tensor, in the order the tensors were registered),
    packed into buckets in reverse order (roughly the order backward produces gradients):
    consecutive tensors up to ``cap`` bytes per bucket, the first bucket up to ``first_cap``.
    Each bucket is reduced as one collective instead of one per tensor (DDP's bucketing);
    a small first bucket starts reducing early in backward.  ``cap`` 0: one per tensor."""
    if cap <= 0:
        return [[i] for i in range(len(sizes))]
    first_cap = cap if first_cap is None or first_cap <= 0 else min(cap, first_cap)
    buckets: list[list[int]] = [[]]
    filled = 0
    for i in reversed(range(len(sizes))):
        if buckets[-1] and filled + sizes[i] > (first_cap if len(buckets) == 1 else cap):
            buckets.append([])
            filled = 0
        buckets[-1].append(i)
        filled += sizes[i]
    return buckets


def split_even(items: list, n: int) -> list[list]:
    """``items`` cut into at most ``n`` consecutive non-empty runs whose lengths differ by
    at most one (the first ones longer)."""
    out, start = [], 0
    for count in even_counts(len(items), n):
        if count:
            out.append(items[start:start + count])
        start += count
    return out
