"""The NCCL transport for GPU buffers (torch CUDA tensors, CuPy arrays, __cuda_array_interface__).

libnccl and the CUDA runtime are opened by nbdist._native with dlopen: the copies a
framework (torch, CuPy) has loaded already, else the nvidia-nccl-cu12/-cu13 and CUDA
runtime wheels when they are installed, else the system's library path. The communicator is created at the first GPU op
(every rank runs the same ops in the same order), with rank 0's unique id sent
over MPI. Ops are enqueued on the framework's current stream and waited for.

Not yet run on real GPU hardware in CI: tests/test_gpu_nccl.py covers it where a
GPU exists.
"""
from __future__ import annotations

import glob
import os
import socket
import sys
from dataclasses import dataclass
from typing import Callable, Sequence

from ..ops_base import ReduceOp
from ..transport import Transport, TransportError
from ._dtypes import CODES, op_code


def _wheel_lib_dirs(package: str) -> list[str]:
    """lib/ folders of an nvidia-* wheel (site-packages/nvidia/<package>/lib)."""
    dirs = []
    for entry in sys.path:
        d = os.path.join(entry or ".", "nvidia", package, "lib")
        if os.path.isdir(d):
            dirs.append(d)
    return dirs


def _already_loaded(stem: str) -> list[str]:
    """Paths of libraries named stem* that this process has mapped already (e.g. by torch)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/" + stem in line}
    except OSError:
        return []
    return sorted(p for p in paths if os.path.basename(p).startswith(stem))


def library_candidates() -> tuple[list[str], list[str]]:
    """Paths to try for libnccl and libcudart: NBDIST_NCCL_LIB, the copies a framework has
    loaded already (one CUDA runtime per process), the wheels, then the system."""
    from ..config import env_path

    nccl = [p for p in [env_path("NCCL_LIB")] if p]
    cudart = [p for p in [env_path("CUDART_LIB")] if p]
    nccl += _already_loaded("libnccl.so")
    cudart += _already_loaded("libcudart.so")
    # CUDA 12 wheels: nvidia/{nccl,cuda_runtime}/lib; CUDA 13 wheels: nvidia/cu13/lib.
    for d in _wheel_lib_dirs("nccl") + _wheel_lib_dirs("cu13") + _wheel_lib_dirs("cu12"):
        nccl += sorted(glob.glob(os.path.join(d, "libnccl.so*")))
    for d in _wheel_lib_dirs("cuda_runtime") + _wheel_lib_dirs("cu13") + _wheel_lib_dirs("cu12"):
        cudart += sorted(glob.glob(os.path.join(d, "libcudart.so*")))
    nccl += ["libnccl.so.2", "libnccl.so"]
    cudart += ["libcudart.so.12", "libcudart.so.13", "libcudart.so.11.0", "libcudart.so"]
    return nccl, cudart


_load_result: str | None = None


def load_nccl() -> str:
    """Open NCCL once per process: '' when it works here, else the reason it does not."""
    global _load_result
    if _load_result is None:
        try:
            from nbdist import _native
        except ImportError as exc:
            _load_result = f"the native module is not built ({exc})"
        else:
            if not hasattr(_native, "nccl_load"):
                _load_result = "the native module was built without the NCCL path"
            else:
                _load_result = _native.nccl_load(*library_candidates())
                if not _load_result and _native.cuda_device_count() == 0:
                    _load_result = "NCCL loaded, but no CUDA device is visible"
    return _load_result


@dataclass
class DeviceBuffer:
    """What NCCL needs to know of a GPU array."""

    address: int
    count: int
    dtype: int
    device: int
    stream: int


_TORCH_DTYPES = {"float16": "float16", "bfloat16": "bfloat16", "float32": "float32",
                 "float64": "float64", "int8": "int8", "uint8": "uint8", "int32": "int32",
                 "int64": "int64"}
_TYPESTR = {"f2": "float16", "f4": "float32", "f8": "float64", "i1": "int8", "u1": "uint8",
            "i4": "int32", "u4": "uint32", "i8": "int64", "u8": "uint64"}


def describe(buf) -> DeviceBuffer:
    """Address, size, dtype, device and current stream of a torch/CuPy/CAI GPU array."""
    mod = type(buf).__module__.split(".")[0]
    if mod == "torch":
        import torch

        if not buf.is_cuda:
            raise TypeError("the NCCL transport takes GPU tensors")
        if not buf.is_contiguous():
            raise ValueError("the NCCL transport needs a contiguous tensor")
        name = str(buf.dtype).replace("torch.", "")
        if name not in _TORCH_DTYPES:
            raise TypeError(f"NCCL cannot move torch.{name} tensors")
        stream = torch.cuda.current_stream(buf.device).cuda_stream
        return DeviceBuffer(buf.data_ptr(), buf.numel(), CODES[_TORCH_DTYPES[name]],
                            buf.device.index, int(stream))
    cai = getattr(buf, "__cuda_array_interface__", None)
    if cai is None:
        raise TypeError(f"{type(buf).__name__} is not a GPU array (no __cuda_array_interface__)")
    if cai.get("strides") is not None:
        import math

        itemsize = int(cai["typestr"][2:])
        expected: list[int] = []
        step = itemsize
        for dim in reversed(cai["shape"]):
            expected.insert(0, step)
            step *= dim
        if tuple(cai["strides"]) != tuple(expected) and math.prod(cai["shape"]) > 1:
            raise ValueError("the NCCL transport needs a C-contiguous GPU array")
    kind = cai["typestr"][1:]
    if kind not in _TYPESTR:
        raise TypeError(f"NCCL cannot move arrays of type {cai['typestr']}")
    count = 1
    for dim in cai["shape"]:
        count *= dim
    address = int(cai["data"][0])
    from nbdist import _native

    device = _native.cuda_pointer_device(address) if address else 0
    if mod == "cupy":
        import cupy

        stream = cupy.cuda.get_current_stream().ptr
    else:
        # CAI v3: None means "no synchronisation needed"; 1 and 2 are CUDA's legacy
        # and per-thread default streams, which are also their handle values.
        stream = cai.get("stream") or 0
    return DeviceBuffer(address, count, CODES[_TYPESTR[kind]], device, int(stream))


def shared_gpu_error(gpus: Sequence[tuple[str, str]], rank: int) -> str:
    """'' when every rank has its own GPU, else why NCCL cannot run (the same text on every rank).

    `gpus[r]` is rank r's (host, PCI bus id). NCCL refuses two ranks on one device
    ("Duplicate GPU detected", reported as a bare "invalid usage"); nbdist says so
    first, naming the ranks, rather than staging through host memory behind the
    user's back (a silent copy would hide a 10-100x slowdown).
    """
    by_gpu: dict[tuple[str, str], list[int]] = {}
    for r, gpu in enumerate(gpus):
        by_gpu.setdefault(tuple(gpu), []).append(r)  # type: ignore[arg-type]
    shared = [(gpu, ranks) for gpu, ranks in by_gpu.items() if len(ranks) > 1]
    if not shared:
        return ""
    (host, bus), ranks = shared[0]
    names = ", ".join(str(r) for r in ranks[:-1]) + f" and {ranks[-1]}"
    return (f"rank {rank}: ranks {names} {'both' if len(ranks) == 2 else 'all'} use GPU {bus} on {host}, "
            "and NCCL allows only one "
            "rank per GPU (it refuses with 'Duplicate GPU detected'). Give each rank its own "
            "GPU: start at most as many ranks per node as it has GPUs, with "
            "`%%distributed --gpus` or torch.cuda.set_device(hvd.local_rank()); or keep these "
            "tensors on the CPU, where ranks sharing a node use shared memory.")


class NCCLTransport(Transport):
    """Collectives on GPU buffers through one NCCL communicator over all ranks."""

    name = "nccl"

    def __init__(self, comm, timeout_s: float = 0.0,
                 should_stop: Callable[[], str | None] | None = None):
        reason = load_nccl()
        if reason:
            raise RuntimeError(f"the NCCL transport is not available: {reason}")
        self.comm = comm  # MPI, only to send rank 0's unique id
        self.timeout_s = timeout_s
        self.should_stop = should_stop
        self._nccl = None

    def _communicator(self, device: int):
        """The NCCL communicator, created at the first op (collective: every rank is here)."""
        from nbdist import _native

        if self._nccl is None:
            gpus = self.comm.allgather((socket.gethostname(), _native.cuda_pci_bus_id(device)))
            shared = shared_gpu_error(gpus, self.comm.rank)
            if shared:
                raise TransportError(shared)
            uid = _native.nccl_unique_id() if self.comm.rank == 0 else None
            uid = self.comm.bcast(uid, root=0)
            self._nccl = _native.NcclComm(uid, self.comm.size, self.comm.rank, device)
        elif self._nccl.device != device:
            raise ValueError(f"rank {self.comm.rank}: NCCL is bound to cuda:{self._nccl.device}, "
                             f"but this buffer is on cuda:{device}; keep each rank on one GPU")
        return self._nccl

    def _run(self, method: str, device: int, *args) -> None:
        comm = self._communicator(device)
        try:
            getattr(comm, method)(*args, self.timeout_s, self.should_stop)
        except RuntimeError as exc:
            self._nccl = None  # an aborted communicator cannot be reused
            raise TransportError(f"rank {self.comm.rank}: {exc}") from None

    def allreduce(self, buf, op: ReduceOp) -> None:
        b = describe(buf)
        if b.count:
            self._run("allreduce", b.device, b.address, b.address, b.count, b.dtype, op_code(op), b.stream)

    def broadcast(self, buf, root: int) -> None:
        b = describe(buf)
        if b.count:
            self._run("broadcast", b.device, b.address, b.count, b.dtype, int(root), b.stream)

    def allgatherv(self, send, recv, counts: Sequence[int]) -> None:
        s, r = describe(send), describe(recv)
        self._run("allgatherv", r.device, s.address, r.address, [int(c) for c in counts], r.dtype, r.stream)

    def reducescatter(self, send, recv, counts: Sequence[int], op: ReduceOp) -> None:
        s, r = describe(send), describe(recv)
        self._run("reducescatter", s.device, s.address, r.address, [int(c) for c in counts],
                  s.dtype, op_code(op), s.stream)

    def alltoallv(self, send, send_counts: Sequence[int], recv, recv_counts: Sequence[int]) -> None:
        s, r = describe(send), describe(recv)
        self._run("alltoallv", s.device, s.address, [int(c) for c in send_counts], r.address,
                  [int(c) for c in recv_counts], s.dtype, s.stream)

    def abort(self, reason: str) -> None:
        if self._nccl is not None:
            self._nccl.abort(reason)

    def close(self) -> None:
        if self._nccl is not None:
            self._nccl.close()
            self._nccl = None
