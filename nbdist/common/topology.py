"""Who is where: world, node-local and cross-node communicators of this rank."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Topology:
    """This rank's place in the world, and the communicators the runtime uses."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    hostname: str
    hosts: list  # every rank's hostname, in rank order (for messages and %dist_status)
    world: Any  # the user's MPI communicator (COMM_WORLD)
    control_comm: Any  # private dup: negotiation messages
    data_comm: Any  # private dup: collective data
    local_comm: Any  # ranks on this node (or this pretend node)
    cross_comm: Any  # ranks with the same local rank, one per node

    @classmethod
    def from_mpi(cls, comm, local_size_override: int = 0) -> "Topology":
        """Split `comm` into node-local and cross-node communicators.

        local_size_override > 0 pretends nodes hold that many consecutive ranks, so the
        cross-node (hierarchical) path runs on one machine. Otherwise a node is what MPI
        calls one (COMM_TYPE_SHARED: the ranks the launcher put on one host, e.g. one
        hydra proxy per `-hosts` entry, one slurmd per node), because the shared-memory
        transport needs exactly that; hostnames only label the nodes.
        """
        from mpi4py import MPI
        import socket

        if local_size_override > 0:
            local_comm = comm.Split(color=comm.rank // local_size_override, key=comm.rank)
        else:
            local_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
        cross_comm = comm.Split(color=local_comm.rank, key=comm.rank)
        return cls(
            rank=comm.rank, size=comm.size,
            local_rank=local_comm.rank, local_size=local_comm.size,
            cross_rank=cross_comm.rank, cross_size=cross_comm.size,
            hostname=socket.gethostname(), hosts=comm.allgather(socket.gethostname()), world=comm,
            control_comm=comm.Dup(), data_comm=comm.Dup(),
            local_comm=local_comm, cross_comm=cross_comm,
        )

    def free(self) -> None:
        """Free the communicators this topology created."""
        for c in (self.control_comm, self.data_comm, self.local_comm, self.cross_comm):
            try:
                c.Free()
            except Exception:  # already freed, or MPI finalized
                pass
