"""Gradient compression for allreduce, with Horovod's names (the rules are
:mod:`hora.core.gradients`'; this module gives them torch's casts).  Layer: torch."""
from __future__ import annotations

from typing import Any

import torch

from ..core.gradients import Casts, Compressions, Compressor, NoneCompressor
from ..core.gradients import FP16Compressor as _FP16

__all__ = ["Compression", "Compressor", "NoneCompressor", "FP16Compressor"]


class _TorchCasts(Casts):
    def is_float(self, tensor: torch.Tensor) -> bool:
        return tensor.dtype.is_floating_point and tensor.dtype != torch.float16

    def cast(self, tensor: torch.Tensor, dtype: Any) -> torch.Tensor:
        return tensor.to(torch.float16 if dtype is None else dtype)


class FP16Compressor(_FP16):
    """Sends floating-point tensors as float16 (half the bytes), restoring their dtype."""
    casts = _TorchCasts()


class Compression(Compressions):
    """``Compression.none`` and ``Compression.fp16``."""
    fp16 = FP16Compressor
