"""The five collectives on GPU memory against a CPU reference (run by tests/test_gpu_nccl.py).

One GPU per rank. Three layers, each checked with float32, float16 and bfloat16 torch CUDA
tensors and float32/float16 CuPy arrays (CuPy has no bfloat16):
- the NCCL transport itself (allreduce, broadcast, allgatherv, reducescatter, alltoallv);
- nbdist.torch on CUDA tensors (the user's API; results stay on the GPU in their dtype);
- nbdist.common on CuPy arrays (allreduce_/broadcast_ in place through NCCL; the other
  ops name the fix);
and DistributedOptimizer training a CUDA model. The inputs are small integers, exact in
every dtype, so sums are compared exactly; averages within the dtype's rounding.
"""
import numpy as np
import pytest
import torch
from mpi4py import MPI

import nbdist.torch as hvd
from nbdist.common.config import Config
from nbdist.common.ops_base import ReduceOp
from nbdist.common.topology import Topology
from nbdist.common.transports.select import TransportSet

torch.set_num_threads(1)
COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
KINDS = ["torch-float32", "torch-float16", "torch-bfloat16", "cupy-float32", "cupy-float16"]


@pytest.fixture(scope="module", autouse=True)
def device():
    topology = Topology.from_mpi(COMM)
    torch.cuda.set_device(topology.local_rank % torch.cuda.device_count())
    topology.free()
    yield torch.device("cuda", torch.cuda.current_device())


@pytest.fixture(scope="module")
def nccl(device):
    topology = Topology.from_mpi(COMM)
    ts = TransportSet(Config.from_environment(), topology, should_stop=None)
    assert ts.for_op(f"cuda:{device.index}", "allreduce").name == "nccl"
    yield ts.nccl
    ts.close()
    topology.free()


@pytest.fixture(scope="module")
def runtime(device):
    hvd.init()
    yield
    hvd.barrier()


# -- arrays of each kind, from and back to float64 numpy --------------------------------
def on_gpu(kind: str, values: np.ndarray, device):
    lib, dtype = kind.split("-")
    if lib == "torch":
        return torch.as_tensor(values).to(TORCH_DTYPES[dtype]).to(device)
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
    with cupy.cuda.Device(device.index):
        return cupy.asarray(values.astype(dtype))


def empty_like_kind(kind: str, count: int, device):
    return on_gpu(kind, np.zeros(count), device)


def to_host(array) -> np.ndarray:
    if isinstance(array, torch.Tensor):
        assert array.is_cuda, "the result left the GPU"
        return array.detach().float().cpu().numpy().astype(np.float64)
    import cupy

    return cupy.asnumpy(array).astype(np.float64)


def pattern(rank: int, count: int) -> np.ndarray:
    """Rank `rank`'s input: small integers (1..7), exact in float16 and bfloat16."""
    return ((np.arange(count) * (rank + 3)) % 7 + 1).astype(np.float64)


def sync():
    torch.cuda.synchronize()


# -- the transport ------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("count", [1, 1023, 1 << 20])
def test_transport_allreduce(nccl, device, kind, count):
    buf = on_gpu(kind, pattern(RANK, count), device)
    nccl.allreduce(buf, ReduceOp.Sum)
    sync()
    np.testing.assert_array_equal(to_host(buf), sum(pattern(r, count) for r in range(SIZE)))


@pytest.mark.parametrize("kind", KINDS)
def test_transport_broadcast(nccl, device, kind):
    for root in range(SIZE):
        buf = on_gpu(kind, pattern(RANK, 5000), device)
        nccl.broadcast(buf, root)
        sync()
        np.testing.assert_array_equal(to_host(buf), pattern(root, 5000))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("even", [True, False])
def test_transport_allgatherv(nccl, device, kind, even):
    counts = [300] * SIZE if even else [100 * (r + 1) for r in range(SIZE)]
    send = on_gpu(kind, pattern(RANK, counts[RANK]), device)
    recv = empty_like_kind(kind, sum(counts), device)
    nccl.allgatherv(send, recv, counts)
    sync()
    np.testing.assert_array_equal(to_host(recv),
                                  np.concatenate([pattern(r, c) for r, c in enumerate(counts)]))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("even", [True, False])
def test_transport_reducescatter(nccl, device, kind, even):
    counts = [256] * SIZE if even else [10 + r for r in range(SIZE)]
    total = sum(counts)
    send = on_gpu(kind, pattern(RANK, total), device)
    recv = empty_like_kind(kind, counts[RANK], device)
    nccl.reducescatter(send, recv, counts, ReduceOp.Sum)
    sync()
    start = sum(counts[:RANK])
    want = sum(pattern(r, total) for r in range(SIZE))[start:start + counts[RANK]]
    np.testing.assert_array_equal(to_host(recv), want)


@pytest.mark.parametrize("kind", KINDS)
def test_transport_alltoallv(nccl, device, kind):
    # rank r sends q+1 elements, all equal to 10*r + q, to rank q
    send_counts = [q + 1 for q in range(SIZE)]
    send = on_gpu(kind, np.concatenate([np.full(q + 1, 10 * RANK + q) for q in range(SIZE)]), device)
    recv_counts = [RANK + 1] * SIZE
    recv = empty_like_kind(kind, sum(recv_counts), device)
    nccl.alltoallv(send, send_counts, recv, recv_counts)
    sync()
    want = np.concatenate([np.full(RANK + 1, 10 * s + RANK) for s in range(SIZE)])
    np.testing.assert_array_equal(to_host(recv), want)


# -- nbdist.torch on CUDA tensors -------------------------------------------------------
def check_result(out, like: torch.Tensor, want: np.ndarray, exact: bool = True):
    assert out.device == like.device and out.dtype == like.dtype, (out.device, out.dtype)
    got = to_host(out).reshape(want.shape)
    if exact:
        np.testing.assert_array_equal(got, want)
    else:  # one rounding to the dtype
        eps = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[like.dtype]
        np.testing.assert_allclose(got, want, rtol=eps, atol=eps)


@pytest.mark.usefixtures("runtime")
@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
def test_torch_allreduce(device, dtype):
    x = on_gpu(f"torch-{dtype}", pattern(RANK, 3000).reshape(30, 100), device)
    total = sum(pattern(r, 3000) for r in range(SIZE)).reshape(30, 100)
    check_result(hvd.allreduce(x, op=hvd.Sum, name=f"ar.sum.{dtype}"), x, total)
    check_result(hvd.allreduce(x, name=f"ar.avg.{dtype}"), x, total / SIZE, exact=False)
    y = x.clone()
    hvd.allreduce_(y, op=hvd.Sum, name=f"ar_.sum.{dtype}")
    check_result(y, x, total)


@pytest.mark.usefixtures("runtime")
@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
def test_torch_allgather(device, dtype):
    rows = RANK + 1  # uneven first dimensions
    x = on_gpu(f"torch-{dtype}", pattern(RANK, rows * 3).reshape(rows, 3), device)
    want = np.concatenate([pattern(r, (r + 1) * 3).reshape(r + 1, 3) for r in range(SIZE)])
    check_result(hvd.allgather(x, name=f"ag.{dtype}"), x, want)


@pytest.mark.usefixtures("runtime")
@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
def test_torch_broadcast(device, dtype):
    for root in range(SIZE):
        x = on_gpu(f"torch-{dtype}", pattern(RANK, 4000).reshape(40, 100), device)
        check_result(hvd.broadcast(x, root, name=f"bc.{dtype}.{root}"), x,
                     pattern(root, 4000).reshape(40, 100))
        hvd.broadcast_(x, root, name=f"bc_.{dtype}.{root}")
        check_result(x, x, pattern(root, 4000).reshape(40, 100))


@pytest.mark.usefixtures("runtime")
@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
def test_torch_alltoall(device, dtype):
    splits = [q + 1 for q in range(SIZE)]
    rows = np.concatenate([np.full((q + 1, 2), 10 * RANK + q) for q in range(SIZE)])
    x = on_gpu(f"torch-{dtype}", rows, device)
    received, received_splits = hvd.alltoall(x, splits=torch.tensor(splits), name=f"a2a.{dtype}")
    want = np.concatenate([np.full((RANK + 1, 2), 10 * s + RANK) for s in range(SIZE)])
    check_result(received, x, want)
    assert received_splits.tolist() == [RANK + 1] * SIZE


@pytest.mark.usefixtures("runtime")
@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
def test_torch_reducescatter(device, dtype):
    rows = 2 * SIZE + 1  # Horovod's rule: the first rows % size ranks keep one row more
    x = on_gpu(f"torch-{dtype}", pattern(RANK, rows * 4).reshape(rows, 4), device)
    counts = [rows // SIZE + (1 if r < rows % SIZE else 0) for r in range(SIZE)]
    start = sum(counts[:RANK])
    total = sum(pattern(r, rows * 4) for r in range(SIZE)).reshape(rows, 4)
    out = hvd.reducescatter(x, op=hvd.Sum, name=f"rs.{dtype}")
    check_result(out, x, total[start:start + counts[RANK]])


# -- nbdist.common on CuPy arrays ---------------------------------------------------------
@pytest.mark.usefixtures("runtime")
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_common_on_cupy(device, dtype):
    from nbdist import common

    kind = f"cupy-{dtype}"
    a = on_gpu(kind, pattern(RANK, 10_000), device)
    common.allreduce_(a, op=common.Sum, name=f"cupy.ar.{dtype}")
    np.testing.assert_array_equal(to_host(a), sum(pattern(r, 10_000) for r in range(SIZE)))
    b = on_gpu(kind, pattern(RANK, 777), device)
    common.broadcast_(b, 0, name=f"cupy.bc.{dtype}")
    np.testing.assert_array_equal(to_host(b), pattern(0, 777))
    with pytest.raises(TypeError, match="move the data to the CPU"):
        common.allgather(b)


# -- training ---------------------------------------------------------------------------
@pytest.mark.usefixtures("runtime")
def test_distributed_optimizer_trains_a_cuda_model(device):
    torch.manual_seed(0)  # the same start everywhere; broadcast_parameters checks it anyway
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)).to(device)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    gen = torch.Generator(device="cpu").manual_seed(100 + RANK)  # each rank its own shard
    w = torch.linspace(-1, 1, 16)
    x = torch.randn(256, 16, generator=gen)
    y = (x @ w).unsqueeze(1)
    x, y = x.to(device), y.to(device)
    losses = []
    for _ in range(60):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(hvd.allreduce(loss.detach(), name="loss").item())
    assert losses[-1] < 0.2 * losses[0], losses[::10]
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = hvd.allgather(flat.unsqueeze(0), name="params")
    assert torch.equal(everyone, flat.unsqueeze(0).expand(SIZE, -1)), "ranks' weights differ"
