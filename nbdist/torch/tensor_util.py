"""Turn torch tensors into the buffers nbdist.common moves, and results back into tensors.

CPU tensors become numpy views of their own storage (no copy when contiguous), so an
in-place collective writes straight into the tensor. bfloat16 has no numpy dtype; it
travels as an ml_dtypes.bfloat16 view of the same bytes. CUDA tensors are handed over
as they are (they expose __cuda_array_interface__ and __dlpack__) for the NCCL path.
"""
from __future__ import annotations

import numpy as np
import torch

from nbdist.common.ops_base import BFLOAT16

# torch dtypes the collectives accept, and whether reductions make sense for them.
_REDUCIBLE = {
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
}
for _name in ("uint16", "uint32", "uint64"):  # torch >= 2.3 has these (few ops work on them)
    if hasattr(torch, _name):
        _REDUCIBLE.add(getattr(torch, _name))
SUPPORTED = _REDUCIBLE | {torch.bool}


def _rank() -> str:
    from nbdist import common
    try:
        return f"rank {common.rank()}"
    except Exception:  # not initialized: the collective call itself will say so
        return "this rank"


def check_tensor(tensor, what: str, reduction: bool = False) -> None:
    """TypeError, naming the op and the rank, for anything that is not a supported tensor."""
    # The common case first, in the fewest tensor attribute reads (~60 ns each): a dense
    # (strided: not sparse) CPU or CUDA tensor of a dtype the op takes.
    if (tensor.__class__ is torch.Tensor and tensor.layout is torch.strided
            and tensor.dtype in (_REDUCIBLE if reduction else SUPPORTED)
            and (tensor.is_cpu or tensor.is_cuda)):
        return
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} on {_rank()}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_sparse or tensor.layout != torch.strided:
        raise TypeError(f"{what} on {_rank()}: {tensor.layout} tensors are not supported; "
                        "pass a dense tensor (tensor.to_dense())")
    allowed = _REDUCIBLE if reduction else SUPPORTED
    if tensor.dtype not in allowed:
        kind = "reductions" if reduction and tensor.dtype in SUPPORTED else "collectives"
        raise TypeError(f"{what} on {_rank()}: dtype {tensor.dtype} is not supported by {kind}")
    if not (tensor.is_cpu or tensor.is_cuda):  # (not tensor.device: it builds an object)
        raise TypeError(f"{what} on {_rank()}: tensors on {tensor.device} are not supported "
                        "(CPU and CUDA only)")


def express_view(tensor) -> np.ndarray | None:
    """The numpy view of a plain CPU tensor without grad, for nbdist.common's express table
    (which checks the rest against the op's plan), or None: then the op goes the checked
    way (check_tensor, staging, as_buffer)."""
    if (tensor.__class__ is not torch.Tensor or tensor.requires_grad or not tensor.is_cpu
            or tensor.dtype is torch.bfloat16):
        return None
    try:
        return tensor.numpy()
    except (RuntimeError, TypeError):  # a conjugated or negated view, a sparse tensor
        return None


def numpy_view(tensor: torch.Tensor) -> np.ndarray:
    """A numpy array sharing the storage of a contiguous CPU tensor."""
    t = tensor.detach() if tensor.requires_grad else tensor  # (detach makes a new tensor)
    if t.dtype is torch.bfloat16:
        return t.resolve_conj().resolve_neg().view(torch.int16).numpy().view(BFLOAT16)
    try:
        return t.numpy()
    except RuntimeError:  # a lazily negated or conjugated view: numpy() wants it resolved
        if not (t.is_conj() or t.is_neg()):
            raise
        return t.resolve_conj().resolve_neg().numpy()


def as_buffer(tensor: torch.Tensor):
    """What nbdist.common receives for `tensor` (must be contiguous): a numpy view or the CUDA tensor."""
    if tensor.is_cuda:
        # The engine reads the memory from its own thread/stream: finish the producers first.
        torch.cuda.current_stream(tensor.device).synchronize()
        return tensor.detach()
    return numpy_view(tensor)


def gpu_direct(tensor: torch.Tensor) -> bool:
    """True when `tensor` can go to nbdist.common as GPU memory (the NCCL path)."""
    if not tensor.is_cuda:
        return False
    from nbdist import common
    return bool(common.nccl_built())


def contiguous_input(tensor: torch.Tensor) -> torch.Tensor:
    """An out-of-place op's input: the tensor itself when contiguous (zero copy), else a copy.

    CUDA tensors are staged through host memory here: nbdist.common moves GPU memory
    only for the in-place allreduce_/broadcast_ (which allreduce/broadcast use directly).
    """
    t = tensor.detach() if tensor.requires_grad else tensor  # (detach makes a new tensor)
    if t.is_cuda:
        return t.cpu()
    return t if t.is_contiguous() else t.contiguous()


def inplace_staging(target: torch.Tensor) -> torch.Tensor:
    """Where an in-place op writes: `target` itself when possible, else a contiguous copy
    (in host memory for a CUDA tensor without the NCCL path) that is copied back after."""
    if target.is_cuda and not gpu_direct(target):
        return target.cpu()
    return target if target.is_contiguous() else target.contiguous()


def to_tensor(result, like: torch.Tensor) -> torch.Tensor:
    """A result buffer from nbdist.common as a tensor of `like`'s dtype and device (no copy on CPU)."""
    if (result.__class__ is np.ndarray and like.is_cpu and like.dtype is not torch.bfloat16
            and result.flags.writeable):
        out = torch.from_numpy(result)  # the common case first: a CPU op's own result
        if out.dtype is like.dtype:
            return out
    out = _to_tensor(result, like)
    if out.device != like.device:  # a CUDA tensor's op staged through host memory
        out = out.to(like.device)
    return out


def _to_tensor(result, like: torch.Tensor) -> torch.Tensor:
    if isinstance(result, torch.Tensor):
        return result
    if hasattr(result, "__cuda_array_interface__"):
        return torch.as_tensor(result, device=like.device)
    array = np.asarray(result)
    if not array.flags.writeable:  # torch warns on read-only arrays; results should be ours
        array = array.copy()
    if like.dtype == torch.bfloat16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    out = torch.from_numpy(array)
    if out.dtype != like.dtype:  # e.g. an engine that widened the type; give back the input's
        out = out.to(like.dtype)
    return out


def int_list(values, what: str) -> list[int] | None:
    """Splits given as a list, tuple, numpy array or tensor, as a list of ints (None stays None)."""
    if values is None:
        return None
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().reshape(-1).tolist()
    elif isinstance(values, np.ndarray):
        values = values.reshape(-1).tolist()
    try:
        return [int(v) for v in values]
    except (TypeError, ValueError):
        raise TypeError(f"{what} on {_rank()}: splits must be a sequence of integers, "
                        f"got {values!r}") from None
