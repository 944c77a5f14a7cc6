"""`%%distributed --gpus` gives each rank the GPU of its local rank, through a real kernel.

The pinning itself (CUDA_VISIBLE_DEVICES per rank) and its error without GPUs are checked
everywhere, with made-up device ids; on a machine with a GPU the same notebook also trains
on the pinned GPU and shows what two ranks pinned to one GPU get (NCCL's one-rank-per-GPU
rule, named by nbdist).
"""
from __future__ import annotations

import os

import nbharness as h
import pytest

pytestmark = pytest.mark.timeout(600)


def _gpu() -> str | None:
    """The GPU torch sees here, or None."""
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


GPU = _gpu()
ORIGINAL = os.environ.get("CUDA_VISIBLE_DEVICES")
RESTORE = (f"os.environ['CUDA_VISIBLE_DEVICES'] = {ORIGINAL!r}" if ORIGINAL is not None
           else "os.environ.pop('CUDA_VISIBLE_DEVICES', None)")

TRAIN_ON_PINNED_GPU = """%%distributed -n 1 --gpus
import os, torch
import nbdist.torch as hvd
hvd.init()
model = torch.nn.Linear(4, 1).cuda()
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters())
x = torch.randn(64, 4, device='cuda'); y = x.sum(1, keepdim=True)
first = None
for _ in range(50):
    opt.zero_grad(); loss = torch.nn.functional.mse_loss(model(x), y); loss.backward(); opt.step()
    first = first if first is not None else loss.item()
print('pinned to', os.environ['CUDA_VISIBLE_DEVICES'], 'sees', torch.cuda.device_count(),
      torch.cuda.get_device_name(), 'trained', first > 5 * loss.item())
"""

TWO_RANKS_ONE_GPU = """%%distributed -n 2 --gpus
import torch
import nbdist.torch as hvd
hvd.init()
hvd.allreduce(torch.ones(3, device='cuda'), name='shared')
"""


@pytest.fixture(scope="module")
def executed():
    cells = [
        "%load_ext nbdist",
        "import os\nos.environ['CUDA_VISIBLE_DEVICES'] = '5,7'",                            # 1
        "%%distributed -n 2 --gpus\nimport os\nprint('pinned', os.environ['CUDA_VISIBLE_DEVICES'])",
        "%%distributed --gpus\nprint('again', os.environ['CUDA_VISIBLE_DEVICES'])",           # 3
        "%dist_stop",
        "os.environ['CUDA_VISIBLE_DEVICES'] = '-1'",                                          # 5
        "%%distributed -n 1 --gpus\nprint('must not run')",                                   # 6
        "%dist_stop",
        RESTORE,                                                                              # 8
    ]
    if GPU:
        cells += [TRAIN_ON_PINNED_GPU,                                                        # 9
                  (TWO_RANKS_ONE_GPU, {"interrupt_after": 180}),                              # 10
                  "%dist_stop"]
    nb = h.notebook(*cells)
    h.execute(nb, timeout=300)
    return nb


def text(nb, i):
    return h.text_of(nb.cells[i])


def test_each_rank_gets_the_gpu_of_its_local_rank(executed):
    out = text(executed, 2)
    assert h.error_of(executed.cells[2]) is None, out
    assert "pinned 5" in out and "[rank 1] pinned 7" in out, out


def test_pinning_again_keeps_each_ranks_gpu(executed):
    out = text(executed, 3)
    assert "again 5" in out and "[rank 1] again 7" in out, out


def test_no_visible_gpu_is_a_clear_error(executed):
    out = text(executed, 6)
    assert "--gpus" in out and "none is visible" in out and "rank 0" in out, out
    assert "must not run" not in out


@pytest.mark.skipif(GPU is None, reason="no CUDA GPU visible to torch here")
def test_training_on_the_pinned_gpu(executed):
    out = text(executed, 9)
    assert h.error_of(executed.cells[9]) is None, out
    assert "sees 1" in out and GPU in out and "trained True" in out, out


@pytest.mark.skipif(GPU is None, reason="no CUDA GPU visible to torch here")
def test_two_ranks_pinned_to_one_gpu_are_told_why(executed):
    import torch

    if torch.cuda.device_count() > 1:
        pytest.skip("this node has a GPU per rank, so --gpus gives the two ranks different GPUs")
    out = text(executed, 10)
    assert "both use GPU" in out and "one rank per GPU" in out, out
