"""nbdist.torch collectives and training on CUDA tensors (one GPU per local rank)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nbdist.torch as hvd

torch.set_num_threads(1)


@pytest.fixture(scope="module", autouse=True)
def runtime():
    hvd.init()
    torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    yield
    hvd.barrier()


def dev():
    return torch.device("cuda", torch.cuda.current_device())


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64, torch.int32])
def test_allreduce_on_gpu(dtype):
    x = torch.full((1000,), hvd.rank() + 1, dtype=dtype, device=dev())
    out = hvd.allreduce(x, op=hvd.Sum)
    assert out.device == x.device and out.dtype == dtype
    assert torch.all(out == sum(range(1, hvd.size() + 1)))
    y = x.clone()
    hvd.allreduce_(y, op=hvd.Sum)
    assert torch.equal(y, out)


def test_broadcast_and_allgather_on_gpu():
    x = torch.full((4, 3), float(hvd.rank()), device=dev())
    y = x.clone()
    hvd.broadcast_(y, 0)
    assert torch.all(y == 0)
    gathered = hvd.allgather(x)
    assert gathered.shape == (4 * hvd.size(), 3) and gathered.device == x.device


def test_distributed_optimizer_on_gpu():
    torch.manual_seed(0)
    model = nn.Linear(8, 2).to(dev())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    x = torch.randn(4, 8, device=dev()) + hvd.rank()
    F.mse_loss(model(x), torch.zeros(4, 2, device=dev())).backward()
    opt.step()
    w = model.weight.detach()
    assert torch.allclose(hvd.broadcast(w, 0), w)
