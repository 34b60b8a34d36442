"""Gradient compression for ``hora.keras``, with Horovod's names: the rules are
:mod:`hora.core.gradients`'; the casts are ``keras.ops``', so one ``Compression.fp16`` serves
the TensorFlow and the torch backend alike.  Layer: keras (a binding)."""
from __future__ import annotations

from typing import Any

import keras

from hora.core.gradients import Compressor, NoneCompressor
from hora.core.gradients import FP16Compressor as _FP16

__all__ = ["Compression", "Compressor", "NoneCompressor", "FP16Compressor"]


class _KerasCasts:
    def dtype(self, tensor: Any) -> str:
        return keras.backend.standardize_dtype(tensor.dtype)

    def is_float(self, tensor: Any) -> bool:
        dtype = self.dtype(tensor)
        return keras.backend.is_float_dtype(dtype) and dtype != "float16"

    def cast(self, tensor: Any, dtype: Any) -> Any:
        return keras.ops.cast(tensor, "float16" if dtype is None else dtype)


class FP16Compressor(_FP16):
    """Sends floating-point gradients as float16 (half the bytes), restoring their dtype
    afterwards; other dtypes go as they are."""
    casts = _KerasCasts()


class Compression:
    """``Compression.none`` and ``Compression.fp16``."""
    none: type[Compressor] = NoneCompressor
    fp16: type[Compressor] = FP16Compressor
