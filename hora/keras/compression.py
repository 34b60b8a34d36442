"""Gradient compression for ``hora.keras``, with Horovod's names: the rules are
:mod:`hora.core.gradients`'; the casts are ``keras.ops``', so one ``Compression.fp16`` serves
the TensorFlow and the torch backend alike.  Layer: keras (a binding)."""
from __future__ import annotations

from typing import Any

import keras

from hora.core.gradients import Compressor, NoneCompressor
from hora.core.gradients import FP16Compressor as _FP16

__all__ = ["Compression", "Compressor", "NoneCompressor", "FP16Compressor", "to_tensorflow",
           "from_tensorflow"]


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


def _fp16_pair() -> tuple[type[Compressor], type[Compressor]]:
    """This module's fp16 compressor and hora.tensorflow's: one rule under Keras' casts and
    under TensorFlow's (which also work in a ``tf.compat.v1`` graph).  ``none`` is the same
    class in both."""
    from hora.tensorflow.compression import Compression as TFCompression
    return Compression.fp16, TFCompression.fp16


def to_tensorflow(compression: Any) -> Any:
    """``compression`` (None: none) as hora.tensorflow's compressor of the same name; any
    other compressor as it is."""
    if compression is None:
        return Compression.none
    ours, theirs = _fp16_pair()
    return theirs if compression is ours else compression


def from_tensorflow(compression: Any) -> Any:
    """hora.tensorflow's compressor as this module's of the same name; any other as it is."""
    ours, theirs = _fp16_pair()
    return ours if compression is theirs else compression
