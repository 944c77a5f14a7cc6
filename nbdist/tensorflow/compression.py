"""Gradient compression for the wire: none, or float16 (Horovod's Compression)."""
from __future__ import annotations

import tensorflow as tf


class Compressor:
    """Interface: compress(tensor) -> (tensor, ctx); decompress(tensor, ctx) -> tensor."""

    @staticmethod
    def compress(tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors as they are."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


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
