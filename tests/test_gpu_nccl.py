"""The NCCL path on real GPUs: one rank per GPU, under mpiexec. Skips (with the reason)
where NCCL, the CUDA runtime, torch with CUDA, or a GPU is missing, as on CI."""
import pytest

from conftest import run_rank_tests


def _gpus() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _why_not() -> str:
    from nbdist.common.transports.nccl import load_nccl

    if _gpus() == 0:
        return "no CUDA GPU visible to torch"
    return load_nccl()


@pytest.mark.timeout(900)
@pytest.mark.parametrize("n", [1, 2, 4])
def test_nccl_transport_on_gpus(n):
    reason = _why_not()
    if reason:
        pytest.skip(f"NCCL path not testable here: {reason}")
    if n > _gpus():
        pytest.skip(f"{n} ranks need {n} GPUs (NCCL allows one rank per GPU); {_gpus()} visible")
    run_rank_tests(n, "gpu_nccl.py", timeout=840)
