"""The NCCL transport on torch CUDA tensors, one GPU per rank (run by tests/test_gpu_nccl.py)."""
import pytest
import torch
from mpi4py import MPI

from nbdist.common.config import Config
from nbdist.common.ops_base import ReduceOp
from nbdist.common.topology import Topology
from nbdist.common.transports.select import TransportSet

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size


@pytest.fixture(scope="module")
def nccl():
    topology = Topology.from_mpi(COMM)
    torch.cuda.set_device(topology.local_rank % torch.cuda.device_count())
    ts = TransportSet(Config.from_environment(), topology, should_stop=None)
    assert ts.for_op("cuda:0", "allreduce").name == "nccl"
    yield ts.nccl
    ts.close()
    topology.free()


def dev():
    return torch.device("cuda", torch.cuda.current_device())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64,
                                   torch.int32, torch.int64, torch.uint8])
@pytest.mark.parametrize("op", [ReduceOp.Sum, ReduceOp.Min, ReduceOp.Max, ReduceOp.Product])
@pytest.mark.parametrize("n", [1, 1001, 3_000_001])
def test_allreduce(nccl, dtype, op, n):
    parts = [((torch.arange(n) * (r + 3)) % 3 + 1).to(dtype) for r in range(SIZE)]
    buf = parts[RANK].to(dev())
    nccl.allreduce(buf, op)
    torch.cuda.synchronize()
    fn = {ReduceOp.Sum: torch.add, ReduceOp.Min: torch.minimum, ReduceOp.Max: torch.maximum,
          ReduceOp.Product: torch.mul}[op]
    want = parts[0].double()
    for p in parts[1:]:
        want = fn(want, p.double())
    assert torch.equal(buf.cpu(), want.to(dtype))


def test_allreduce_on_a_side_stream(nccl):
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        buf = torch.full((1 << 20,), float(RANK + 1), device=dev())
        nccl.allreduce(buf, ReduceOp.Sum)
        assert buf[0].item() == SIZE * (SIZE + 1) / 2


@pytest.mark.parametrize("root", range(SIZE))
def test_broadcast(nccl, root):
    buf = torch.arange(10_000, device=dev(), dtype=torch.float32) * (RANK == root)
    nccl.broadcast(buf, root)
    assert torch.equal(buf.cpu(), torch.arange(10_000, dtype=torch.float32))


def test_allgatherv_uneven(nccl):
    counts = [r + 1 for r in range(SIZE)]
    send = torch.full((counts[RANK],), RANK, device=dev(), dtype=torch.int32)
    recv = torch.empty(sum(counts), device=dev(), dtype=torch.int32)
    nccl.allgatherv(send, recv, counts)
    want = torch.cat([torch.full((c,), r, dtype=torch.int32) for r, c in enumerate(counts)])
    assert torch.equal(recv.cpu(), want)


def test_reducescatter_uneven(nccl):
    total = 7 * SIZE + 1
    counts = [total // SIZE + (1 if r < total % SIZE else 0) for r in range(SIZE)]
    send = torch.arange(total, device=dev(), dtype=torch.float32)
    recv = torch.empty(counts[RANK], device=dev(), dtype=torch.float32)
    nccl.reducescatter(send, recv, counts, ReduceOp.Sum)
    start = sum(counts[:RANK])
    assert torch.equal(recv.cpu(), torch.arange(total, dtype=torch.float32)[start:start + counts[RANK]] * SIZE)


def test_alltoallv(nccl):
    send = torch.full((2 * SIZE,), RANK, device=dev(), dtype=torch.int64)
    recv = torch.empty(2 * SIZE, device=dev(), dtype=torch.int64)
    nccl.alltoallv(send, [2] * SIZE, recv, [2] * SIZE)
    assert torch.equal(recv.cpu(), torch.arange(SIZE).repeat_interleave(2))


def test_public_api_on_cuda_tensors():
    import nbdist.common as hvd

    hvd.init()
    t = torch.ones(1000, device=dev()) * (RANK + 1)
    out = hvd.allreduce(t, op=hvd.Sum, name="gpu.sum")
    assert torch.equal(torch.as_tensor(out).cpu(), torch.full((1000,), SIZE * (SIZE + 1) / 2))
    hvd.shutdown()
