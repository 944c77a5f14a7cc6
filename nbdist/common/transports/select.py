"""TransportSet: the transports one rank holds, and the choice of one per op.

This is the one place that decides which transport moves an op's bytes:
GPU buffers → NCCL; CPU buffers on one node → shared memory; CPU buffers across
nodes → hierarchical (shared memory inside a node, MPI between node leaders);
NBDIST_CPU_OPERATIONS=mpi|shm|hierarchical overrides the CPU choice. Kinds a
native transport lacks (alltoall across nodes) stay on MPI.

Every choice is agreed by all ranks at init (a rank without the native module
makes every rank use MPI), because a collective must use the same transport
on every rank.
"""
from __future__ import annotations

import warnings

from ..transport import Transport
from .mpi import MPITransport

SHM_KINDS = frozenset({"allreduce", "allgather", "broadcast", "alltoall", "reducescatter"})
HIERARCHICAL_KINDS = frozenset({"allreduce", "allgather", "broadcast", "reducescatter"})
KINDS = ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter")


def warn_single_copy_off(reason: str) -> None:
    """Say, once per node, that the shm transport copies twice where it would copy once.

    Nothing fails without single copy, so nothing else would tell: every broadcast and
    allgather from 16 KiB and every allreduce from 2 MiB goes through the slots instead,
    1.3-2x slower from 256 KiB (docs/native.md). `nbdist doctor` prints the same reason.
    """
    warnings.warn(
        f"nbdist: single copy is off on this node: {reason}. Big transfers go through the "
        "shared-memory slots instead (two copies, about 1.3-2x slower from 256 KiB). To have "
        "it, let the ranks read each other (process_vm_readv needs ptrace access: Yama "
        "ptrace_scope 0 or 1; in a container, CAP_SYS_PTRACE or a seccomp profile that allows "
        "it); NBDIST_SHM_CMA_BYTES=0 turns it off without this warning.",
        RuntimeWarning, stacklevel=3)


class TransportSet:
    """Creates the transports at init() and hands out the right one for each op."""

    def __init__(self, config, topology, should_stop):
        from mpi4py import MPI

        from .shm import ShmTransport, native_module

        self.config = config
        self.topology = topology
        self.mpi: Transport = MPITransport(topology.data_comm, config.timeout_s, should_stop)
        self.shm: Transport | None = None
        self.hierarchical: Transport | None = None
        self.nccl: Transport | None = None
        self.nccl_reason = ""
        comm = topology.data_comm
        nodes = comm.allreduce(1 if topology.local_rank == 0 else 0)
        self.multi_node = nodes > 1
        # A node of one rank needs no shared memory, so it does not need the module either.
        native_ok = native_module() is not None or topology.local_size == 1
        native_ok = bool(comm.allreduce(int(native_ok), op=MPI.MIN))
        self.cpu_mode = self._cpu_mode(config.cpu_operations, native_ok, topology.size)
        if self.cpu_mode in ("shm", "hierarchical"):
            self._init_shm(ShmTransport, config, topology, should_stop)
        if self.cpu_mode == "hierarchical":
            from .hierarchical import HierarchicalTransport

            self.hierarchical = HierarchicalTransport(topology, self.shm, config.timeout_s, should_stop)
        self._init_nccl(comm, config, should_stop)

    def _init_shm(self, ShmTransport, config, topology, should_stop) -> None:
        """Create the node's segment; if any node cannot, every rank falls back to MPI."""
        from mpi4py import MPI

        error = None
        if topology.local_size > 1:
            try:
                self.shm = ShmTransport(topology.local_comm, topology.rank, config.timeout_s,
                                        should_stop)
            except Exception as exc:  # e.g. /dev/shm too small in a container
                error = str(exc)
        failed = topology.data_comm.allreduce(error is not None, op=MPI.LOR)
        if not failed:
            off = getattr(self.shm, "single_copy_off", "")  # (shm: None on one rank a node)
            if off and topology.local_rank == 0:
                warn_single_copy_off(off)
            return
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        reasons = [e for e in topology.data_comm.allgather(error) if e]
        if config.cpu_operations in ("shm", "hierarchical"):
            raise RuntimeError(f"NBDIST_CPU_OPERATIONS={config.cpu_operations}, but the shared-memory "
                               f"transport could not start: {reasons[0]}")
        if topology.rank == 0:
            warnings.warn(f"nbdist: shared memory unavailable ({reasons[0]}); CPU collectives use MPI",
                          RuntimeWarning, stacklevel=2)
        self.cpu_mode = "mpi"

    def _cpu_mode(self, requested: str, native_ok: bool, size: int) -> str:
        """'mpi', 'shm' or 'hierarchical', the same on every rank."""
        if requested in ("shm", "hierarchical") and not native_ok:
            raise RuntimeError(
                f"NBDIST_CPU_OPERATIONS={requested} needs the native module (nbdist._native) on "
                "every rank, and some rank does not have it; rebuild nbdist "
                "(pip install -e .) or use NBDIST_CPU_OPERATIONS=mpi")
        if requested == "mpi" or size == 1 or not native_ok:
            return "mpi"
        if requested == "hierarchical" or self.multi_node:
            return "hierarchical"  # 'shm' across nodes: shared memory inside each node
        return "shm"

    def _init_nccl(self, comm, config, should_stop) -> None:
        from mpi4py import MPI

        from .nccl import NCCLTransport, load_nccl

        self.nccl_reason = load_nccl()
        everywhere = comm.allreduce(int(self.nccl_reason == ""), op=MPI.MIN)
        if everywhere:
            self.nccl = NCCLTransport(comm, config.timeout_s, should_stop)
        elif not self.nccl_reason:
            self.nccl_reason = "NCCL is not available on every rank"

    def for_op(self, device: str, kind: str) -> Transport:
        """The transport for an op on `device` ('cpu' or 'cuda:N') of the given kind."""
        if device != "cpu":
            if self.nccl is None:
                raise RuntimeError(
                    f"{kind} on a GPU buffer ({device}) needs the NCCL transport, which is not "
                    f"available here ({self.nccl_reason}); move the tensor to the CPU")
            return self.nccl
        if self.cpu_mode == "hierarchical":
            if kind in HIERARCHICAL_KINDS:
                return self.hierarchical  # type: ignore[return-value]
            if kind in SHM_KINDS and self.shm is not None and not self.multi_node:
                return self.shm
            return self.mpi
        if self.cpu_mode == "shm" and kind in SHM_KINDS and self.shm is not None:
            return self.shm
        return self.mpi

    def describe(self) -> dict:
        """Which transport each kind of op would use, for `nbdist doctor`."""
        cpu = {kind: self.for_op("cpu", kind).name for kind in KINDS}
        shm = self.shm
        return {"cpu_mode": self.cpu_mode, "cpu": cpu,
                "gpu": self.nccl.name if self.nccl else f"unavailable ({self.nccl_reason})",
                "single_copy": {"bytes": getattr(shm, "single_copy_bytes", None),
                                "peer_reads": getattr(shm, "peer_reads", None),
                                "off": getattr(shm, "single_copy_off", ""),
                                "tuned": getattr(shm, "tuned_paths", ())}}

    def close(self) -> None:
        for transport in (self.nccl, self.hierarchical, self.shm, self.mpi):
            if transport is not None:
                transport.close()
