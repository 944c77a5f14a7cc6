"""Horovod's PyTorch API on the nbdist runtime: `import nbdist.torch as hvd`.

Everything of nbdist.common (init, rank, size, ..., barrier, join, broadcast_object,
allgather_object) plus the tensor collectives, DistributedOptimizer,
broadcast_parameters / broadcast_optimizer_state, SyncBatchNorm and Compression,
with Horovod's names, signatures and defaults. See docs/torch.md.
"""
from __future__ import annotations

from nbdist import common as _common
from nbdist.common import (cross_rank, cross_size, init, is_initialized, local_rank,
                           local_size, mpi_built, mpi_threads_supported, nccl_built, rank,
                           shutdown, size)
from nbdist.common.errors import (AbortedError, CollectiveError, CollectiveTimeoutError,
                                  HorovodInternalError, MismatchError, NbdistError)

from .compression import Compression
from .functions import (allgather_object, broadcast_object, broadcast_optimizer_state,
                        broadcast_parameters)
from .mpi_ops import (Adasum, Average, Handle, Max, Min, Product, Sum, allgather,
                      allgather_async, allreduce, allreduce_, allreduce_async, allreduce_async_,
                      alltoall, alltoall_async, barrier, broadcast, broadcast_, broadcast_async,
                      broadcast_async_, grouped_allgather, grouped_allgather_async,
                      grouped_allreduce, grouped_allreduce_, grouped_allreduce_async,
                      grouped_allreduce_async_, grouped_reducescatter,
                      grouped_reducescatter_async, join, poll, reducescatter,
                      reducescatter_async, synchronize)
from .optimizer import DistributedOptimizer
from .process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from .sync_batch_norm import SyncBatchNorm


def _false() -> bool:
    return False


# Horovod's build queries; nbdist.common answers those it knows, the rest are False.
mpi_enabled = getattr(_common, "mpi_enabled", mpi_built)
gloo_built = getattr(_common, "gloo_built", _false)
gloo_enabled = getattr(_common, "gloo_enabled", _false)
ddl_built = getattr(_common, "ddl_built", _false)
ccl_built = getattr(_common, "ccl_built", _false)
mlsl_built = ccl_built
cuda_built = getattr(_common, "cuda_built", nccl_built)
rocm_built = getattr(_common, "rocm_built", _false)


def is_homogeneous() -> bool:
    """True when every node runs the same number of ranks."""
    return size() % max(local_size(), 1) == 0 and cross_size() * local_size() == size()


def start_timeline(file_path, mark_cycles=False) -> None:
    """Horovod's timeline is not recorded by nbdist; accepted so that code calling it runs."""


def stop_timeline() -> None:
    """See start_timeline."""


__all__ = [name for name in dir() if not name.startswith("_")]
