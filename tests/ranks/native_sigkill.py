"""A script (not a pytest file): the last rank SIGKILLs itself in the middle of allreduces.

Run by tests/test_native.py under `mpiexec -disable-auto-cleanup`, each rank behind a
shell, because mpiexec still signals its direct children when one dies (SIGUSR1 or
SIGKILL, racing nbdist's own detection); the ranks behind the shells live on, and
each must leave its wait within a second, naming the dead rank. Results go to files
in $NBDIST_SIGKILL_DIR (mpiexec's output pipes may be gone by then).
"""
import os
import signal
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

from nbdist.common.ops_base import ReduceOp
from nbdist.common.transport import TransportError
from nbdist.common.transports.shm import ShmTransport

signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # MPICH's "a peer died" notice
OUT = Path(os.environ["NBDIST_SIGKILL_DIR"])
COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size


def record(name: str, text: str) -> None:
    tmp = OUT / (name + ".tmp")
    tmp.write_text(text)
    tmp.rename(OUT / name)  # atomic: the test never reads half a file


record(f"pid.{RANK}", str(os.getpid()))
t = ShmTransport(COMM, RANK, timeout_s=30)
if RANK == 0:
    record("segment", t._native.name)
COMM.Barrier()
buf = np.ones(1 << 20, np.float32)
for i in range(1_000_000):
    if RANK == SIZE - 1 and i == 20:
        record("killed", f"{time.monotonic():.6f}")
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        t.allreduce(buf, ReduceOp.Sum)
        buf[:] = 1
    except TransportError as exc:
        record(f"released.{RANK}", f"{time.monotonic():.6f} {exc}")
        os._exit(0)  # MPI cannot finalize with a dead peer
