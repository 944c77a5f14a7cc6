"""`nbdist doctor`: what this machine has (native module, NCCL, MPI, GPUs, frameworks)
and which transport each op would use. Run it alone, or under `mpiexec -n N nbdist doctor`
to see the choice for that many ranks (rank 0 prints; every rank's choice is checked).
"""
from __future__ import annotations

import importlib.metadata
import platform
import sys

FRAMEWORKS = ("numpy", "ml_dtypes", "mpi4py", "mpich", "torch", "tensorflow", "cupy-cuda12x",
              "cupy-cuda13x", "jax", "ipyparallel", "nvidia-nccl-cu12", "nvidia-nccl-cu13",
              "nvidia-cuda-runtime-cu12", "nvidia-cuda-runtime")  # the last: CUDA 13's name


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def native_report() -> list[str]:
    """What nbdist._native was built with."""
    try:
        from nbdist import _native
    except ImportError as exc:
        return [f"native module    not built ({exc}); CPU ops use MPI only"]
    lines = [f"native module    {_native.__file__}",
             f"  shm collectives {'built' if _native.shm_built() else 'not built'}"
             f" (reduction kernels: {_native.kernel_isa()})"]
    from nbdist.common.transports.nccl import load_nccl

    reason = load_nccl()
    if _native.nccl_built():
        code = _native.nccl_version()  # NCCL_VERSION_CODE: 2.29.7 is 22907 (1000s before 2.9)
        version = (f"{code // 10000}.{code // 100 % 100}.{code % 100}" if code >= 20900
                   else f"{code // 1000}.{code // 100 % 10}.{code % 100}")
        lines.append(f"  NCCL            loaded (version {version}); {reason or 'usable'}")
    else:
        lines.append(f"  NCCL            not usable here: {reason}")
    return lines


def gpu_report() -> list[str]:
    lines = []
    try:
        from nbdist import _native

        lines.append(f"GPUs (CUDA runtime) {_native.cuda_device_count()}")
    except ImportError:
        pass
    if _version("torch"):
        try:
            import torch

            count = torch.cuda.device_count()
            names = [torch.cuda.get_device_name(i) for i in range(count)]
            lines.append(f"GPUs (torch)     {count} {names if names else ''}".rstrip())
        except Exception as exc:  # a broken CUDA install should not break the doctor
            lines.append(f"GPUs (torch)     error: {exc}")
    return lines


def _thread_level_names(MPI) -> dict:
    return {MPI.THREAD_MULTIPLE: "multiple", MPI.THREAD_SERIALIZED: "serialized",
            MPI.THREAD_FUNNELED: "funneled", MPI.THREAD_SINGLE: "single"}


def main() -> int:
    """Print the report; 0 when it ran, 1 when MPI is missing."""
    from nbdist import __version__
    from nbdist.common.basics import _mpi

    MPI = _mpi()
    rank = MPI.COMM_WORLD.rank if MPI is not None else 0
    out = []
    if rank == 0:
        out += [f"nbdist {__version__} on Python {platform.python_version()} ({sys.executable})",
                f"machine          {platform.node()} {platform.machine()}, {platform.platform()}"]
        out += native_report()
        if MPI is None:
            out.append("MPI              not available: pip install 'nbdist[mpi]'")
        else:
            library = MPI.Get_library_version().strip().splitlines()[0]
            out.append(f"MPI              {library} (mpi4py {_version('mpi4py')}, thread level "
                       f"{ _thread_level_names(MPI).get(MPI.Query_thread(), '?') })")
        out += gpu_report()
        installed = [f"{d} {_version(d)}" for d in FRAMEWORKS if _version(d)]
        out.append("installed        " + ", ".join(installed))
    if MPI is None:
        print("\n".join(out))
        return 1
    out += transport_report(MPI)
    if rank == 0:
        print("\n".join(out), flush=True)
    return 0


def _bytes(n: int) -> str:
    """A single-copy threshold as people read it (0: never single copy)."""
    from nbdist.common.sizes import format_bytes

    return "never" if n == 0 else format_bytes(n)


def transport_report(MPI) -> list[str]:
    """Which transport each op would use with this many ranks (collective over COMM_WORLD)."""
    from nbdist.common.config import Config
    from nbdist.common.topology import Topology
    from nbdist.common.transports.select import KINDS, TransportSet

    comm = MPI.COMM_WORLD
    config = Config.from_environment()
    topology = Topology.from_mpi(comm, config.local_size)
    try:
        transports = TransportSet(config, topology, lambda: None)
        choice = transports.describe()
        transports.close()
    finally:
        topology.free()
    choices = comm.gather(choice, root=0)
    leaders = comm.gather(topology.local_rank == 0, root=0)
    if comm.rank != 0:
        return []
    pretend = f", pretend nodes: NBDIST_LOCAL_SIZE={config.local_size}" if config.local_size else ""
    lines = [f"options          {config.describe()}",
             f"ranks            {comm.size} (local size {topology.local_size}, "
             f"nodes {sum(leaders)}{pretend})",
             f"CPU transport    mode {choice['cpu_mode']}"]
    for kind in KINDS:
        lines.append(f"  {kind:<14} {choice['cpu'][kind]}")
    single = choice["single_copy"]
    if single["bytes"] is not None:
        if any(single["bytes"]):
            state = "on (CMA) from {} broadcast, {} allgather, {} allreduce".format(*map(_bytes, single["bytes"]))
            if single["tuned"]:
                state += (f"; from {_bytes(256 * 1024)} {', '.join(single['tuned'])} take the path "
                          "measured faster")
            state += f"; Yama: {single['peer_reads']}"
        else:  # the probe's reason names Yama's answer too
            state = (f"off ({single['off'] or 'NBDIST_SHM_CMA_*_BYTES=0'}): the shm transport copies "
                     "through its slots")
        lines.append("  single copy    " + state)
    lines.append(f"GPU transport    {choice['gpu']}")
    if any(c != choice for c in choices):
        lines.append("WARNING          ranks disagree on transports: " + repr(choices))
    if comm.size == 1:
        lines.append("(one rank: every op is local; run `mpiexec -n 4 nbdist doctor` to see the "
                     "choice for 4 ranks)")
    return lines
