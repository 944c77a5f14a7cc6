"""TransportSet: the transports one rank holds, and the choice of one per op.

This is the one place that decides which transport moves an op's bytes:
GPU buffers → NCCL; CPU buffers on one node → shared memory; CPU buffers across
nodes → hierarchical (shared memory inside a node, MPI between node leaders);
NBDIST_CPU_OPERATIONS=mpi|shm|hierarchical overrides the CPU choice.
"""
from __future__ import annotations

from ..transport import Transport
from .mpi import MPITransport


class TransportSet:
    """Creates the transports at init() and hands out the right one for each op."""

    def __init__(self, config, topology, should_stop):
        self.config = config
        self.topology = topology
        self.mpi: Transport = MPITransport(topology.data_comm, config.timeout_s, should_stop)
        self.shm: Transport | None = None  # the native module's, when built
        self.hierarchical: Transport | None = None
        self.nccl: Transport | None = None

    def for_op(self, device: str, kind: str) -> Transport:
        """The transport for an op on `device` ('cpu' or 'cuda:N') of the given kind."""
        if device != "cpu":
            if self.nccl is None:
                raise RuntimeError(
                    f"{kind} on a GPU buffer ({device}) needs the NCCL transport, which is not "
                    "available here (nccl_built() is False); move the tensor to the CPU")
            return self.nccl
        return self.mpi

    def describe(self) -> dict:
        """Which transport each kind of op would use, for `nbdist doctor`."""
        return {"cpu": self.for_op("cpu", "allreduce").name,
                "gpu": self.nccl.name if self.nccl else "unavailable"}

    def close(self) -> None:
        for transport in (self.nccl, self.hierarchical, self.shm, self.mpi):
            if transport is not None:
                transport.close()
