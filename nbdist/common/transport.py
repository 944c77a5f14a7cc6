"""The data-path interface (TransportSet in transports/select.py chooses one per op).

The engine negotiates *what* runs; a Transport moves the bytes of an op that every
rank of the communicator has agreed to run, in the same order on every rank.
Transports see plain, C-contiguous numpy arrays (GPU transports: device buffers with
the same methods); averaging and scaling are the engine's job, so a transport only
implements the reductions Sum, Min, Max and Product.

float16 and bfloat16 sums must accumulate in float32 (or better); a transport that
cannot reduce a dtype natively upcasts internally.
"""
from __future__ import annotations

import abc
from typing import Sequence

import numpy as np

from .ops_base import ReduceOp


class TransportError(RuntimeError):
    """A transport could not complete an op (a peer died, a timeout, an abort)."""


class Transport(abc.ABC):
    """Moves the bytes of agreed collectives between the ranks of one communicator."""

    name: str = "abstract"

    @abc.abstractmethod
    def allreduce(self, buf: np.ndarray, op: ReduceOp) -> None:
        """Reduce `buf` across ranks in place (op is Sum, Min, Max or Product)."""

    @abc.abstractmethod
    def allgatherv(self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int]) -> None:
        """Concatenate every rank's `send` into `recv`; counts[r] = elements from rank r."""

    @abc.abstractmethod
    def broadcast(self, buf: np.ndarray, root: int) -> None:
        """Copy root's `buf` into every rank's `buf`."""

    @abc.abstractmethod
    def alltoallv(self, send: np.ndarray, send_counts: Sequence[int],
                  recv: np.ndarray, recv_counts: Sequence[int]) -> None:
        """Rank r sends send_counts[p] elements to rank p, in rank order; receives likewise."""

    @abc.abstractmethod
    def reducescatter(self, send: np.ndarray, recv: np.ndarray,
                      counts: Sequence[int], op: ReduceOp) -> None:
        """Reduce `send` across ranks; rank r keeps elements [sum(counts[:r]), +counts[r])."""

    def close(self) -> None:  # noqa: B027  (optional: most transports hold nothing)
        """Release what the transport holds (segments, communicators)."""

