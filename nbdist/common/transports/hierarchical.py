"""The hierarchical transport for CPU buffers across nodes.

Within a node the bytes go through shared memory; between nodes only one leader
per node (local rank 0) talks MPI: reduce to the leader, allreduce among leaders,
broadcast back out. A node of one rank skips the shared-memory steps, so with
NBDIST_LOCAL_SIZE=1 (every rank its own "node") this is plain MPI among all ranks,
and with NBDIST_LOCAL_SIZE=2 it exercises both halves on one machine.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from ..ops_base import is_half
from ..transport import Transport
from .mpi import MPITransport


class HierarchicalTransport(Transport):
    """Allreduce, allgather, broadcast and reduce-scatter: shm inside a node, MPI between."""

    name = "hierarchical"

    def __init__(self, topology, local, timeout_s: float = 0.0,
                 should_stop: Callable[[], str | None] | None = None):
        """Collective over every rank. `local` is the node's ShmTransport, or None for a lone rank."""
        self.local = local
        self.rank = topology.rank
        self.is_leader = topology.local_rank == 0
        # A private dup of the leaders' communicator, so no other traffic interleaves.
        leaders_comm = topology.cross_comm.Dup()
        if self.is_leader:
            self.leaders: MPITransport | None = MPITransport(leaders_comm, timeout_s, should_stop)
        else:
            leaders_comm.Free()
            self.leaders = None
        # Which global ranks live on each node, in node order (the leaders' rank order).
        members = topology.local_comm.allgather(topology.rank)
        nodes = self.leaders.comm.allgather(members) if self.is_leader else None  # type: ignore[union-attr]
        self.nodes: list[list[int]] = topology.local_comm.bcast(nodes, root=0)
        self.node_of = {g: k for k, ranks in enumerate(self.nodes) for g in ranks}
        self.local_index = {g: i for ranks in self.nodes for i, g in enumerate(ranks)}
        self.my_node = self.node_of[self.rank]
        order = [g for ranks in self.nodes for g in ranks]
        self.node_order_is_rank_order = order == sorted(order)

    @property
    def spans_nodes(self) -> bool:
        return len(self.nodes) > 1

    def allreduce(self, buf: np.ndarray, op) -> None:
        if buf.size == 0:
            return
        if is_half(buf.dtype):  # one rounding at the end, not one per level
            wide = buf.astype(np.float32)
            self.allreduce(wide, op)
            buf[...] = wide.astype(buf.dtype)
            return
        if self.local is not None:
            self.local.reduce(buf, op, 0)
        if self.leaders is not None and self.spans_nodes:
            self.leaders.allreduce(buf, op)
        if self.local is not None:
            self.local.broadcast(buf, 0)

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        if buf.nbytes == 0:
            return
        root_node = self.node_of[root]
        if self.local is not None and self.my_node == root_node:
            self.local.broadcast(buf, self.local_index[root])  # now the root's leader has it
        if self.leaders is not None and self.spans_nodes:
            self.leaders.broadcast(buf, root_node)
        if self.local is not None and self.my_node != root_node:
            self.local.broadcast(buf, 0)

    def allgatherv(self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int]) -> None:
        counts = [int(c) for c in counts]
        mine = self.nodes[self.my_node]
        node_counts = [counts[g] for g in mine]
        node_totals = [sum(counts[g] for g in ranks) for ranks in self.nodes]
        flat_recv = recv.reshape(-1)
        # Gather the node's pieces (in node order) where the leader can send them on.
        if self.local is not None:
            node_buf = np.empty(sum(node_counts), recv.dtype)
            self.local.allgatherv(send.reshape(-1), node_buf, node_counts)
        else:
            node_buf = send.reshape(-1)
        if self.leaders is not None:
            if self.node_order_is_rank_order:
                self.leaders.allgatherv(node_buf, flat_recv, node_totals)
            else:
                by_node = np.empty(sum(node_totals), recv.dtype)
                self.leaders.allgatherv(node_buf, by_node, node_totals)
                self._to_rank_order(by_node, flat_recv, counts)
        if self.local is not None:
            self.local.broadcast(flat_recv, 0)

    def _to_rank_order(self, by_node: np.ndarray, recv: np.ndarray, counts: list[int]) -> None:
        """Blocks arrive node by node; recv wants them by global rank."""
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(int)
        pos = 0
        for ranks in self.nodes:
            for g in ranks:
                recv[starts[g]:starts[g] + counts[g]] = by_node[pos:pos + counts[g]]
                pos += counts[g]

    def reducescatter(self, send: np.ndarray, recv: np.ndarray,
                      counts: Sequence[int], op) -> None:
        # An allreduce of the whole buffer, then each rank keeps its share: simple,
        # and the allreduce is already the hierarchical one.
        counts = [int(c) for c in counts]
        wide_dtype = np.float32 if is_half(send.dtype) else send.dtype
        whole = send.reshape(-1).astype(wide_dtype, copy=True)
        self.allreduce(whole, op)
        start = sum(counts[:self.rank])
        recv.reshape(-1)[...] = whole[start:start + counts[self.rank]].astype(recv.dtype)

    def alltoallv(self, send, send_counts, recv, recv_counts) -> None:
        raise NotImplementedError("the hierarchical transport has no alltoall; "
                                  "TransportSet sends it to MPI")

    def abort(self, reason: str) -> None:
        if self.local is not None:
            self.local.abort(reason)

    def close(self) -> None:
        if self.leaders is not None:
            try:
                self.leaders.comm.Free()
            except Exception:  # MPI already finalized
                pass
            self.leaders = None
