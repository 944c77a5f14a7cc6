"""A script (not a pytest file): the last rank SIGKILLs itself in the middle of allreduces.

Run by tests/test_native.py under `mpiexec -disable-auto-cleanup`, so the other ranks
live on: each must leave its wait within a second, naming the dead rank. Rank 0
prints the segment's name, so the outer test can check /dev/shm holds nothing.
"""
import os
import signal
import sys
import time

import numpy as np
from mpi4py import MPI

from nbdist.common.ops_base import ReduceOp
from nbdist.common.transport import TransportError
from nbdist.common.transports.shm import ShmTransport

# MPICH's mpiexec tells survivors of a dead rank with SIGUSR1 (fatal by default);
# ignore it, so what is tested is nbdist's own detection of the dead peer.
signal.signal(signal.SIGUSR1, signal.SIG_IGN)

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size

t = ShmTransport(COMM, RANK, timeout_s=30)
if RANK == 0:
    print(f"SEGMENT {t._native.name}", flush=True)
COMM.Barrier()
buf = np.ones(1 << 20, np.float32)
for i in range(1_000_000):
    if RANK == SIZE - 1 and i == 20:
        print(f"KILLING {time.monotonic():.6f}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        t.allreduce(buf, ReduceOp.Sum)
        buf[:] = 1
    except TransportError as exc:
        print(f"RELEASED rank {RANK} at {time.monotonic():.6f}: {exc}", flush=True)
        sys.stdout.flush()
        os._exit(0)  # MPI cannot finalize with a dead peer
