"""init/shutdown and the questions Horovod code asks: rank, size, local_rank, what is built."""
from __future__ import annotations

import atexit
import sys
import threading

from . import errors, timeline, world
from .config import Config, env_str
from .topology import Topology

_lock = threading.Lock()
_state: dict = {"engine": None, "topology": None, "config": None}


def _mpi():
    """mpi4py's MPI module (initialized with MPI_THREAD_MULTIPLE), or None if MPI is missing."""
    try:
        import mpi4py

        mpi4py.rc.thread_level = "multiple"
        from mpi4py import MPI
    except Exception:  # ImportError, or the MPI library failing to load
        return None
    return MPI


def init(comm=None, process_sets=None) -> None:
    """Start the runtime on this rank (a second call is harmless).

    Under mpiexec every rank calls init(); a lone process is a world of size 1.
    `comm` (an mpi4py communicator, or a list of world ranks) restricts the runtime to
    those ranks. `process_sets` registers hvd.ProcessSet objects (see process_sets.py).
    """
    _init(comm)
    if process_sets is not None:
        from . import process_sets as _ps

        _ps.init_process_sets(process_sets)


def _init(comm) -> None:
    with _lock:
        if _state["engine"] is not None:
            return
        MPI = _mpi()
        if MPI is None:
            raise errors.NbdistError("nbdist needs mpi4py and an MPI library: "
                                     "pip install 'nbdist[mpi]' (mpi4py and the mpich wheel)")
        config = Config.from_environment()
        if comm is None:
            plan = world.join_pending()  # an elastic world this process is in but has not built
            if plan is not None:
                world.rebuild(plan)
            world.remember_members()
        topology = Topology.from_mpi(comm if comm is not None else world.world_comm(),
                                     config.local_size)
        from .engine import Engine
        from .transports.select import TransportSet

        engine = Engine(topology, config,
                        lambda should_stop: TransportSet(config, topology, should_stop))
        _state.update(engine=engine, topology=topology, config=config)
        from . import ops

        ops.ASYNC_EXPRESS_BYTES = config.async_express_bytes
        if engine.agreement is not None:  # the global set's cached allreduces: native first
            engine.agreement.express_table.make_default()
        report = sys.modules.get("nbdist.rank.report")
        if report is not None:  # an elastic resize renumbers the ranks: report under the new one
            report.rank_changed(topology.rank)
        path = env_str("TIMELINE")
        if path:
            cycles = env_str("TIMELINE_MARK_CYCLES", "0") or "0"
            timeline.start(path, topology.rank, cycles.lower() not in ("0", "false", ""))


def shutdown() -> None:
    """Stop the background thread and free transports; init() may be called again."""
    with _lock:
        engine = _state["engine"]
        if engine is None:
            return
        _state["engine"] = None
        timeline.stop()
        from . import process_sets

        process_sets.shutdown_process_sets()
        engine.stop()
        _state["topology"].free()
        _state["topology"] = None


atexit.register(shutdown)


def start_timeline(file_path, mark_cycles: bool = False) -> None:
    """Write this rank's timeline of ops to `file_path` (rank r > 0: `<file_path>.rank<r>`,
    or `{rank}` in the path filled in) as a Chrome trace; see nbdist.common.timeline."""
    timeline.start(file_path, topology().rank, bool(mark_cycles))


def stop_timeline() -> None:
    """Finish the timeline file (valid JSON from then on)."""
    timeline.stop()


def is_initialized() -> bool:
    """True between init() and shutdown()."""
    return _state["engine"] is not None


def engine():
    """The running engine, or a clear error if init() was not called."""
    e = _state["engine"]
    if e is None:
        raise errors.NotInitializedError(
            "nbdist has not been initialized; call hvd.init() first")
    return e


def topology() -> Topology:
    engine()
    return _state["topology"]


def config() -> Config:
    engine()
    return _state["config"]


def rank() -> int:
    """This process's rank, 0 to size() - 1."""
    return topology().rank


def size() -> int:
    """The number of ranks."""
    return topology().size


def local_rank() -> int:
    """This process's rank among the ranks on its node."""
    return topology().local_rank


def local_size() -> int:
    """The number of ranks on this node."""
    return topology().local_size


def cross_rank() -> int:
    """The index of this rank's node (among ranks with the same local rank)."""
    return topology().cross_rank


def cross_size() -> int:
    """The number of nodes (ranks with this local rank)."""
    return topology().cross_size


def mpi_built() -> bool:
    """True when mpi4py and an MPI library are available."""
    return _mpi() is not None


def mpi_enabled() -> bool:
    """True when collectives run over MPI (always, in nbdist)."""
    return mpi_built()


def mpi_threads_supported() -> bool:
    """True when MPI runs with MPI_THREAD_MULTIPLE."""
    MPI = _mpi()
    if MPI is None:
        return False
    if not MPI.Is_initialized():
        raise errors.NotInitializedError("call hvd.init() before mpi_threads_supported()")
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def _native():
    try:
        from .. import _native
    except ImportError:
        return None
    return _native


def nccl_built() -> bool:
    """True when the native module can load libnccl on this machine."""
    native = _native()
    try:
        return bool(native is not None and native.nccl_built())
    except Exception:
        return False


def cuda_built() -> bool:
    """True when the GPU (NCCL) path can run here."""
    return nccl_built()


def gpu_available(ext_base_name: str, verbose: bool = False) -> bool:
    """Horovod's gpu_available('torch' | 'tensorflow'): whether that framework sees a GPU here.

    False for a framework that is not installed (or a name nbdist has no binding for), as
    in Horovod, so a GPU test can skip on it.
    """
    try:
        if ext_base_name == "torch":
            import torch

            return bool(torch.cuda.is_available())
        if ext_base_name == "tensorflow":
            import tensorflow as tf

            return bool(tf.config.list_physical_devices("GPU"))
    except ImportError:
        if verbose:
            print(f"nbdist: {ext_base_name} is not installed")
    return False


def gloo_built() -> bool:
    """nbdist has no gloo controller; MPI is its controller."""
    return False


def gloo_enabled() -> bool:
    return False


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def rocm_built() -> bool:
    return False
