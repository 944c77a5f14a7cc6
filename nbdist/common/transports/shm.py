"""The shared-memory transport: collectives among the ranks of one node, in C++.

Local rank 0 creates a segment (random name, mode 0600), sends its name over the
node's MPI communicator, every rank attaches, and the name is unlinked as soon as
all have: /dev/shm holds nothing of ours even if ranks are later killed.
The bytes move in nbdist._native with the GIL released.
"""
from __future__ import annotations

import os
from typing import Callable, Sequence

import numpy as np

from ..config import env_bytes, env_int
from ..transport import Transport, TransportError
from ..sizes import MiB
from ._dtypes import dtype_code, op_code



def native_module():
    """nbdist._native when it is built and has the shm collectives, else None."""
    try:
        from nbdist import _native
    except ImportError:
        return None
    return _native if getattr(_native, "shm_built", lambda: False)() else None


def _env_int(name: str, default: int) -> int:
    return env_int(name.removeprefix("NBDIST_"), default)


def _env_bytes(name: str, default: int) -> int:
    return env_bytes(name.removeprefix("NBDIST_"), default)


PATH_KINDS = ("broadcast", "allgather", "allreduce")  # the native path plan's order
YAMA_PTRACE_SCOPE = "/proc/sys/kernel/yama/ptrace_scope"
_PR_SET_PTRACER = 0x59616D61  # prctl option "Yama"
_PR_SET_PTRACER_ANY = 2**64 - 1  # (unsigned long)-1


def allow_peer_reads(scope_file: str = YAMA_PTRACE_SCOPE) -> str:
    """Let this node's other ranks read this process's memory (process_vm_readv) where
    Yama's ptrace_scope is 1, and say what was done.

    Scope 1 (Ubuntu's default) lets a process read only its own descendants, so ranks,
    which are siblings, could not read each other and every single-copy transfer would
    stay off. Each rank therefore names any process as its ptracer (PR_SET_PTRACER_ANY,
    as Open MPI's CMA support does): for this rank, the same as scope 0, where any
    process of the same user may attach. Scopes 2 and 3 cannot be relaxed so; no Yama,
    nothing to do. NBDIST_SHM_CMA_BYTES=0 turns single copy off, and this with it.
    """
    try:
        with open(scope_file) as f:
            scope = f.read().strip()
    except OSError:
        return "no Yama"
    if scope != "1":
        return f"ptrace_scope {scope}"
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    prctl = libc.prctl
    prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
    if prctl(_PR_SET_PTRACER, _PR_SET_PTRACER_ANY, 0, 0, 0) != 0:
        return f"ptrace_scope 1: prctl(PR_SET_PTRACER) failed: {os.strerror(ctypes.get_errno())}"
    return "ptrace_scope 1: peers allowed"


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def _contiguous(a, what: str, writeable: bool = False) -> np.ndarray:
    if not isinstance(a, np.ndarray):
        raise TypeError(f"the shm transport takes numpy arrays for {what}, not {type(a).__name__}")
    if not a.flags.c_contiguous:
        raise ValueError(f"the shm transport needs a C-contiguous array for {what}")
    if writeable and not a.flags.writeable:
        raise ValueError(f"the shm transport needs a writeable array for {what}")
    return a


class ShmTransport(Transport):
    """Allreduce, allgather, broadcast, reduce-scatter and alltoall among one node's ranks.

    Collective to construct: every rank of `local_comm` must create it at the same time.
    """

    name = "shm"

    def __init__(self, local_comm, global_rank: int, timeout_s: float = 0.0,
                 should_stop: Callable[[], str | None] | None = None,
                 slot_bytes: int | None = None, nsets: int | None = None,
                 single_copy: bool = True):
        native = native_module()
        if native is None:
            raise RuntimeError("the shm transport needs nbdist._native (the native module is not built)")
        self.comm = local_comm
        self.rank = local_comm.rank
        self.size = local_comm.size
        self.global_rank = global_rank
        self.timeout_s = timeout_s
        self.should_stop = should_stop
        oversubscribed = self.size > _cpus()
        # Ranks that time-share cores pay a context switch per synchronisation, so
        # they move bigger chunks (fewer steps); otherwise 1 MiB keeps steps in cache.
        slot_bytes = slot_bytes or _env_bytes("NBDIST_SHM_SLOT_BYTES", (4 if oversubscribed else 1) * MiB)
        slot_bytes = max(4096, (slot_bytes + 4095) // 4096 * 4096)
        nsets = nsets or _env_int("NBDIST_SHM_SETS", 2)
        self._native = self._open(native, slot_bytes, nsets)
        # Spinning only pays when every rank has a core; otherwise yield soon.
        spin = _env_int("NBDIST_SHM_SPIN", 100 if oversubscribed else 1000)
        yields = _env_int("NBDIST_SHM_YIELDS", 50 if oversubscribed else 200)
        self._native.set_tuning(spin, yields, _env_bytes("NBDIST_SHM_SMALL_BYTES", 64 * 1024),
                                _env_bytes("NBDIST_SHM_STREAM_BYTES", 0))
        # Single copy (process_vm_readv) or two through the cache-warm slots, measured side
        # by side on the path users call, where every op follows its agreement vote
        # (benchmarks/cma_threshold.py, docs/native.md): at one rank per core single copy
        # is ahead from 16 KiB (allgather: moved in all) up, 1.3-2.2x; where ranks share
        # cores, from about 1 MiB (broadcast) and, since the vote carries the addresses (one
        # sync fewer), 256 KiB moved (allgather; 4 MiB before). A loop of raw
        # transport calls favours the slots (a slot broadcast's root runs into the next
        # call while the peers still read), which is not how the engine calls them.
        # NBDIST_SHM_CMA_BYTES alone sets all three (with the allreduce's, below).
        cma_given = _env_bytes("NBDIST_SHM_CMA_BYTES", -1)
        cma_bytes = cma_given if cma_given >= 0 else (MiB if oversubscribed else 16 * 1024)
        cma_gather = _env_bytes("NBDIST_SHM_CMA_ALLGATHER_BYTES",
                              cma_given if cma_given >= 0
                              else (256 * 1024 if oversubscribed else 16 * 1024))
        # An allreduce goes single-copy from the same size whether the agreement's vote
        # carries its addresses (ShmComm::vote_allreduce) or it syncs on its own
        # (allreduce_cma: fused units, raw calls). Below a few MiB the slots win
        # (cache-warm, no page pinning): crossovers measured through the API at 2 MiB
        # (2 ranks) and 4 MiB (4 ranks on 2 cores), for both.
        cma_reduce = _env_bytes("NBDIST_SHM_CMA_ALLREDUCE_BYTES",
                              cma_given if cma_given >= 0
                              else (4 * MiB if oversubscribed else 2 * MiB))
        # (broadcast, allgather, allreduce) bytes from which this transport moves them
        # single-copy
        self.single_copy_bytes: tuple[int, ...] = (0, 0, 0)
        self.peer_reads = "not tried"  # allow_peer_reads's answer, once single copy is tried
        self.single_copy_off = ""  # why single copy was asked for and could not be had
        self.tuned_paths: tuple[str, ...] = ()  # kinds whose path is chosen by measurement
        if single_copy and (cma_bytes or cma_gather or cma_reduce) and self._cma_works():
            # Which path is faster from 256 KiB moves with the memory system's state, even
            # on one machine (docs/native.md, "Paths chosen by measurement"): local rank 0
            # times both and every allreduce carries its choice to all ranks. A threshold
            # set in the environment is the user's choice and stays fixed.
            tuned: tuple[str, ...] = ()
            if _env_int("NBDIST_SHM_TUNE_PATHS", 1):
                given = {name.removeprefix("NBDIST_SHM_CMA_") for name in os.environ
                         if name.startswith("NBDIST_SHM_CMA_")}
                tuned = tuple(kind for kind, names in (("broadcast", {"BYTES"}),
                                                       ("allgather", {"BYTES", "ALLGATHER_BYTES"}),
                                                       ("allreduce", {"BYTES", "ALLREDUCE_BYTES"}))
                              if not given & names)
            self.set_single_copy((cma_bytes, cma_gather, cma_reduce), tuned)

    def set_single_copy(self, thresholds: tuple[int, int, int], tuned: Sequence[str] = ()) -> None:
        """From how many bytes (broadcast, allgather, allreduce) go single-copy (0: never),
        and the kinds whose path local rank 0 chooses by measurement from 256 KiB, starting
        from those thresholds. Collective: every rank at the same point, no op in flight."""
        self.single_copy_bytes = tuple(thresholds)
        self.tuned_paths = tuple(k for k in PATH_KINDS if k in tuned)
        self._native.set_cma_bytes(thresholds[0], thresholds[1])
        self._native.set_cma_allreduce_bytes(thresholds[2])
        self._native.set_path_tuning(*(k in self.tuned_paths for k in PATH_KINDS))

    def _cma_works(self) -> bool:
        """Whether every rank can read its neighbour's memory (process_vm_readv); collective.

        Each rank first lets its peers read it where Yama's ptrace_scope is 1
        (allow_peer_reads). Containers or a hardened kernel (ptrace_scope >= 2) may still
        forbid it; then every transfer keeps going through the slots (two copies).
        """
        import ctypes

        self.peer_reads = allow_peer_reads()  # before the probe's allgather: all have run it

        class IoVec(ctypes.Structure):
            _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

        mine = np.full(8, 1000 + self.rank, np.int64)
        peers = self.comm.allgather((os.getpid(), _address(mine), self.global_rank))
        pid, address, neighbour = peers[(self.rank + 1) % self.size]
        got = np.zeros(8, np.int64)
        error = ""
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            local, remote = IoVec(_address(got), got.nbytes), IoVec(address, got.nbytes)
            n = libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
            if n != got.nbytes:
                error = f"process_vm_readv: {os.strerror(ctypes.get_errno())}"
            elif not (got == 1000 + (self.rank + 1) % self.size).all():
                error = "process_vm_readv read other bytes than the neighbour holds"
        except (OSError, AttributeError) as exc:
            error = f"process_vm_readv: {exc}"
        # (also keeps `mine` alive until every rank has read)
        failures = [f for f in self.comm.allgather((self.global_rank, neighbour, error, self.peer_reads))
                    if f[2]]
        if failures:
            rank, peer, error, yama = failures[0]
            self.single_copy_off = (f"rank {rank} cannot read rank {peer}'s memory "
                                    f"({error}; Yama: {yama})")
        return not failures

    def _open(self, native, slot_bytes: int, nsets: int):
        """Create (local rank 0) or attach to the node's segment; collective over local_comm."""
        comm, seg, error = self.comm, None, None
        if self.rank == 0:
            try:
                seg = native.ShmComm.create(self.size, self.global_rank, slot_bytes, nsets)
            except Exception as exc:  # e.g. /dev/shm full: every rank must hear of it
                error = f"rank {self.global_rank} could not create the shm segment: {exc}"
        name = comm.bcast(seg.name if seg is not None else error, root=0)
        if self.rank != 0 and error is None and name.startswith("/"):
            try:
                seg = native.ShmComm.attach(name, self.size, self.rank, self.global_rank)
            except Exception as exc:
                error = f"rank {self.global_rank} could not attach shm segment {name}: {exc}"
        if seg is not None:
            seg.register_rank()  # the last rank to count itself in unlinks the name
        errors = [e for e in comm.allgather(error) if e]
        if not name.startswith("/"):
            errors.insert(0, name)
        comm.Barrier()
        if seg is not None:
            seg.unlink()  # normally gone already; this covers a rank that failed to attach
        if errors:
            if seg is not None:
                seg.close()
            raise TransportError("; ".join(errors))
        return seg

    def _call(self, method: str, *args):
        """The native method's answer; its failures (aborts, timeouts, dead peers) as TransportError."""
        if self._native is None:
            raise TransportError(f"the shm transport on rank {self.global_rank} is closed")
        try:
            return getattr(self._native, method)(*args, self.timeout_s, self.should_stop)
        except RuntimeError as exc:
            if isinstance(exc, TransportError):
                raise
            raise TransportError(str(exc)) from None

    # -- the Transport interface -----------------------------------------------------------
    def allreduce(self, buf: np.ndarray, op) -> None:
        _contiguous(buf, "allreduce", writeable=True)
        self._call("allreduce", buf, buf.size, dtype_code(buf.dtype), op_code(op))

    def allreduce_into(self, src: np.ndarray, dst: np.ndarray, op, factor: float = 1.0) -> None:
        """Reduce `src` into `dst` (the same array for in place), then dst *= factor.

        One native call: no copy of the input into the output first, and the scaling of
        float32/float64 results done there too (factor must be 1 for other dtypes).
        """
        _contiguous(src, "allreduce (input)")
        _contiguous(dst, "allreduce (output)", writeable=True)
        if src.size != dst.size or src.dtype != dst.dtype:
            raise ValueError(f"allreduce input {src.dtype}[{src.size}] and output "
                             f"{dst.dtype}[{dst.size}] differ on rank {self.global_rank}")
        self._call("allreduce_into", src, dst, dst.size, dtype_code(dst.dtype), op_code(op), factor)

    def allreduce_pieces(self, srcs: Sequence[np.ndarray], dsts: Sequence[np.ndarray], op,
                         factor: float = 1.0) -> None:
        """One allreduce over several arrays of one dtype (a fused unit): srcs[i] into dsts[i].

        Small units are packed straight into the segment, with no fusion buffer of Python's;
        from NBDIST_SHM_CMA_ALLREDUCE_BYTES each rank reduces its slice of the unit straight
        from the peers' pieces (single copy, ShmComm::allreduce_cma).
        """
        dtype = dsts[0].dtype
        for src, dst in zip(srcs, dsts):
            _contiguous(src, "allreduce (input)")
            _contiguous(dst, "allreduce (output)", writeable=True)
            if src.size != dst.size or src.dtype != dtype or dst.dtype != dtype:
                raise ValueError(f"fused allreduce pieces differ in size or dtype on rank "
                                 f"{self.global_rank}")
        self._call("allreduce_pieces", list(srcs), list(dsts), [a.size for a in dsts],
                   dtype_code(dtype), op_code(op), factor)

    def reduce(self, buf: np.ndarray, op, root: int) -> None:
        """Reduce into `root`'s buf (the hierarchical path's first step); others' buf is kept."""
        _contiguous(buf, "reduce", writeable=True)
        self._call("reduce", buf, buf.size, dtype_code(buf.dtype), op_code(op), int(root))

    def allgatherv(self, send: np.ndarray, recv: np.ndarray, counts: Sequence[int]) -> None:
        _contiguous(send, "allgather (send)")
        _contiguous(recv, "allgather (receive)", writeable=True)
        item = recv.dtype.itemsize
        counts = [int(c) for c in counts]
        if len(counts) != self.size or sum(counts) != recv.size or send.size != counts[self.rank]:
            raise ValueError(f"allgather counts {counts} do not match the buffers "
                             f"(send {send.size}, receive {recv.size}) on rank {self.global_rank}")
        self._call("allgatherv", send, recv, [c * item for c in counts])

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        _contiguous(buf, "broadcast", writeable=True)
        self._call("broadcast", buf, buf.nbytes, int(root))

    def alltoallv(self, send: np.ndarray, send_counts: Sequence[int],
                  recv: np.ndarray, recv_counts: Sequence[int]) -> None:
        _contiguous(send, "alltoall (send)")
        _contiguous(recv, "alltoall (receive)", writeable=True)
        item = send.dtype.itemsize
        sc, rc = [int(c) for c in send_counts], [int(c) for c in recv_counts]
        if sum(sc) != send.size or sum(rc) != recv.size:
            raise ValueError(f"alltoall counts do not match the buffers on rank {self.global_rank}")
        self._call("alltoallv", send, [c * item for c in sc], recv,
                   [c * item for c in rc])

    def reducescatter(self, send: np.ndarray, recv: np.ndarray,
                      counts: Sequence[int], op) -> None:
        _contiguous(send, "reducescatter (send)")
        _contiguous(recv, "reducescatter (receive)", writeable=True)
        counts = [int(c) for c in counts]
        if sum(counts) != send.size or recv.size != counts[self.rank]:
            raise ValueError(f"reducescatter counts {counts} do not match the buffers "
                             f"(send {send.size}, receive {recv.size}) on rank {self.global_rank}")
        self._call("reducescatter", send, recv, counts,
                   dtype_code(send.dtype), op_code(op))

    def barrier(self) -> None:
        self._call("barrier")

    def agree(self, payload_bytes: int, bits: list[int], nbits: int) -> tuple[list[int], list[int]]:
        """The shm agreement's vote (agreement.py): (every rank's payload bytes, the bits
        that every rank set), sorted; one Min-allreduce built and read in C++."""
        return self._call("agree", payload_bytes, bits, nbits)

    def agree_allreduce(self, bit: int, nbits: int, data: "ShmTransport", src: np.ndarray,
                        dst: np.ndarray, op, factor: float):
        """agree() with this rank's one cached allreduce as its only bit: when the vote finds
        it ready everywhere and no rank with items, `data` runs it (allreduce_into) in the
        same native call and this returns None; else agree()'s answer."""
        return self._call("agree_allreduce", bit, nbits, self._native_of(data), src, dst,
                          dst.size, dtype_code(dst.dtype), op_code(op), factor)

    def express_allreduce(self, bit: int, nbits: int, wait_s: float, data: "ShmTransport",
                          src: np.ndarray, dst: np.ndarray, dtype: int, op: int, factor: float):
        """agree_allreduce once every peer has ops queued (waiting up to wait_s for that),
        with the dtype and op as native codes (the caller worked them out once): False when
        the peers did not come (this rank's queued word says 1), else agree_allreduce's."""
        return self._call("express_allreduce", bit, nbits, wait_s, self._native_of(data), src,
                          dst, dst.size, dtype, op, factor)

    def express_allgather(self, bit: int, nbits: int, wait_s: float, data: "ShmTransport",
                          send: np.ndarray, recv: np.ndarray, byte_counts: list[int]):
        """express_allreduce's path for one cached allgatherv (bytes from each rank)."""
        return self._call("express_allgather", bit, nbits, wait_s, self._native_of(data), send,
                          recv, byte_counts)

    def express_broadcast(self, bit: int, nbits: int, wait_s: float, data: "ShmTransport",
                          buf: np.ndarray, nbytes: int, root: int):
        """express_allreduce's path for one cached broadcast of `buf` from `root`."""
        return self._call("express_broadcast", bit, nbits, wait_s, self._native_of(data), buf,
                          nbytes, root)

    def _native_of(self, data: "ShmTransport"):
        """The data transport's native comm, for a call on this (the agreement's) one."""
        if data._native is None:
            raise TransportError(f"the shm transport on rank {self.global_rank} is closed")
        return data._native

    # -- failure and recovery --------------------------------------------------------------
    def abort(self, reason: str) -> None:
        """Fail the op running on every rank of the node (callable from any thread)."""
        if self._native is not None:
            self._native.abort(f"{reason}")

    def abort_reason(self) -> str:
        """Why the segment was aborted, or '' when it was not."""
        return self._native.abort_reason() if self._native is not None else ""

    def reset(self) -> None:
        """Make the transport usable after an abort; collective over local_comm, no op running."""
        self.comm.Barrier()
        if self.rank == 0:
            self._native.clear_shared()
        self._native.reset_local()
        self.comm.Barrier()

    def close(self) -> None:
        if self._native is not None:
            self._native.close()
            self._native = None
