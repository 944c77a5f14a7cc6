"""nbdist.common: the framework-neutral runtime under every binding (Horovod's API).

See docs/common-api.md. The framework bindings (nbdist.torch, nbdist.tensorflow)
re-export everything here.
"""
from .basics import (ccl_built, cross_rank, cross_size, cuda_built, ddl_built, gloo_built,
                     gloo_enabled, gpu_available, init, is_initialized, local_rank, local_size, mpi_built,
                     mpi_enabled, mpi_threads_supported, nccl_built, rank, rocm_built, shutdown,
                     size, start_timeline, stop_timeline)
from .errors import (AbortedError, CollectiveError, CollectiveTimeoutError, HorovodInternalError,
                     MismatchError, NbdistError, NotInitializedError, RuntimeBrokenError)
from .ops import (abort, allgather, allgather_async, allgather_object, allreduce, allreduce_,
                  allreduce_async, allreduce_async_, alltoall, alltoall_async, barrier, broadcast,
                  broadcast_, broadcast_async, broadcast_async_, broadcast_object, grouped_allreduce,
                  grouped_allreduce_, grouped_allreduce_async, grouped_allreduce_async_, join, poll,
                  reducescatter, reducescatter_async, synchronize)
from .process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from .ops_base import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from .requests import Handle

__all__ = [name for name in dir() if not name.startswith("_")]
