"""torch.distributed's process group for the benchmarks' peers (DDP, gloo, NCCL), on this machine.

Rank 0 opens the rendezvous store on a port the kernel picks as it binds (TCPStore port 0)
and sends the port to the others over `bcast` (mpi4py's or nbdist's). Picking a "free" port
first and binding it later races with every other socket on the machine: a benchmark once
failed with EADDRINUSE that way, and its other rank then waited for the store for minutes.
The store's timeout is short for the same reason: a rank that fails here must not keep the
others waiting.
"""
from __future__ import annotations

import datetime
import os
from typing import Callable

STORE_TIMEOUT = datetime.timedelta(seconds=60)


def init_peer_group(backend: str, rank: int, size: int, bcast: Callable, **kwargs) -> None:
    """torch.distributed.init_process_group(backend) for `size` ranks, rendezvous at rank 0.

    `bcast(value)` returns rank 0's value on every rank (e.g. lambda v: comm.bcast(v, root=0)).
    MASTER_ADDR, if set, is the host of rank 0's store (default 127.0.0.1).
    """
    import torch.distributed as dist

    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    if rank == 0:
        store = dist.TCPStore(host, 0, size, True, timeout=STORE_TIMEOUT, wait_for_workers=False)
        bcast(store.port)
    else:
        port = bcast(None)
        store = dist.TCPStore(host, int(port), size, False, timeout=STORE_TIMEOUT)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, **kwargs)
