"""Gradient compression for ``hora.tensorflow``'s allreduce, with Horovod's names and
semantics (the rules are :mod:`hora.core.gradients`'; this module gives them TensorFlow's
casts).  Layer: tensorflow (a binding)."""
from __future__ import annotations

from typing import Any

import tensorflow as tf

from hora.core.gradients import Casts, Compressions, Compressor, NoneCompressor
from hora.core.gradients import FP16Compressor as _FP16

__all__ = ["Compression", "Compressor", "NoneCompressor", "FP16Compressor"]


class _TFCasts(Casts):
    def is_float(self, tensor: tf.Tensor) -> bool:
        return tensor.dtype.is_floating and tensor.dtype != tf.float16

    def cast(self, tensor: tf.Tensor, dtype: Any) -> tf.Tensor:
        return tf.cast(tensor, tf.float16 if dtype is None else dtype)


class FP16Compressor(_FP16):
    """Sends floating-point tensors (float32/64, bfloat16) as float16, restoring their dtype
    afterwards; other dtypes go as they are (Horovod's rule)."""
    casts = _TFCasts()


class Compression(Compressions):
    """``Compression.none`` and ``Compression.fp16``."""
    fp16 = FP16Compressor
