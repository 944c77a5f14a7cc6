"""nbdist.torch on CUDA tensors (the NCCL path): runs where a GPU and NCCL exist."""
import importlib.util

import pytest

from conftest import run_rank_tests


def _no_gpu_reason():
    if importlib.util.find_spec("torch") is None:
        return "PyTorch is not installed"
    import torch

    if not torch.cuda.is_available():
        return f"no CUDA device (torch {torch.__version__}, built with CUDA: {torch.version.cuda})"
    return None


def _skip_reason():
    if _no_gpu_reason():
        return _no_gpu_reason()
    import nbdist.common as common

    if not common.nccl_built():
        return "nbdist's NCCL path is not available here (nccl_built() is False)"
    return None


REASON = _skip_reason()
NO_GPU = _no_gpu_reason()


@pytest.mark.skipif(REASON is not None, reason=REASON or "")
@pytest.mark.timeout(400)
@pytest.mark.parametrize("n", [2, 4])
def test_torch_cuda_ranks(n):
    import torch

    if torch.cuda.device_count() < 1:
        pytest.skip("no CUDA device")
    run_rank_tests(n, "torch_cuda.py", timeout=380)


@pytest.mark.skipif(NO_GPU is not None, reason=NO_GPU or "")
def test_cuda_tensors_without_nccl_are_staged_through_host_memory(monkeypatch):
    """Where NCCL is missing, CUDA tensors still work (copied to the CPU and back)."""
    import torch

    import nbdist.common as common
    import nbdist.torch as hvd

    monkeypatch.setattr(common, "nccl_built", lambda: False)
    hvd.init()
    try:
        x = torch.arange(4.0, device="cuda")
        out = hvd.allreduce(x, op=hvd.Sum)
        assert out.device == x.device and torch.equal(out, x * hvd.size())
        y = x.clone()
        hvd.allreduce_(y, op=hvd.Sum)
        assert torch.equal(y, out)
        assert hvd.allgather(x).device == x.device
    finally:
        hvd.shutdown()
