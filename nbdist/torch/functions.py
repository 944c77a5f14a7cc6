"""Training helpers: make every rank start from root's parameters and optimizer state."""
from __future__ import annotations

from collections.abc import Mapping

import torch

from nbdist import common as _c

from .mpi_ops import broadcast_async_, synchronize
from .process_sets import check_process_set, global_process_set


def broadcast_parameters(params, root_rank, process_set=global_process_set) -> None:
    """Overwrite every rank's tensors with root_rank's, in place.

    `params` is a state_dict (`model.state_dict()`), or `model.named_parameters()`, or a
    list of tensors / (name, tensor) pairs. All broadcasts are submitted before any is
    waited on, so they fuse and overlap.
    """
    ps = check_process_set(process_set, "broadcast_parameters")
    if isinstance(params, Mapping):
        items = sorted(params.items(), key=lambda kv: str(kv[0]))
    elif isinstance(params, torch.Tensor):
        raise ValueError("broadcast_parameters: expected a state_dict or named_parameters, "
                         "got a single tensor (use hvd.broadcast_ for one tensor)")
    else:
        try:
            items = [p if isinstance(p, tuple) else (None, p) for p in params]
        except TypeError:
            raise ValueError(f"broadcast_parameters: invalid params of type "
                             f"{type(params).__name__}; pass model.state_dict() or "
                             "model.named_parameters()") from None
    handles = []
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"broadcast_parameters: entry {name!r} is a "
                             f"{type(tensor).__name__}, not a tensor")
        op_name = None if name is None else f"broadcast_parameters.{name}"
        handles.append(broadcast_async_(tensor, root_rank, name=op_name, process_set=ps))
    for handle in handles:
        synchronize(handle)


class _TensorSlot:
    """Where a tensor sat in root's optimizer state, and what it looked like."""

    __slots__ = ("index", "shape", "dtype")

    def __init__(self, index: int, tensor: torch.Tensor):
        self.index, self.shape, self.dtype = index, tuple(tensor.shape), tensor.dtype


def _strip_tensors(obj, tensors: list):
    """A copy of `obj` with each tensor replaced by a _TensorSlot (collected into `tensors`)."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return _TensorSlot(len(tensors) - 1, obj)
    if isinstance(obj, dict):
        return type(obj)((k, _strip_tensors(v, tensors)) for k, v in obj.items())
    if isinstance(obj, list):
        return [_strip_tensors(v, tensors) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_strip_tensors(v, tensors) for v in obj)
    return obj


def _fill_tensors(obj, tensors: list):
    """The inverse of _strip_tensors: put tensors back where their slots are."""
    if isinstance(obj, _TensorSlot):
        return tensors[obj.index]
    if isinstance(obj, dict):
        return type(obj)((k, _fill_tensors(v, tensors)) for k, v in obj.items())
    if isinstance(obj, list):
        return [_fill_tensors(v, tensors) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_fill_tensors(v, tensors) for v in obj)
    return obj


def broadcast_optimizer_state(optimizer, root_rank, process_set=global_process_set) -> None:
    """Give every rank root_rank's optimizer state and hyperparameters (lr, momentum, ...).

    Works for any torch.optim optimizer, also when the state does not exist yet on some
    ranks (no step taken): root's state_dict layout (with tensors replaced by their shape
    and dtype) goes out with broadcast_object, then the tensors themselves with tensor
    broadcasts, and every rank loads the result with load_state_dict. Parameters are not
    touched (unlike Horovod's dummy step, which can move them under weight decay); as
    with Horovod, parameters that require a gradient and have none get a zero one.
    """
    ps = check_process_set(process_set, "broadcast_optimizer_state")
    # Horovod's version takes a dummy step, which leaves a zero gradient on every
    # parameter that requires one; code written for it reads p.grad afterwards.
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    is_root = _c.rank() == root_rank
    state = optimizer.state_dict()
    local_tensors: list = []
    layout = _strip_tensors(state, local_tensors)
    layout = _c.broadcast_object(layout if is_root else None, root_rank=root_rank,
                                 name="broadcast_optimizer_state.layout", process_set=ps)
    if is_root:
        tensors = local_tensors
    else:
        slots: list = []
        _collect_slots(layout, slots)
        slots.sort(key=lambda s: s.index)
        tensors = [torch.empty(s.shape, dtype=s.dtype) for s in slots]
    handles = [broadcast_async_(t, root_rank, name=f"broadcast_optimizer_state.{i}",
                                process_set=ps) for i, t in enumerate(tensors)]
    for handle in handles:
        synchronize(handle)
    # The root loads it too: load_state_dict casts some entries (NAdam's mu_product to the
    # parameters' dtype, for one), and every rank must hold exactly the same state.
    optimizer.load_state_dict(_fill_tensors(layout, tensors))


def _collect_slots(obj, out: list) -> None:
    if isinstance(obj, _TensorSlot):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _collect_slots(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _collect_slots(v, out)


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """root_rank's picklable `obj` on every rank (cloudpickle)."""
    ps = check_process_set(process_set, "broadcast_object")
    return _c.broadcast_object(obj, root_rank=root_rank, name=name, process_set=ps)


def allgather_object(obj, name=None, process_set=global_process_set) -> list:
    """Every rank's picklable `obj`, as a list indexed by rank."""
    ps = check_process_set(process_set, "allgather_object")
    return _c.allgather_object(obj, name=name, process_set=ps)
