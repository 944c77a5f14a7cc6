"""A script (not a pytest file): the last rank SIGKILLs itself in the middle of allreduces.

Run by tests/test_native.py under `mpiexec -disable-auto-cleanup`, each rank behind a
shell. When a rank dies, MPICH's hydra proxy still signals the *process group* of each
of its children (`kill(-pgid, SIGUSR1)`, then `kill(-pgid, SIGKILL)`; seen with strace),
and a shell's child is in the shell's group, so the shell alone does not shield the
rank: whether a survivor wrote its result before that SIGKILL was a race (the test
failed about one run in two). So each rank first moves to a session (and process
group) of its own, before MPI starts: hydra's signals then reach only the shells, the
ranks live on, and each must leave its wait within a second, naming the dead rank.
Results and per-rank diagnostics go to files in $NBDIST_SIGKILL_DIR (mpiexec's output
pipes may be gone by then): started.R, pid.R, released.R, error.R, stack.R (a Python
stack dump on SIGUSR2, which the test sends to a rank that is still running).

NBDIST_SIGKILL_PATH=api runs the user's path instead of the transport alone: a named
4 KiB hvd.allreduce_ repeated, which the engine runs in the calling thread's one native
call (the express table); the survivors must fail it naming the dead rank too.
api-allgather and api-broadcast: the same with hvd.allgather and hvd.broadcast_; api-fused:
four allreduce_async_ then synchronize (one fused unit through the engine's cycle);
api-async: a small async allreduce_, allgather and broadcast_ then synchronize (each runs
as it is submitted when every rank is there, else waits as a queued op).
A "-midop" suffix (api-allgather-midop, ...): the last rank dies *inside* a 16 MiB op (a
timer thread kills it 2 ms into its call, while the bytes move), so the survivors' one
native call itself fails (a case that once came back as a pybind11 cast error, the real
one lost, the agreement's lock held).
"""
import faulthandler
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

OUT = Path(os.environ["NBDIST_SIGKILL_DIR"])
os.setsid()  # out of the shell's process group: hydra's kill(-pgid, ...) misses us
signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # MPICH's "a peer died" notice
_pre = f"pid {os.getpid()} sid {os.getsid(0)} pgid {os.getpgrp()} ppid {os.getppid()}"

import numpy as np  # noqa: E402
import psutil  # noqa: E402
from mpi4py import MPI  # noqa: E402

from nbdist.common.ops_base import ReduceOp  # noqa: E402
from nbdist.common.transport import TransportError  # noqa: E402
from nbdist.common.transports.shm import ShmTransport  # noqa: E402

signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # again, in case MPI_Init installed a handler
COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size


def record(name: str, text: str) -> None:
    tmp = OUT / (name + ".tmp")
    tmp.write_text(text)
    tmp.rename(OUT / name)  # atomic: the test never reads half a file


record(f"started.{RANK}", _pre)
record(f"pid.{RANK}", str(os.getpid()))
_stack = open(OUT / f"stack.{RANK}", "w")
faulthandler.register(signal.SIGUSR2, file=_stack, all_threads=True)

def die() -> None:
    record("killed", f"{time.monotonic():.6f}")
    os.kill(os.getpid(), signal.SIGKILL)


def transport_path():
    """The shm transport's allreduce of 4 MiB, its failure, its segments."""
    t = ShmTransport(COMM, RANK, timeout_s=30)
    buf = np.ones(1 << 20, np.float32)

    def step():
        t.allreduce(buf, ReduceOp.Sum)
        buf[:] = 1

    return step, TransportError, [t._native.name]


def api_path(kind: str, midop: bool):
    """The user's path: a cached synchronous allreduce, allgather or broadcast (the express
    table), or four async allreduces (fused)."""
    import nbdist.common as hvd

    hvd.init()
    engine = hvd.basics.engine()
    buf = np.ones(4 << 20 if midop else 1024, np.float32)
    parts = np.split(buf, 4)

    def fused():  # async ops, one fused unit run by the engine's cycle and executor
        handles = [hvd.allreduce_async_(p, op=hvd.Sum, name=f"sigkill.f{i}")
                   for i, p in enumerate(parts)]
        for h in handles:
            hvd.synchronize(h)

    def small_async():  # small async ops of cached names: each runs as it is submitted
        handles = [hvd.allreduce_async_(parts[0], op=hvd.Sum, name="sigkill.a"),
                   hvd.allgather_async(parts[1], name="sigkill.ag"),
                   hvd.broadcast_async_(parts[2], 0, name="sigkill.ab")]
        for h in handles:
            hvd.synchronize(h)

    calls = {
        "fused": fused,
        "async": small_async,
        "allreduce": lambda: hvd.allreduce_(buf, op=hvd.Sum, name="sigkill.x"),
        "allgather": lambda: hvd.allgather(buf, name="sigkill.g"),
        "broadcast": lambda: hvd.broadcast_(buf, 0, name="sigkill.b"),
    }
    call = calls[kind]

    def step():
        call()
        buf[:] = 1

    segments = [engine.agreement.seg._native.name,
                engine.transports.for_op("cpu", "allreduce")._native.name]
    return step, hvd.NbdistError, segments


try:
    PATH = os.environ.get("NBDIST_SIGKILL_PATH", "transport")
    MIDOP = PATH.endswith("-midop")
    KIND = PATH.removesuffix("-midop").partition("-")[2] or "allreduce"
    step, failure, segments = (transport_path() if PATH == "transport"
                               else api_path(KIND, MIDOP))
    if RANK == 0:
        record("segment", "\n".join(segments))
    COMM.Barrier()
    if RANK == 0:  # MPICH's own segments too: no rank finalizes, so the test removes them
        from nbdist.mpi.reaper import segments_of

        record("mapped", "\n".join(sorted(segments_of([psutil.Process()]))))
    for i in range(1_000_000):
        if RANK == SIZE - 1 and i == 20:
            if MIDOP:  # from a thread, while this rank is inside its op
                threading.Timer(0.002, die).start()
            else:
                die()
        try:
            step()
        except failure as exc:
            record(f"released.{RANK}", f"{time.monotonic():.6f} {exc}")
            os._exit(0)  # MPI cannot finalize with a dead peer
    record(f"error.{RANK}", "finished every allreduce: the dead rank was never noticed")
except BaseException:
    record(f"error.{RANK}", f"{time.monotonic():.6f} {traceback.format_exc()}")
sys.stdout.flush()
os._exit(1)
