"""Horovod's PyTorch API on the nbdist runtime: `import nbdist.torch as hvd`.

Everything of nbdist.common (init, rank, size, ..., barrier, join, broadcast_object,
allgather_object) plus the tensor collectives, DistributedOptimizer,
broadcast_parameters / broadcast_optimizer_state, SyncBatchNorm and Compression,
with Horovod's names, signatures and defaults. See docs/torch.md.
"""
from __future__ import annotations

from nbdist.common import (abort, ccl_built, cross_rank, cross_size, cuda_built, ddl_built,
                           gloo_built, gloo_enabled, gpu_available, init, is_initialized, local_rank,
                           local_size, mpi_built, mpi_enabled, mpi_threads_supported,
                           nccl_built, rank, rocm_built, shutdown, size, start_timeline,
                           stop_timeline)
from nbdist.common.errors import (AbortedError, CollectiveError, CollectiveTimeoutError,
                                  HorovodInternalError, MismatchError, NbdistError,
                                  NotInitializedError, RuntimeBrokenError)
from nbdist.common.ops_base import ReduceOp

from . import elastic
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
                      reducescatter_async, sparse_allreduce_async, synchronize)
from .optimizer import DistributedOptimizer
from .process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from .sync_batch_norm import SyncBatchNorm


mlsl_built = ccl_built  # Horovod's older name for the oneCCL query


def is_homogeneous() -> bool:
    """True when every node runs the same number of ranks."""
    return size() % max(local_size(), 1) == 0 and cross_size() * local_size() == size()


__all__ = [name for name in dir() if not name.startswith("_") and name != "annotations"]
