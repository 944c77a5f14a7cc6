"""nbdist.torch on CUDA tensors (the NCCL path): runs where a GPU and NCCL exist, one
rank per GPU; skips with the reason elsewhere."""
import pytest
from conftest import run_rank_tests
from test_gpu_nccl import skip_unless


def _no_gpu_reason():
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed"
    if not torch.cuda.is_available():
        return f"no CUDA device (torch {torch.__version__}, built with CUDA {torch.version.cuda})"
    return None


NO_GPU = _no_gpu_reason()


@pytest.mark.timeout(400)
@pytest.mark.parametrize("n", [1, 2, 4])
def test_torch_cuda_ranks(n):
    skip_unless(n)
    run_rank_tests(n, "torch_cuda.py", timeout=380)


@pytest.mark.skipif(NO_GPU is not None, reason=NO_GPU or "")
def test_cuda_tensors_without_nccl_are_staged_through_host_memory(monkeypatch):
    """Where NCCL is missing, CUDA tensors still work (copied to the CPU and back)."""
    import torch

    import nbdist.torch as hvd
    from nbdist import common

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
