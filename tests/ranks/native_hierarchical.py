"""TransportSet's choice and the hierarchical transport, with pretend nodes on one machine.

Run by tests/test_native.py with NBDIST_LOCAL_SIZE=1 (every rank its own node) and
=2 (nodes of two ranks), under mpiexec -n 2 and -n 4.
"""
import os

import numpy as np
import pytest
from mpi4py import MPI

from nbdist.common.config import Config
from nbdist.common.ops_base import ReduceOp
from nbdist.common.topology import Topology
from nbdist.common.transports.select import TransportSet

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size
LOCAL_SIZE = int(os.environ.get("NBDIST_LOCAL_SIZE", "0"))


@pytest.fixture(scope="module")
def transports():
    config = Config.from_environment()
    topology = Topology.from_mpi(COMM, config.local_size)
    ts = TransportSet(config, topology, should_stop=None)
    yield ts
    ts.close()
    topology.free()


def test_topology_and_choice(transports):
    topo = transports.topology
    assert topo.local_size == min(LOCAL_SIZE, SIZE - (RANK // LOCAL_SIZE) * LOCAL_SIZE)
    mode = os.environ.get("NBDIST_CPU_OPERATIONS", "auto")
    expect = {"auto": "hierarchical" if SIZE > LOCAL_SIZE else "shm", "mpi": "mpi",
              "shm": "hierarchical" if SIZE > LOCAL_SIZE else "shm",
              "hierarchical": "hierarchical"}[mode]
    assert transports.for_op("cpu", "allreduce").name == expect
    if expect == "hierarchical":
        assert transports.for_op("cpu", "alltoall").name == "mpi"  # no native alltoall across nodes
    assert (transports.shm is not None) == (topo.local_size > 1 and expect != "mpi")
    with pytest.raises(RuntimeError, match="NCCL"):
        transports.for_op("cuda:0", "allreduce")


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int32, np.uint8],
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", [ReduceOp.Sum, ReduceOp.Min, ReduceOp.Max, ReduceOp.Product],
                         ids=lambda o: o.name)
@pytest.mark.parametrize("n", [0, 1, 1001, 300_001])
def test_allreduce(transports, dtype, op, n):
    t = transports.for_op("cpu", "allreduce")
    parts = [((np.arange(n) * (r + 3)) % 5 + 1).astype(dtype) for r in range(SIZE)]
    buf = parts[RANK].copy()
    t.allreduce(buf, op)
    ufunc = {ReduceOp.Sum: np.add, ReduceOp.Min: np.minimum, ReduceOp.Max: np.maximum,
             ReduceOp.Product: np.multiply}[op]
    wide = [p.astype(np.float32) if p.dtype == np.float16 else p for p in parts]
    want = wide[0]
    for p in wide[1:]:
        want = ufunc(want, p)
    np.testing.assert_array_equal(buf, want.astype(dtype))


@pytest.mark.parametrize("root", range(SIZE))
@pytest.mark.parametrize("n", [0, 3, 200_003])
def test_broadcast(transports, root, n):
    t = transports.for_op("cpu", "broadcast")
    want = np.arange(n, dtype=np.int64) * (root + 1)
    buf = want.copy() if RANK == root else np.zeros(n, np.int64)
    t.broadcast(buf, root)
    np.testing.assert_array_equal(buf, want)


@pytest.mark.parametrize("scale", [0, 1, 50_000])
def test_allgatherv(transports, scale):
    t = transports.for_op("cpu", "allgather")
    counts = [scale * (r % 2) + r for r in range(SIZE)]
    parts = [np.full(c, r, np.float32) for r, c in enumerate(counts)]
    recv = np.empty(sum(counts), np.float32)
    t.allgatherv(parts[RANK], recv, counts)
    np.testing.assert_array_equal(recv, np.concatenate(parts))


@pytest.mark.parametrize("total", [0, 5, 100_001])
def test_reducescatter(transports, total):
    t = transports.for_op("cpu", "reducescatter")
    counts = [total // SIZE + (1 if r < total % SIZE else 0) for r in range(SIZE)]
    send = np.arange(total, dtype=np.float64) + RANK
    recv = np.empty(counts[RANK], np.float64)
    t.reducescatter(send, recv, counts, ReduceOp.Sum)
    start = sum(counts[:RANK])
    want = (np.arange(total, dtype=np.float64) * SIZE + SIZE * (SIZE - 1) / 2)[start:start + counts[RANK]]
    np.testing.assert_array_equal(recv, want)


def test_alltoall_goes_where_chosen(transports):
    t = transports.for_op("cpu", "alltoall")
    send = np.full(SIZE * 2, RANK, np.int16)
    recv = np.empty(SIZE * 2, np.int16)
    t.alltoallv(send, [2] * SIZE, recv, [2] * SIZE)
    np.testing.assert_array_equal(recv, np.repeat(np.arange(SIZE, dtype=np.int16), 2))
