"""The NCCL path on real GPUs, under mpiexec. The GPU tests skip (with the reason) where
NCCL, the CUDA runtime, torch with CUDA, or a GPU is missing, as on CI; the checks of the
one-rank-per-GPU rule that need no GPU run everywhere."""
import pytest
from conftest import run_rank_tests

from nbdist.common.transports.nccl import shared_gpu_error


def gpu_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def why_not() -> str:
    """'' when the NCCL path can run here, else why not."""
    from nbdist.common.transports.nccl import load_nccl

    try:
        import torch
    except ImportError:
        return "PyTorch is not installed"
    if not torch.cuda.is_available():
        return f"no CUDA GPU visible to torch {torch.__version__} (built with CUDA {torch.version.cuda})"
    return load_nccl()


def skip_unless(n: int) -> None:
    """Skip, with the reason, unless n ranks can each have a GPU and NCCL here."""
    reason = why_not()
    if reason:
        pytest.skip(f"NCCL path not testable here: {reason}")
    if n > gpu_count():
        pytest.skip(f"{n} ranks need {n} GPUs (NCCL allows one rank per GPU); {gpu_count()} visible")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("n", [1, 2, 4])
def test_nccl_transport_on_gpus(n):
    skip_unless(n)
    run_rank_tests(n, "gpu_nccl.py", timeout=840)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("n", [1, 2, 4])
def test_collectives_on_cuda_tensors_and_cupy_arrays(n):
    """The five collectives on torch CUDA tensors (float32/16, bfloat16) and CuPy arrays
    equal the CPU reference, through the transport and through nbdist.torch/nbdist.common."""
    skip_unless(n)
    run_rank_tests(n, "gpu_collectives.py", timeout=540)


@pytest.mark.timeout(300)
def test_two_ranks_sharing_one_gpu_fail_clearly():
    """NCCL refuses two ranks on one GPU; every rank gets nbdist's error naming the cause,
    promptly, and its CPU collectives keep working."""
    reason = why_not()
    if reason:
        pytest.skip(f"NCCL path not testable here: {reason}")
    import os

    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    run_rank_tests(2, "gpu_shared.py", timeout=240, extra_env={"CUDA_VISIBLE_DEVICES": first})


# -- the one-rank-per-GPU rule, checked without a GPU ------------------------------------
def test_distinct_gpus_pass():
    gpus = [("node-a", "0000:1B:00.0"), ("node-a", "0000:3B:00.0"), ("node-b", "0000:1B:00.0")]
    assert shared_gpu_error(gpus, 0) == ""


def test_shared_gpu_is_named_with_its_ranks_and_the_fix():
    gpus = [("node-a", "0000:1B:00.0"), ("node-a", "0000:1B:00.0")]
    message = shared_gpu_error(gpus, 1)
    assert message.startswith("rank 1: ranks 0 and 1 both use GPU 0000:1B:00.0 on node-a")
    assert "Duplicate GPU detected" in message and "one rank per GPU" in message
    assert "--gpus" in message and "local_rank" in message
    assert shared_gpu_error(gpus, 0).startswith("rank 0: ")


def test_three_ranks_on_one_gpu_are_all_named():
    gpus = [("n", "A"), ("n", "B"), ("n", "A"), ("n", "A")]
    assert "ranks 0, 2 and 3 all use GPU A on n" in shared_gpu_error(gpus, 3)
