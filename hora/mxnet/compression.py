"""Gradient compression for allreduce, with Horovod's names (``horovod.mxnet.compression``;
the rules are :mod:`hora.core.gradients`', this module gives them MXNet's casts).
Layer: mxnet.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..core.gradients import Casts, Compressions, Compressor, NoneCompressor
from ..core.gradients import FP16Compressor as _FP16

__all__ = ["Compression", "Compressor", "NoneCompressor", "FP16Compressor"]


class _MXNetCasts(Casts):
    def is_float(self, tensor: Any) -> bool:
        return np.dtype(tensor.dtype).kind == "f" and np.dtype(tensor.dtype) != np.float16

    def cast(self, tensor: Any, dtype: Any) -> Any:
        return tensor.astype("float16" if dtype is None else dtype, copy=False)


class FP16Compressor(_FP16):
    """Sends floating-point arrays as float16, restoring their dtype afterwards."""
    casts = _MXNetCasts()


class Compression(Compressions):
    """``Compression.none`` and ``Compression.fp16`` (Horovod's names)."""
    fp16 = FP16Compressor
