"""Horovod's tensor collectives on torch tensors, built on nbdist.common.

Every op has Horovod's name, signature and defaults. The async forms return a Handle
for `poll()`/`synchronize()`; the sync forms are `synchronize(async form)`. Out-of-place
ops give a fresh tensor and never touch their input; the `_` forms write into it.
allreduce, grouped_allreduce, allgather, broadcast, alltoall and reducescatter are
differentiable, with the gradients Horovod defines.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from nbdist import common as _c
from nbdist.common.engine import blocking
from nbdist.common.ops import (REDUCESCATTER, SPARSE,  # noqa: F401 (handle_... re-exported)
                               handle_average_backwards_compatibility, resolve_op,
                               try_express_allreduce)
from nbdist.common.ops_base import Adasum, Average, Max, Min, Product, ReduceOp, Sum  # noqa: F401 (re-exported)

from . import tensor_util as _tu
from .compression import Compression
from .process_sets import check_process_set, global_process_set


class Handle:
    """An in-flight torch collective: pass it to poll() or synchronize().

    It keeps the tensors the engine reads or writes alive until the op is done, and
    turns the engine's result into what Horovod's synchronize() returns.
    """

    __slots__ = ("inner", "_finish", "_keep", "_state", "_output", "__weakref__")

    def __init__(self, inner, finish: Callable, keep: tuple = ()):
        self.inner = inner
        self._finish = finish
        self._keep = keep
        self._state = "in flight"
        self._output = None

    @classmethod
    def finished(cls, output) -> "Handle":
        """The handle of an op that ran as it was submitted (a small async allreduce the
        express path ran at once): synchronize() returns `output`."""
        handle = cls(None, None)
        handle._state, handle._output = "done", output
        return handle

    def poll(self) -> bool:
        return self._state != "in flight" or bool(_c.poll(self.inner))

    def wait(self):
        if self._state == "done":
            return self._output
        try:
            result = _c.synchronize(self.inner)
        finally:
            self._keep = ()
        self._output = self._finish(result)
        self._state = "done"
        self._finish = None
        return self._output

    def __repr__(self) -> str:
        return f"<nbdist.torch Handle {getattr(self.inner, 'name', '?')!r} {self._state}>"


def poll(handle) -> bool:
    """True when the op behind `handle` is done, so synchronize() will not block."""
    if isinstance(handle, Handle):
        return handle.poll()
    return bool(_c.poll(handle))


def synchronize(handle):
    """Wait for an async op and return its result (raises the op's error on this rank)."""
    if handle is None:
        return None
    if isinstance(handle, Handle):
        return handle.wait()
    return _c.synchronize(handle)


_set_size = _c.process_sets.size_of
_set_rank = _c.process_sets.rank_in


@blocking
def _waited(start: Callable) -> torch.Tensor:
    """Submit an op (start(), a torch Handle) and wait for its result, as a blocking call
    (engine.blocking: the GPU path; a CPU tensor's op goes through the common layer's
    synchronous forms, which do this themselves)."""
    return synchronize(start())


def _differentiable(tensor) -> bool:
    """True when an op on `tensor` must record its gradient (autograd.Function.apply); a
    tensor that needs none (or anything else, which the op rejects) skips apply's cost."""
    return isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled()


def _to_result(like: torch.Tensor) -> Callable:
    return lambda result: _tu.to_tensor(result, like)


def _inplace(tensor: torch.Tensor, what: str, reduction: bool, submit: Callable,
             wait: bool = False):
    """Run `submit(buffer)` so that the result lands in `tensor` itself: a Handle, or with
    `wait` (submit is then a synchronous op) `tensor` once it has the result."""
    _tu.check_tensor(tensor, what, reduction=reduction)
    target = tensor.detach() if tensor.requires_grad else tensor
    staging = _tu.inplace_staging(target)

    def finish(_result):
        if staging is not target:  # a non-contiguous tensor: copy the result back into it
            target.copy_(staging)
        return tensor

    if wait:
        return finish(submit(_tu.as_buffer(staging)))
    return Handle(submit(_tu.as_buffer(staging)), finish, keep=(staging,))


# ---------------------------------------------------------------- allreduce

def _allreduce_submit(tensor, name, op, prescale_factor, postscale_factor, ps=None) -> Handle:
    _tu.check_tensor(tensor, "allreduce", reduction=True)
    if _tu.gpu_direct(tensor):  # NCCL reduces in place: reduce a copy
        out = tensor.detach().clone(memory_format=torch.contiguous_format)
        inner = _c.allreduce_async_(_tu.as_buffer(out), op=op, name=name,
                                    prescale_factor=prescale_factor,
                                    postscale_factor=postscale_factor, process_set=ps)
        return Handle(inner, lambda _result: out, keep=(out,))
    src = _tu.contiguous_input(tensor)
    inner = _c.allreduce_async(_tu.as_buffer(src), op=op, name=name,
                               prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                               process_set=ps)
    return Handle(inner, _to_result(tensor), keep=(src,))


def _allreduce_now(tensor, name, op, prescale_factor, postscale_factor, ps=None) -> torch.Tensor:
    """allreduce's result, waited for: a CPU tensor goes through the common layer's
    synchronous form, which runs an op the response cache knows at once, in this thread."""
    view = _tu.express_view(tensor)
    if view is not None:  # an op the response cache knows may run in one native call
        done = try_express_allreduce(view, op, name, prescale_factor, postscale_factor, ps,
                                     False)
        if done is not None:
            return torch.from_numpy(done)
    _tu.check_tensor(tensor, "allreduce", reduction=True)
    if _tu.gpu_direct(tensor):
        return _waited(lambda: _allreduce_submit(tensor, name, op, prescale_factor,
                                                 postscale_factor, ps))
    src = _tu.contiguous_input(tensor)
    result = _c.allreduce(_tu.as_buffer(src), op=op, name=name, prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor, process_set=ps)
    return _tu.to_tensor(result, tensor)


def _express_async(tensor, op, name, prescale_factor, postscale_factor, process_set,
                   inplace: bool) -> Handle | None:
    """The Handle of a small async allreduce of a plain CPU tensor that the common layer's
    express path took (ASYNC_EXPRESS_BYTES: run at once when every rank is there, else
    waiting as a queued op), or None: nothing was done, the caller submits as usual."""
    view = _tu.express_view(tensor)
    if view is None or view.nbytes > _c.ops.ASYNC_EXPRESS_BYTES:
        return None
    done = try_express_allreduce(view, op, name, prescale_factor, postscale_factor, process_set,
                                 inplace, wait=False)
    if done is None:
        return None
    if done.__class__ is not _c.Handle:  # it ran: the result is there already
        return Handle.finished(tensor if inplace else torch.from_numpy(done))
    if inplace:
        return Handle(done, lambda _result: tensor, keep=(tensor,))
    return Handle(done, torch.from_numpy)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set) -> Handle:
    """Start averaging (or reducing with `op`) `tensor` over all ranks; the input is not changed."""
    op = resolve_op(op, "allreduce_async", average=average)
    handle = _express_async(tensor, op, name, prescale_factor, postscale_factor, process_set,
                            False)
    if handle is not None:
        return handle
    ps = check_process_set(process_set, "allreduce_async")
    return _allreduce_submit(tensor, name, op, prescale_factor, postscale_factor, ps)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set) -> Handle:
    """Start an in-place allreduce: `tensor` holds the result once synchronize() returns."""
    op = resolve_op(op, "allreduce_async_", average=average)
    handle = _express_async(tensor, op, name, prescale_factor, postscale_factor, process_set,
                            True)
    if handle is not None:
        return handle
    ps = check_process_set(process_set, "allreduce_async_")
    return _inplace(tensor, "allreduce_async_", True, lambda buf: _c.allreduce_async_(
        buf, op=op, name=name, prescale_factor=prescale_factor, postscale_factor=postscale_factor,
        process_set=ps))


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set) -> torch.Tensor:
    """In-place allreduce; returns `tensor`. Waited for through the common layer's
    synchronous form (an op the response cache knows may run at once, in this thread)."""
    op = resolve_op(op, "allreduce_", average=average)
    view = _tu.express_view(tensor)
    if view is not None and try_express_allreduce(
            view, op, name, prescale_factor, postscale_factor, process_set, True) is not None:
        return tensor  # (an op the response cache knows, run in one native call)
    ps = check_process_set(process_set, "allreduce_")
    return _inplace(tensor, "allreduce_", True, lambda buf: _c.allreduce_(
        buf, op=op, name=name, prescale_factor=prescale_factor, postscale_factor=postscale_factor,
        process_set=ps), wait=True)


def allreduce_pieces_async_(flat: torch.Tensor, tensors: Sequence[torch.Tensor], name: str,
                            op, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set=global_process_set) -> Handle:
    """Start an in-place allreduce of contiguous CPU `tensors` of one dtype, as of one flat
    tensor of their total size (`flat`): a bucket of gradients reduced where they are, with
    no copy into `flat` and back where the transport can (nbdist.common's
    allreduce_pieces_async_). synchronize() returns True when the result is in `tensors`;
    False when they were packed into `flat` and the result is there. Not Horovod's API:
    the DistributedOptimizer's buckets use it."""
    ps = check_process_set(process_set, "allreduce_async_")
    inner = _c.ops.allreduce_pieces_async_(
        _tu.numpy_view(flat), [_tu.numpy_view(t) for t in tensors], op=op, name=name,
        prescale_factor=prescale_factor, postscale_factor=postscale_factor, process_set=ps)
    return Handle(inner, lambda result: result.__class__ is tuple, keep=(flat, *tensors))


class _Allreduce(torch.autograd.Function):
    """allreduce whose gradient is the same allreduce of the incoming gradient (Horovod)."""

    @staticmethod
    def forward(ctx, tensor, name, op, prescale_factor, postscale_factor, ps):
        ctx.op, ctx.pre, ctx.post, ctx.ps = op, prescale_factor, postscale_factor, ps
        return _allreduce_now(tensor, name, op, prescale_factor, postscale_factor, ps)

    @staticmethod
    def backward(ctx, grad_output):
        grad = synchronize(_allreduce_submit(grad_output, None, ctx.op, ctx.pre, ctx.post, ctx.ps))
        return grad, None, None, None, None, None


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0,
              process_set=global_process_set) -> torch.Tensor:
    """Average (or reduce with `op`) `tensor` over all ranks into a new tensor; differentiable."""
    op = resolve_op(op, "allreduce", average=average)
    ps = check_process_set(process_set, "allreduce")
    compressed, ctx = compression.compress(tensor)
    if _differentiable(compressed):
        reduced = _Allreduce.apply(compressed, name, op, prescale_factor, postscale_factor, ps)
    else:  # what apply() would do, without its cost (most of a small allreduce's time)
        reduced = _allreduce_now(compressed, name, op, prescale_factor, postscale_factor, ps)
    return compression.decompress(reduced, ctx)


# ---------------------------------------------------------------- grouped allreduce

def _check_group(tensors, what: str) -> list:
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
        raise TypeError(f"{what}: expected a list of tensors, got {type(tensors).__name__}")
    tensors = list(tensors)
    if not tensors:
        raise ValueError(f"{what}: the list of tensors is empty")
    for t in tensors:
        _tu.check_tensor(t, what, reduction=True)
    return tensors


def _member(name, index: int):
    return None if name is None else f"{name}.{index}"


def _grouped_submit(tensors, name, op, prescale_factor, postscale_factor, ps=None) -> Handle:
    tensors = _check_group(tensors, "grouped_allreduce")
    if any(_tu.gpu_direct(t) for t in tensors):  # the NCCL path reduces one tensor at a time
        return _ListHandle([_allreduce_submit(t, _member(name, i), op, prescale_factor,
                                              postscale_factor, ps) for i, t in enumerate(tensors)])
    srcs = [_tu.contiguous_input(t) for t in tensors]
    inner = _c.grouped_allreduce_async([_tu.as_buffer(s) for s in srcs], op=op, name=name,
                                       prescale_factor=prescale_factor,
                                       postscale_factor=postscale_factor, process_set=ps)

    def finish(results):
        return [_tu.to_tensor(r, t) for r, t in zip(results, tensors)]

    return Handle(inner, finish, keep=tuple(srcs))


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set) -> Handle:
    """Start one allreduce over a list of tensors; synchronize() returns a list of new tensors."""
    op = resolve_op(op, "grouped_allreduce_async", average=average)
    ps = check_process_set(process_set, "grouped_allreduce_async")
    return _grouped_submit(tensors, name, op, prescale_factor, postscale_factor, ps)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set) -> Handle:
    """Start an in-place grouped allreduce: each tensor holds its result after synchronize()."""
    op = resolve_op(op, "grouped_allreduce_async_", average=average)
    ps = check_process_set(process_set, "grouped_allreduce_async_")
    tensors = _check_group(tensors, "grouped_allreduce_async_")
    if any(_tu.gpu_direct(t) for t in tensors):  # the NCCL path reduces one tensor at a time
        return _ListHandle([allreduce_async_(t, None, _member(name, i), op, prescale_factor,
                                             postscale_factor, ps) for i, t in enumerate(tensors)])
    targets = [t.detach() for t in tensors]
    stagings = [_tu.inplace_staging(t) for t in targets]
    inner = _c.grouped_allreduce_async_([_tu.as_buffer(s) for s in stagings], op=op, name=name,
                                        prescale_factor=prescale_factor,
                                        postscale_factor=postscale_factor, process_set=ps)

    def finish(_results):
        for target, staging in zip(targets, stagings):
            if staging is not target:
                target.copy_(staging)
        return tensors

    return Handle(inner, finish, keep=tuple(stagings))


@blocking
def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set) -> list:
    """In-place grouped allreduce; returns the list of tensors."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


class _GroupedAllreduce(torch.autograd.Function):
    """grouped_allreduce whose gradients are the grouped allreduce of the incoming gradients."""

    @staticmethod
    def forward(ctx, name, op, prescale_factor, postscale_factor, ps, *tensors):
        ctx.op, ctx.pre, ctx.post, ctx.ps = op, prescale_factor, postscale_factor, ps
        return tuple(synchronize(_grouped_submit(list(tensors), name, op, prescale_factor,
                                                 postscale_factor, ps)))

    @staticmethod
    def backward(ctx, *grads):
        reduced = synchronize(_grouped_submit(list(grads), None, ctx.op, ctx.pre, ctx.post,
                                              ctx.ps))
        return (None, None, None, None, None, *reduced)


@blocking
def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0,
                      process_set=global_process_set) -> list:
    """Allreduce a list of tensors as one op (fused); returns new tensors; differentiable."""
    op = resolve_op(op, "grouped_allreduce", average=average)
    ps = check_process_set(process_set, "grouped_allreduce")
    tensors = _check_group(tensors, "grouped_allreduce")
    compressed, ctxs = zip(*[compression.compress(t) for t in tensors])
    reduced = _GroupedAllreduce.apply(name, op, prescale_factor, postscale_factor, ps,
                                      *compressed)
    return [compression.decompress(t, ctx) for t, ctx in zip(reduced, ctxs)]


# ---------------------------------------------------------------- sparse allreduce

class _SparseHandle(Handle):
    """sparse_allreduce_async's handle: call it (as in Horovod) or pass it to synchronize()."""

    __slots__ = ("parts", "_build")

    def __init__(self, parts: list, build: Callable):
        super().__init__(None, None)
        self.parts, self._build = parts, build

    def poll(self) -> bool:
        return all(p.poll() for p in self.parts)

    def wait(self):
        if self._state != "done":
            self._output, self._state = self._build(*_ListHandle(self.parts).wait()), "done"
        return self._output

    __call__ = wait


def sparse_allreduce_async(tensor, name, op, process_set=global_process_set) -> Handle:
    """Start reducing a sparse COO tensor by gathering every rank's indices and values.

    The result (calling the handle, or synchronize(handle)) is a sparse tensor holding
    every rank's entries (duplicates are summed when it is coalesced), divided by the
    number of ranks for Average.
    """
    op = resolve_op(op, "sparse_allreduce_async", kind=SPARSE)
    ps = check_process_set(process_set, "sparse_allreduce_async")
    if not isinstance(tensor, torch.Tensor) or not tensor.is_sparse:
        raise TypeError("sparse_allreduce_async expects a sparse COO tensor "
                        f"(tensor.to_sparse()), got {type(tensor).__name__}")
    # allgather concatenates rows: send the indices as (nnz, sparse_dims) rows
    indices = tensor._indices().transpose(0, 1).contiguous()
    values = tensor._values().contiguous()
    parts = [_allgather_submit(indices, None if name is None else f"{name}.indices", ps),
             _allgather_submit(values, None if name is None else f"{name}.values", ps)]

    def build(all_indices, all_values):
        if op == Average:
            all_values = all_values / _set_size(ps)
        return torch.sparse_coo_tensor(all_indices.transpose(0, 1), all_values, tensor.size(),
                                       check_invariants=False)

    return _SparseHandle(parts, build)


# ---------------------------------------------------------------- allgather

def _allgather_submit(tensor, name, ps=None) -> Handle:
    _tu.check_tensor(tensor, "allgather")
    src = _tu.contiguous_input(tensor)
    inner = _c.allgather_async(_tu.as_buffer(src), name=name, process_set=ps)
    return Handle(inner, _to_result(tensor), keep=(src,))


def allgather_async(tensor, name=None, process_set=global_process_set) -> Handle:
    """Start concatenating every rank's `tensor` along dimension 0 (which may differ per rank)."""
    ps = check_process_set(process_set, "allgather_async")
    return _allgather_submit(tensor, name, ps)


class _Allgather(torch.autograd.Function):
    """allgather whose gradient is this rank's rows of the averaged gradient (Horovod)."""

    @staticmethod
    def forward(ctx, tensor, name, ps):
        ctx.rows, ctx.ps = (tensor.shape[0] if tensor.dim() > 0 else 1), ps
        return _allgather_now(tensor, name, ps)

    @staticmethod
    def backward(ctx, grad_output):
        return _allgather_grad(grad_output, ctx.rows, ctx.ps), None, None


def _allgather_now(tensor, name, ps=None) -> torch.Tensor:
    """allgather's result through the common layer's synchronous form (an op the response
    cache knows may run at once, in this thread)."""
    _tu.check_tensor(tensor, "allgather")
    src = _tu.contiguous_input(tensor)
    return _tu.to_tensor(_c.allgather(_tu.as_buffer(src), name=name, process_set=ps), tensor)


def _allgather_grad(grad_output, rows: int, ps=None):
    """This rank's rows of the gradient averaged over ranks (Horovod's allgather gradient)."""
    averaged = synchronize(_allreduce_submit(grad_output, None, Average, 1.0, 1.0, ps))
    all_rows = synchronize(_allgather_submit(torch.tensor([rows], dtype=torch.int64), None, ps))
    offset = int(all_rows[:_set_rank(ps)].sum().item())
    return averaged.narrow(0, offset, rows)


def allgather(tensor, name=None, process_set=global_process_set) -> torch.Tensor:
    """Concatenate every rank's `tensor` along dimension 0 into a new tensor; differentiable."""
    ps = check_process_set(process_set, "allgather")
    if _differentiable(tensor):
        return _Allgather.apply(tensor, name, ps)
    return _allgather_now(tensor, name, ps)


def grouped_allgather_async(tensors, name=None, process_set=global_process_set) -> Handle:
    """Start an allgather of each tensor in a list; synchronize() returns the list of results."""
    ps = check_process_set(process_set, "grouped_allgather_async")
    handles = [allgather_async(t, name=None if name is None else f"{name}.{i}", process_set=ps)
               for i, t in enumerate(tensors)]
    return _ListHandle(handles)


class _GroupedAllgather(torch.autograd.Function):
    """grouped_allgather: all submitted before any is waited on; each gradient as allgather's."""

    @staticmethod
    def forward(ctx, name, ps, *tensors):
        ctx.rows, ctx.ps = [t.shape[0] if t.dim() > 0 else 1 for t in tensors], ps
        handles = [_allgather_submit(t, _member(name, i), ps) for i, t in enumerate(tensors)]
        return tuple(_ListHandle(handles).wait())

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *[_allgather_grad(g, rows, ctx.ps)
                              for g, rows in zip(grads, ctx.rows)])


@blocking
def grouped_allgather(tensors, name=None, process_set=global_process_set) -> list:
    """Allgather each tensor in a list as one group; differentiable."""
    ps = check_process_set(process_set, "grouped_allgather")
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
        raise TypeError("grouped_allgather: expected a list of tensors, got "
                        f"{type(tensors).__name__}")
    return list(_GroupedAllgather.apply(name, ps, *tensors))


class _ListHandle(Handle):
    """Several torch handles waited on as one."""

    __slots__ = ("parts",)

    def __init__(self, parts: list):
        super().__init__(None, None)
        self.parts = parts

    def poll(self) -> bool:
        return all(p.poll() for p in self.parts)

    def wait(self):
        if self._state != "done":
            errors = []
            outputs = []
            for part in self.parts:  # wait for all, so none is left in flight on error
                try:
                    outputs.append(part.wait())
                except BaseException as exc:  # noqa: BLE001 - re-raised below
                    errors.append(exc)
            if errors:
                raise errors[0]
            self._output, self._state = outputs, "done"
        return self._output


# ---------------------------------------------------------------- broadcast

def _check_root(root_rank, what: str, ps=None) -> int:
    """root_rank (a global rank, as in Horovod) checked against the op's process set."""
    try:
        root = int(root_rank)
    except (TypeError, ValueError):
        raise TypeError(f"{what}: root_rank must be an int, got {root_rank!r}") from None
    _c.ops.check_root(root, what, None if ps is None or ps is global_process_set else ps.ranks)
    return root


def _broadcast_submit(tensor, root_rank, name, ps=None) -> Handle:
    _tu.check_tensor(tensor, "broadcast")
    root = _check_root(root_rank, "broadcast", ps)
    if _tu.gpu_direct(tensor):  # NCCL broadcasts in place: into a copy
        out = tensor.detach().clone(memory_format=torch.contiguous_format)
        inner = _c.broadcast_async_(_tu.as_buffer(out), root, name=name, process_set=ps)
        return Handle(inner, lambda _result: out, keep=(out,))
    src = _tu.contiguous_input(tensor)
    inner = _c.broadcast_async(_tu.as_buffer(src), root, name=name, process_set=ps)
    return Handle(inner, _to_result(tensor), keep=(src,))


def _broadcast_now(tensor, root_rank, name, ps=None) -> torch.Tensor:
    """broadcast's result; a CPU tensor through the common layer's synchronous form (an op
    the response cache knows may run at once, in this thread)."""
    _tu.check_tensor(tensor, "broadcast")
    if _tu.gpu_direct(tensor):
        return _waited(lambda: _broadcast_submit(tensor, root_rank, name, ps))
    root = _check_root(root_rank, "broadcast", ps)
    src = _tu.contiguous_input(tensor)
    return _tu.to_tensor(_c.broadcast(_tu.as_buffer(src), root, name=name, process_set=ps),
                         tensor)


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> Handle:
    """Start sending root_rank's `tensor` to every rank, into a new tensor."""
    ps = check_process_set(process_set, "broadcast_async")
    return _broadcast_submit(tensor, root_rank, name, ps)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set) -> Handle:
    """Start an in-place broadcast: `tensor` holds root_rank's values after synchronize()."""
    ps = check_process_set(process_set, "broadcast_async_")
    root = _check_root(root_rank, "broadcast_async_", ps)
    return _inplace(tensor, "broadcast_async_", False,
                    lambda buf: _c.broadcast_async_(buf, root, name=name, process_set=ps))


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set) -> torch.Tensor:
    """In-place broadcast; returns `tensor`. Waited for through the common layer's
    synchronous form (an op the response cache knows may run at once, in this thread)."""
    ps = check_process_set(process_set, "broadcast_")
    root = _check_root(root_rank, "broadcast_", ps)
    return _inplace(tensor, "broadcast_", False,
                    lambda buf: _c.broadcast_(buf, root, name=name, process_set=ps), wait=True)


class _Broadcast(torch.autograd.Function):
    """broadcast whose gradient is the averaged gradient on the root and zero elsewhere (Horovod)."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name, ps):
        ctx.root, ctx.ps = root_rank, ps
        return _broadcast_now(tensor, root_rank, name, ps)

    @staticmethod
    def backward(ctx, grad_output):
        grad = synchronize(_allreduce_submit(grad_output, None, Average, 1.0, 1.0, ctx.ps))
        if _c.rank() != ctx.root:
            grad.zero_()
        return grad, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set) -> torch.Tensor:
    """root_rank's `tensor` on every rank, as a new tensor; differentiable."""
    ps = check_process_set(process_set, "broadcast")
    if _differentiable(tensor):
        return _Broadcast.apply(tensor, root_rank, name, ps)
    return _broadcast_now(tensor, root_rank, name, ps)


# ---------------------------------------------------------------- alltoall

def _alltoall_submit(tensor, splits, name, ps=None) -> Handle:
    _tu.check_tensor(tensor, "alltoall")
    split_list = _tu.int_list(splits, "alltoall")
    src = _tu.contiguous_input(tensor)
    inner = _c.alltoall_async(_tu.as_buffer(src), splits=split_list, name=name, process_set=ps)

    def finish(result):
        received, received_splits = result
        return (_tu.to_tensor(received, tensor),
                torch.as_tensor(list(map(int, received_splits)), dtype=torch.int32))

    return Handle(inner, finish, keep=(src,))


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set) -> Handle:
    """Start sending splits[p] rows of `tensor` to rank p; synchronize() gives (received, received_splits)."""
    ps = check_process_set(process_set, "alltoall_async")
    return _alltoall_submit(tensor, splits, name, ps)


class _Alltoall(torch.autograd.Function):
    """alltoall whose gradient is the alltoall of the gradient back along the received splits."""

    @staticmethod
    def forward(ctx, tensor, splits, name, ps):
        received, received_splits = synchronize(_alltoall_submit(tensor, splits, name, ps))
        ctx.received_splits, ctx.ps = received_splits, ps
        ctx.mark_non_differentiable(received_splits)
        return received, received_splits

    @staticmethod
    def backward(ctx, grad_output, _grad_splits):
        grad, _ = synchronize(_alltoall_submit(grad_output, ctx.received_splits, None, ctx.ps))
        return grad, None, None, None


@blocking
def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Scatter rows of `tensor` to the ranks and gather theirs; differentiable.

    As in Horovod >= 0.26: returns `received` when splits is None, else
    `(received, received_splits)`.
    """
    ps = check_process_set(process_set, "alltoall")
    received, received_splits = _Alltoall.apply(tensor, splits, name, ps)
    return received if splits is None else (received, received_splits)


# ---------------------------------------------------------------- reducescatter

def _reducescatter_submit(tensor, name, op, prescale_factor, postscale_factor,
                          ps=None) -> Handle:
    _tu.check_tensor(tensor, "reducescatter", reduction=True)
    src = _tu.contiguous_input(tensor)
    inner = _c.reducescatter_async(_tu.as_buffer(src), op=op, name=name,
                                   prescale_factor=prescale_factor,
                                   postscale_factor=postscale_factor, process_set=ps)
    return Handle(inner, _to_result(tensor), keep=(src,))


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set,
                        prescale_factor=1.0, postscale_factor=1.0) -> Handle:
    """Start reducing `tensor` over ranks; rank r gets its share of dimension 0."""
    op = resolve_op(op, "reducescatter_async", kind=REDUCESCATTER)
    ps = check_process_set(process_set, "reducescatter_async")
    return _reducescatter_submit(tensor, name, op, prescale_factor, postscale_factor, ps)


class _Reducescatter(torch.autograd.Function):
    """reducescatter whose gradient is the allgather of the gradient, scaled as Horovod does
    (nbdist.common.ops.reducescatter_grad_scale)."""

    @staticmethod
    def forward(ctx, tensor, name, op, prescale_factor, postscale_factor, ps):
        ctx.scale, ctx.ps = _c.ops.reducescatter_grad_scale(op, prescale_factor, postscale_factor, ps), ps
        return synchronize(_reducescatter_submit(tensor, name, op, prescale_factor,
                                                 postscale_factor, ps))

    @staticmethod
    def backward(ctx, grad_output):
        return _reducescatter_grad(grad_output, ctx.scale, ctx.ps), None, None, None, None, None


def _reducescatter_grad(grad_output, scale: float, ps=None):
    grad = synchronize(_allgather_submit(grad_output, None, ps))
    return grad * scale if scale != 1 else grad


@blocking
def reducescatter(tensor, name=None, compression=Compression.none, op=Average,
                  process_set=global_process_set, prescale_factor=1.0,
                  postscale_factor=1.0) -> torch.Tensor:
    """Reduce `tensor` over ranks and keep this rank's rows, as a new tensor; differentiable."""
    op = resolve_op(op, "reducescatter", kind=REDUCESCATTER)
    ps = check_process_set(process_set, "reducescatter")
    compressed, ctx = compression.compress(tensor)
    out = _Reducescatter.apply(compressed, name, op, prescale_factor, postscale_factor, ps)
    return compression.decompress(out, ctx)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0) -> Handle:
    """Start a reducescatter of each tensor in a list; synchronize() returns the list."""
    return _ListHandle([reducescatter_async(t, None if name is None else f"{name}.{i}", op,
                                            process_set, prescale_factor, postscale_factor)
                        for i, t in enumerate(tensors)])


class _GroupedReducescatter(torch.autograd.Function):
    """grouped_reducescatter: all submitted before any is waited on; gradients as reducescatter's."""

    @staticmethod
    def forward(ctx, name, op, prescale_factor, postscale_factor, ps, *tensors):
        ctx.scale, ctx.ps = _c.ops.reducescatter_grad_scale(op, prescale_factor, postscale_factor, ps), ps
        handles = [_reducescatter_submit(t, _member(name, i), op, prescale_factor,
                                         postscale_factor, ps) for i, t in enumerate(tensors)]
        return tuple(_ListHandle(handles).wait())

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, None, None, None,
                *[_reducescatter_grad(g, ctx.scale, ctx.ps) for g in grads])


@blocking
def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0) -> list:
    """Reducescatter each tensor in a list as one group; differentiable."""
    op = resolve_op(op, "grouped_reducescatter", kind=REDUCESCATTER)
    ps = check_process_set(process_set, "grouped_reducescatter")
    compressed, ctxs = zip(*[compression.compress(t) for t in tensors])
    outs = _GroupedReducescatter.apply(name, op, prescale_factor, postscale_factor, ps,
                                       *compressed)
    return [compression.decompress(o, c) for o, c in zip(outs, ctxs)]


# ---------------------------------------------------------------- control

def join(device=-1) -> int:
    """Mark this rank done with its data; returns the rank that joined last (Horovod's join)."""
    return int(_c.join())


def barrier(process_set=global_process_set) -> None:
    """Wait until every rank reaches this call."""
    _c.barrier(process_set=check_process_set(process_set, "barrier"))
