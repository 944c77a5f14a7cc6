"""Gradient compression applied around allreduce, with Horovod's Compression names."""
from __future__ import annotations

import torch


class Compressor:
    """Turns a tensor into what is sent (compress) and back (decompress)."""

    @staticmethod
    def compress(tensor: torch.Tensor):
        """Returns (tensor to send, context that decompress needs)."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx):
        """Returns the tensor in its original form."""
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
