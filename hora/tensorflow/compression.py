"""Gradient compression for ``hora.tensorflow``'s allreduce, with Horovod's names and
semantics.  Layer: tensorflow (a binding)."""
from __future__ import annotations

from typing import Any

import tensorflow as tf

__all__ = ["Compression", "Compressor", "NoneCompressor", "FP16Compressor"]


class Compressor:
    """Turns a tensor into what is sent (``compress``) and back (``decompress``)."""

    @staticmethod
    def compress(tensor: tf.Tensor) -> tuple[tf.Tensor, Any]:
        """Returns ``(tensor_to_send, context)``."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: Any) -> tf.Tensor:
        """Returns the tensor that ``compress`` was given, from what was sent."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors as they are (the default)."""

    @staticmethod
    def compress(tensor: tf.Tensor) -> tuple[tf.Tensor, None]:
        return tensor, None

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: None) -> tf.Tensor:
        return tensor


class FP16Compressor(Compressor):
    """Sends floating-point tensors (float32/64, bfloat16) as float16, restoring their dtype
    afterwards; other dtypes go as they are (Horovod's rule)."""

    @staticmethod
    def compress(tensor: tf.Tensor) -> tuple[tf.Tensor, tf.DType]:
        if tensor.dtype.is_floating and tensor.dtype != tf.float16:
            return tf.cast(tensor, tf.float16), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: tf.DType) -> tf.Tensor:
        if ctx.is_floating and tensor.dtype != ctx:
            return tf.cast(tensor, ctx)
        return tensor


class Compression:
    """``Compression.none`` and ``Compression.fp16``."""
    none: type[Compressor] = NoneCompressor
    fp16: type[Compressor] = FP16Compressor
