"""The MPI transport: mpi4py's non-blocking collectives, waited on with back-off.

Non-blocking calls plus a polling wait (spin briefly, then sleep) keep an
oversubscribed node responsive, and let a wait give up on abort or timeout
instead of hanging in MPI for ever.
"""
from __future__ import annotations

import os
import time
from typing import Callable, Sequence

import numpy as np

from ..ops_base import ReduceOp, is_half
from ..transport import Transport, TransportError


def wait_with_backoff(request, should_stop: Callable[[], str | None] | None = None,
                      timeout_s: float = 0.0, what: str = "MPI operation") -> None:
    """Wait for an MPI request: spin, then yield the CPU, then sleep (50 µs growing to 1 ms).

    MPICH moves a non-blocking collective forward only inside MPI calls, so the
    first 20 ms keep calling Test (spinning 200 µs, then with sched_yield between
    calls, which hands the core to another rank on an oversubscribed node); only a
    long wait (a slow peer) sleeps. `should_stop` returns a reason to give up (an
    abort) or None; `timeout_s` > 0 bounds the wait. Both raise TransportError.
    """
    start = time.monotonic()
    next_check = start + 0.01
    sleep_s = 50e-6
    while not request.Test():
        now = time.monotonic()
        waited = now - start
        if waited < 200e-6:
            continue
        if waited < 0.02:
            os.sched_yield()
        else:
            time.sleep(sleep_s)
            sleep_s = min(sleep_s * 1.5, 1e-3)
        if now >= next_check:
            next_check = now + 0.01
            reason = should_stop() if should_stop else None
            if reason:
                raise TransportError(f"{what} abandoned: {reason}")
            if timeout_s and waited > timeout_s:
                raise TransportError(f"{what} did not complete within {timeout_s:g} s")


class MPITransport(Transport):
    """Collectives over an MPI communicator (one dup of it, private to the engine)."""

    name = "mpi"

    def __init__(self, comm, timeout_s: float = 0.0,
                 should_stop: Callable[[], str | None] | None = None):
        from mpi4py import MPI

        self._MPI = MPI
        self.comm = comm
        self.timeout_s = timeout_s
        self.should_stop = should_stop
        self._ops = {ReduceOp.Sum: MPI.SUM, ReduceOp.Min: MPI.MIN,
                     ReduceOp.Max: MPI.MAX, ReduceOp.Product: MPI.PROD}

    def _wait(self, request, what: str) -> None:
        wait_with_backoff(request, self.should_stop, self.timeout_s, what)

    def _mpi_op(self, op: ReduceOp):
        try:
            return self._ops[ReduceOp(op)]
        except KeyError:
            raise ValueError(f"the MPI transport cannot reduce with {ReduceOp(op).name}") from None

    def allreduce(self, buf: np.ndarray, op: ReduceOp) -> None:
        if buf.size == 0:
            return
        if is_half(buf.dtype):  # MPI has no 16-bit float: accumulate in float32
            wide = buf.astype(np.float32)
            self.allreduce(wide, op)
            buf[...] = wide.astype(buf.dtype)
            return
        if buf.dtype == np.bool_:
            raise TypeError("bool arrays cannot be reduced; cast them to uint8 first")
        self._wait(self.comm.Iallreduce(self._MPI.IN_PLACE, buf, op=self._mpi_op(op)),
                   "allreduce")

    def allgatherv(self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int]) -> None:
        item = recv.dtype.itemsize
        byte_counts = [int(c) * item for c in counts]
        displs = np.concatenate([[0], np.cumsum(byte_counts)[:-1]]).astype(int).tolist()
        self._wait(self.comm.Iallgatherv(
            [send.reshape(-1).view(np.uint8), self._MPI.BYTE],
            [recv.reshape(-1).view(np.uint8), (byte_counts, displs), self._MPI.BYTE]),
            "allgather")

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        if buf.nbytes == 0:
            return
        self._wait(self.comm.Ibcast([buf.reshape(-1).view(np.uint8), self._MPI.BYTE], root=root),
                   "broadcast")

    def alltoallv(self, send: np.ndarray, send_counts: Sequence[int],
                  recv: np.ndarray, recv_counts: Sequence[int]) -> None:
        item = send.dtype.itemsize
        sc = [int(c) * item for c in send_counts]
        rc = [int(c) * item for c in recv_counts]
        sd = np.concatenate([[0], np.cumsum(sc)[:-1]]).astype(int).tolist()
        rd = np.concatenate([[0], np.cumsum(rc)[:-1]]).astype(int).tolist()
        self._wait(self.comm.Ialltoallv(
            [send.reshape(-1).view(np.uint8), (sc, sd), self._MPI.BYTE],
            [recv.reshape(-1).view(np.uint8), (rc, rd), self._MPI.BYTE]), "alltoall")

    def reducescatter(self, send: np.ndarray, recv: np.ndarray,
                      counts: Sequence[int], op: ReduceOp) -> None:
        if is_half(send.dtype):
            wide_recv = np.empty(recv.shape, np.float32)
            self.reducescatter(send.astype(np.float32), wide_recv, counts, op)
            recv[...] = wide_recv.astype(recv.dtype)
            return
        if sum(counts) == 0:
            return
        self._wait(self.comm.Ireduce_scatter(send.reshape(-1), recv.reshape(-1),
                                             [int(c) for c in counts], op=self._mpi_op(op)),
                   "reducescatter")
