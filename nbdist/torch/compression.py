"""Gradient compression applied around allreduce, with Horovod's Compression names."""
from __future__ import annotations

import torch

from nbdist.common.compression import Compressor, NoneCompressor


class FP16Compressor(Compressor):
    """Sends floating-point tensors as float16 (half the bytes); others unchanged."""

    @staticmethod
    def compress(tensor):
        dtype = tensor.dtype
        if dtype.is_floating_point and dtype != torch.float16:
            return tensor.to(torch.float16), dtype
        return tensor, dtype

    @staticmethod
    def decompress(tensor, ctx):
        if ctx is not None and tensor.dtype != ctx:
            return tensor.to(ctx)
        return tensor


class Compression:
    """Horovod's choices: `Compression.none` and `Compression.fp16`."""

    none = NoneCompressor
    fp16 = FP16Compressor
