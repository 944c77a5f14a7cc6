"""Gradient compression for the wire: none, or float16 (Horovod's Compression)."""
from __future__ import annotations

import tensorflow as tf

from nbdist.common.compression import Compressor, NoneCompressor


class FP16Compressor(Compressor):
    """Sends floating-point tensors as float16 (half the bytes), restoring their dtype after."""

    @staticmethod
    def compress(tensor):
        dtype = tensor.dtype
        if dtype.is_floating and dtype != tf.float16:
            return tf.cast(tensor, tf.float16), dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tf.cast(tensor, ctx)


class Compression:
    """The compression choices: Compression.none and Compression.fp16."""

    none = NoneCompressor
    fp16 = FP16Compressor
