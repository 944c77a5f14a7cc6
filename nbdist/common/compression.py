"""Horovod's compression interface, shared by the framework bindings.

A binding adds its FP16Compressor (the cast is framework-specific); the interface
and the no-op compressor are the same everywhere.
"""
from __future__ import annotations


class Compressor:
    """Turns a tensor into what is sent (compress) and back (decompress)."""

    @staticmethod
    def compress(tensor):
        """Returns (tensor to send, context that decompress needs)."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
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
