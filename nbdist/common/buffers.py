"""New output arrays for the collectives that return one: large ones are reused memory.

A fresh array of a few MiB or more is memory the kernel maps, faults in and zeroes on
first touch. On this project's 2-core test machine that costs more than the copy that
fills it: a 2 x 64 MiB allgather result took 130 ms to fault in and fill against 37 ms to
fill memory already touched, which kept the user path's allgather at half of mpi4py's
speed (mpi4py reuses its receive buffer).

So results of POOL_MIN_BYTES and more come from a pool of blocks kept by size. A block
goes back to the pool only when no array uses it any more: the result's base is a lease
object (not an ndarray, so that every view of the result keeps the lease, and so the
block, alive), and the lease's death returns the block. A result therefore never
aliases another live array, and the caller owns it as it owns np.empty's.
"""
from __future__ import annotations

import math
import threading
from collections import OrderedDict

import numpy as np

from .sizes import MiB

POOL_MIN_BYTES = 1 * MiB  # below this, glibc's malloc reuses freed memory by itself
POOL_MAX_FREE_BYTES = 256 * MiB  # free blocks kept (a 4-rank 64 MiB allgather); more go back

# Reentrant: a lease dies (and gives its block back) wherever its last reference goes,
# which may be a garbage collection run by an allocation made under this very lock.
_lock = threading.RLock()
# nbytes -> free blocks of exactly that size, oldest returned first
_free: dict[int, list[np.ndarray]] = {}
# every free block by id, oldest returned first: when the pool is full, the blocks that
# waited longest make room, so a program whose sizes change gets its new sizes pooled
_returned: OrderedDict[int, np.ndarray] = OrderedDict()
_stats = {"free_bytes": 0, "hits": 0, "misses": 0}


class _Lease:
    """The base object of a pooled result: holds its block; its death frees the block.

    (__del__ rather than weakref.finalize, and the block's own interface dict rather than
    one built from block.ctypes: a pooled result cost 9 us to hand out, 5 % of a 1 MiB
    allgather, and now costs 5.)
    """

    __slots__ = ("__array_interface__", "_block")

    def __init__(self, block: np.ndarray):
        self._block = block
        self.__array_interface__ = block.__array_interface__

    def __del__(self):
        try:
            _give_back(self._block)
        except Exception:  # interpreter shutdown: the module's globals may be gone
            pass


def _give_back(block: np.ndarray) -> None:
    nbytes = block.nbytes
    if nbytes > POOL_MAX_FREE_BYTES:
        return
    with _lock:
        while _stats["free_bytes"] + nbytes > POOL_MAX_FREE_BYTES:
            _, old = _returned.popitem(last=False)
            # (the oldest free block overall is the oldest of its size: first in its list)
            same = _free[old.nbytes]
            del same[0]
            if not same:
                del _free[old.nbytes]
            _stats["free_bytes"] -= old.nbytes
        _free.setdefault(nbytes, []).append(block)
        _returned[id(block)] = block
        _stats["free_bytes"] += nbytes


def empty(shape, dtype) -> np.ndarray:
    """An uninitialised C-contiguous array, as np.empty(shape, dtype), from the pool when large."""
    dtype = np.dtype(dtype)
    shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
    return _empty(shape, dtype, math.prod(shape) * dtype.itemsize)  # Python ints: no overflow


def empty_like(array: np.ndarray) -> np.ndarray:
    """empty(array.shape, array.dtype), with the checks of shape and dtype already done."""
    return _empty(array.shape, array.dtype, array.nbytes)


def _empty(shape: tuple, dtype: np.dtype, nbytes: int) -> np.ndarray:
    if nbytes < POOL_MIN_BYTES or dtype.hasobject:
        return np.empty(shape, dtype)
    with _lock:
        blocks = _free.get(nbytes)
        block = blocks.pop() if blocks else None
        if block is not None:
            del _returned[id(block)]
            _stats["free_bytes"] -= nbytes
            _stats["hits"] += 1
        else:
            _stats["misses"] += 1
    if block is None:
        block = np.empty(nbytes, np.uint8)
    # the lease holds the block until it (every view of the result) is gone
    return np.asarray(_Lease(block)).view(dtype).reshape(shape)


def pool_stats() -> dict:
    """Hits, misses and the bytes held free (for tests and `nbdist bench`)."""
    with _lock:
        return dict(_stats)


def clear_pool() -> None:
    """Give every free block back to the system (shutdown)."""
    with _lock:
        _free.clear()
        _returned.clear()
        _stats["free_bytes"] = 0
