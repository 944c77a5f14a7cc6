"""nbdist.torch on 2 and 4 ranks: each tests/ranks/torch_*.py file runs under mpiexec."""
import importlib.util

import pytest

from conftest import run_rank_tests

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                reason="PyTorch is not installed")

RANK_FILES = ["torch_ops.py", "torch_autograd.py", "torch_training.py", "torch_horovod_compat.py"]


@pytest.mark.timeout(420)
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("rank_file", RANK_FILES)
def test_torch_ranks(n, rank_file):
    run_rank_tests(n, rank_file, timeout=400)


def test_single_process_world():
    """Without mpiexec, nbdist.torch runs as a world of one and the ops are identities."""
    import torch

    import nbdist.torch as hvd

    hvd.init()
    try:
        x = torch.arange(4.0)
        for out in (hvd.allreduce(x), hvd.allgather(x), hvd.broadcast(x, 0), hvd.alltoall(x),
                    hvd.reducescatter(x), hvd.grouped_allreduce([x])[0]):
            assert torch.equal(out, x)
            assert out.data_ptr() != x.data_ptr(), "a result must not alias its input"
        model = torch.nn.Linear(2, 1)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
        model(torch.ones(3, 2)).sum().backward()
        opt.step()
        assert isinstance(opt, torch.optim.SGD)
    finally:
        hvd.shutdown()


def test_everything_of_nbdist_common_is_reexported():
    import types

    import nbdist.common as common
    import nbdist.torch as hvd

    names = [n for n in common.__all__ if not isinstance(getattr(common, n), types.ModuleType)]
    assert [n for n in names if not hasattr(hvd, n)] == []
    for name in ("init", "rank", "size", "local_rank", "cross_size", "mpi_threads_supported"):
        assert getattr(hvd, name) is getattr(common, name)


def test_gpu_available_answers_for_each_framework():
    """Horovod's GPU tests skip on hvd.gpu_available(...): it must answer, never raise."""
    import torch

    import nbdist.torch as hvd

    assert hvd.gpu_available("torch") is torch.cuda.is_available()
    assert hvd.gpu_available("mxnet") is False  # no binding: False, as in Horovod
