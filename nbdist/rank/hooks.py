"""Engine-side half of the notebook: runs inside each ipyparallel engine (one MPI rank).

`setup()` is executed once on every engine right after the cluster starts. It
  - makes a rank whose cell raises release its peers: the runtime's `abort`
    fails every in-flight collective on every rank, so nobody waits for ever;
  - exits the engine when the notebook kernel is gone (engines never outlive it);
  - dumps a Python traceback on a fatal signal (faulthandler), so a segfault
    leaves a clue in the engine log;
  - reports rank, host, pid and GPUs for %dist_status.
"""
from __future__ import annotations

import faulthandler
import os
import socket
import sys
import threading
import time

from .. import failure
from ..mpi.ranks import env_local_rank
from ..mpi.segment_keeper import start_if_remote

_KERNEL_WATCH_S = 1.0
_state: dict = {"rank": None}


def _mpi_rank_size() -> tuple[int, int]:
    from ..common.world import world_comm  # COMM_WORLD, or an elastic run's current world

    comm = world_comm()
    return comm.Get_rank(), comm.Get_size()


def _on_cell_error(shell, etype, value, tb, tb_offset=None):
    """IPython custom exception handler: show the traceback, then release the peers via abort.

    The traceback goes first: it reaches the notebook at once (the error message on
    IOPub tells the notebook this rank is finishing, not stuck), and IPython's run_code
    calls a custom handler *instead of* showing the traceback, so nobody else would.
    This handler must never raise: IPython unregisters a handler that fails.
    """
    try:
        if issubclass(etype, SyntaxError):
            shell.showsyntaxerror()
        else:
            shell.showtraceback((etype, value, tb), tb_offset=tb_offset)
    except BaseException:
        pass
    try:
        failure.abort_peers(_state["rank"], value if isinstance(value, BaseException) else etype())
    except BaseException:
        pass
    return None


def _watch_kernel(kernel_pid: int) -> None:
    """Exit this engine as soon as the notebook kernel's process is gone."""
    while True:
        time.sleep(_KERNEL_WATCH_S)
        try:
            os.kill(kernel_pid, 0)
        except ProcessLookupError:
            os._exit(3)
        except PermissionError:
            pass  # exists, owned by someone else: can't be our kernel's pid reused by us


def _gpu_count() -> int:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    try:
        return len([d for d in os.listdir("/dev") if d.startswith("nvidia") and d[6:].isdigit()])
    except OSError:
        return 0


def setup(kernel_pid: int | None, kernel_host: str) -> dict:
    """Install the engine hooks once; return this rank's description."""
    rank, size = _mpi_rank_size()
    _state["rank"] = rank
    if not _state.get("installed"):
        _state["installed"] = True
        from IPython import get_ipython

        shell = get_ipython()
        if shell is not None:
            shell.set_custom_exc((BaseException,), _on_cell_error)
        try:
            faulthandler.enable(file=sys.__stderr__)  # type: ignore[arg-type]
        except Exception:
            pass
        start_if_remote(kernel_host)  # the kernel's sweep of /dev/shm cannot reach another host
        if kernel_pid and socket.gethostname() == kernel_host:
            threading.Thread(target=_watch_kernel, args=(kernel_pid,), name="nbdist-kernel-watch",
                             daemon=True).start()
    return describe()


def hold_death_pipe(paths_by_pid: dict[int, str]) -> bool:
    """Hold this process's FIFO of the notebook's death watch open for writing until it ends.

    A dying process closes its files before anything else sees it go (see nbdist.mpi.deaths):
    the watch learns which rank went first from the order the FIFOs close. Forked children
    (DataLoader workers) drop their copy, so that it closes with this process alone.
    """
    _drop_death_pipe()  # a watch of an earlier world
    path = paths_by_pid.get(os.getpid())
    if path is None:
        return False
    try:
        _state["death_pipe"] = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False  # the watch still sees this process's exit
    if not _state.get("fork_hook"):
        _state["fork_hook"] = True
        os.register_at_fork(after_in_child=_drop_death_pipe)
    return True


def _drop_death_pipe() -> None:
    fd = _state.pop("death_pipe", None)
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass


def describe() -> dict:
    """This rank's rank, host, pid, GPUs and runtime state."""
    rank, size = _mpi_rank_size()
    common = sys.modules.get("nbdist.common")
    initialized = False
    transports = ""
    if common is not None:
        try:
            initialized = bool(common.is_initialized())
        except Exception:
            initialized = False
        if initialized:
            transports = _transports_in_use(common)
    return {
        "rank": rank, "size": size, "host": socket.gethostname(), "pid": os.getpid(),
        "local_rank": env_local_rank(), "gpus": _gpu_count(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "runtime": "initialized" if initialized else "not initialized", "transports": transports,
    }


def _transports_in_use(common) -> str:
    """What the runtime's transport set picked for each op, e.g. 'cpu: shm; gpu: nccl'.

    The Horovod-style flags (mpi_enabled, nccl_built) say what is built, not what the
    ops use: with the shared-memory transport on one node, MPI only carries control.
    """
    try:
        desc = common.basics.engine().transports.describe()
    except Exception as exc:  # an older or broken runtime: say so rather than guess
        return f"unknown ({type(exc).__name__})"
    by_transport: dict[str, list[str]] = {}
    for kind, name in (desc.get("cpu") or {}).items():
        by_transport.setdefault(name, []).append(kind)
    if len(by_transport) == 1:
        cpu = next(iter(by_transport))
    else:
        cpu = ", ".join(f"{name} ({'/'.join(kinds)})" for name, kinds in by_transport.items())
    gpu = desc.get("gpu") or ""
    gpu = "none" if gpu.startswith("unavailable") else gpu
    return f"cpu: {cpu or '?'}; gpu: {gpu or 'none'}"


def pin_gpu() -> str:
    """--gpus: give this rank one GPU (its local rank), before any framework touches CUDA."""
    count = _gpu_count()
    if count == 0:
        raise RuntimeError(f"rank {_state['rank']}: --gpus asked for a GPU but none is visible on "
                           f"{socket.gethostname()}")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = [d.strip() for d in visible.split(",")] if visible else [str(i) for i in range(count)]
    chosen = devices[env_local_rank() % len(devices)]
    os.environ["CUDA_VISIBLE_DEVICES"] = chosen
    return chosen
