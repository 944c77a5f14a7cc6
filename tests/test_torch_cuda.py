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
def test_cuda_tensor_without_nccl_is_a_clear_error(monkeypatch):
    """Where NCCL is missing, a CUDA tensor fails before anything is sent, naming the fix."""
    import torch

    import nbdist.common as common
    import nbdist.torch as hvd

    monkeypatch.setattr(common, "nccl_built", lambda: False)
    hvd.init()
    try:
        with pytest.raises(RuntimeError, match="NCCL"):
            hvd.allreduce(torch.ones(2, device="cuda"))
    finally:
        hvd.shutdown()
