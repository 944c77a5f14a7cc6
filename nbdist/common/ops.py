"""The public collectives on numpy arrays (and any buffer-protocol array).

Each op is checked here, before anything is sent, so bad input fails on the rank
that gave it with a TypeError or ValueError; then it is queued on the engine by
name. The `_async` forms return a handle; `synchronize(handle)` waits for it.
"""
from __future__ import annotations

import functools
import warnings
from typing import Any, Sequence

import numpy as np

from . import basics, process_sets
from . import adasum as _adasum
from .ops_base import BFLOAT16, ReduceOp, SUPPORTED_DTYPES, UnsupportedOpError, dtype_name
from .requests import (ALLGATHER, ALLREDUCE, ALLTOALL, BARRIER, BROADCAST, JOIN, REDUCESCATTER,
                       AutoName, GroupHandle, Handle, Request, signature)
from .engine import blocking
from .negotiation import JOIN_NAME


# -- input checks ------------------------------------------------------------------------
def _device_of(obj) -> str:
    if obj.__class__ is np.ndarray:  # the common case, without the attribute lookup
        return "cpu"
    interface = getattr(obj, "__cuda_array_interface__", None)
    if interface is None:
        return "cpu"
    device = getattr(obj, "device", None)
    index = getattr(device, "id", None) if device is not None else None
    return f"cuda:{index if index is not None else 0}"


def as_array(obj: Any, what: str, inplace: bool = False) -> np.ndarray:
    """The numpy view of an op's input, or a clear TypeError/ValueError naming the problem."""
    if obj.__class__ is np.ndarray:  # the common case first: a numpy array is on the CPU
        array = obj
    else:
        if isinstance(obj, (list, tuple)):
            raise TypeError(f"{what} expects a numpy array (or another buffer-protocol array), "
                            f"got a Python {type(obj).__name__}; wrap it with "
                            "numpy.asarray(...)")
        if _device_of(obj) != "cpu":
            raise TypeError(f"{what}: GPU buffers are supported by allreduce_ and broadcast_ "
                            "(in place, through NCCL); move the data to the CPU for this op")
        if isinstance(obj, np.ndarray):  # a subclass (a memmap, say)
            array = obj
        else:
            try:
                view = memoryview(obj)
            except TypeError:
                raise TypeError(f"{what} expects a numpy array or a buffer-protocol object, "
                                f"got {type(obj).__name__}") from None
            if not view.c_contiguous:
                raise ValueError(f"{what}: the buffer is not C-contiguous; pass a contiguous "
                                 "copy")
            array = np.asarray(view)
    dtype = array.dtype
    if dtype not in SUPPORTED_DTYPES:
        if dtype.kind == "O":
            raise TypeError(f"{what}: arrays of Python objects (dtype=object) cannot be sent; "
                            "use broadcast_object / allgather_object for Python objects")
        raise TypeError(f"{what}: dtype {dtype_name(dtype)} is not supported; use one of "
                        + ", ".join(sorted(dtype_name(d) for d in SUPPORTED_DTYPES)))
    flags = array.flags
    if inplace:
        if not flags.c_contiguous:
            raise ValueError(f"{what} (in place) needs a C-contiguous array; this one is a "
                             "strided view: pass numpy.ascontiguousarray(a) and use the result")
        if not flags.writeable:
            raise ValueError(f"{what} (in place) needs a writeable array")
        return array
    # (np.ascontiguousarray would turn a 0-d array into shape (1,))
    return array if flags.c_contiguous else np.ascontiguousarray(array)


class GPUBuffer:
    """The dtype/shape view of a GPU array, for signatures; the array itself is moved by NCCL."""

    def __init__(self, obj, what: str, engine=None):
        transports = (engine or basics.engine()).transports
        if transports.nccl is None:
            reason = getattr(transports, "nccl_reason", "") or "NCCL is not available"
            raise TypeError(f"{what} on a GPU buffer needs the NCCL transport, which is not "
                            f"available here ({reason}); move the data to the CPU")
        self.obj = obj
        torch_dtype = getattr(obj, "dtype", None)
        if type(obj).__module__.startswith("torch"):
            self.dtype_name = str(torch_dtype).replace("torch.", "")
            self.shape = tuple(obj.shape)
            contiguous = obj.is_contiguous()
        else:
            cai = obj.__cuda_array_interface__
            self.dtype_name = np.dtype(cai["typestr"]).name
            self.shape = tuple(cai["shape"])
            contiguous = True  # the NCCL transport checks strides itself
        if not contiguous:
            raise ValueError(f"{what} (in place) needs a contiguous GPU tensor")
        self.device = _device_of(obj)


def _gpu_signature(kind, gpu: GPUBuffer, **sig) -> tuple:
    return (kind, gpu.dtype_name, gpu.shape, int(sig.get("op", 0)), float(sig.get("prescale", 1.0)),
            float(sig.get("postscale", 1.0)), int(sig.get("root", -1)), gpu.device, None)


def _submit_gpu(kind: str, obj, name: str | None, what: str, engine=None, **sig) -> Handle:
    engine = engine or basics.engine()
    gpu = GPUBuffer(obj, what, engine)
    op_name, named = _name(name, kind, engine)
    req = Request(name=op_name, kind=kind, array=obj, inplace=True,
                  signature=_gpu_signature(kind, gpu, **sig), handle=Handle(op_name),
                  device=gpu.device, named=named)
    engine.submit(req)
    return req.handle


def handle_average_backwards_compatibility(op, average):
    """Horovod's rule for the deprecated `average=`: `op` wins, never both, default Average."""
    if op is not None:
        if average is not None:
            raise ValueError("The op parameter supersedes average. Please provide only one of "
                             "them.")
        return op
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed",
                      DeprecationWarning, stacklevel=4)
        return ReduceOp.Average if average else ReduceOp.Sum
    return ReduceOp.Average


# An allreduce of sparse values (gathered, then divided for Average): a `kind` for resolve_op.
SPARSE = "sparse"
# what reducescatter and sparse allreduces can reduce
_SUM_OR_AVERAGE = (ReduceOp.Average, ReduceOp.Sum)


def resolve_op(op, what: str, dtype=None, average=None, kind: str = ALLREDUCE) -> ReduceOp:
    """The reduction op of a collective, or a clear error: the one rule every binding uses.

    `op`/`average` are Horovod's arguments (average= is deprecated: see
    handle_average_backwards_compatibility); `dtype` (None: not known yet) checks what the
    op can reduce; `kind` is ALLREDUCE, or REDUCESCATTER or SPARSE, which accept only
    Average and Sum.
    """
    if average is None and kind == ALLREDUCE and dtype != np.bool_:
        # the common cases, without the enum's constructor: a ReduceOp, or Horovod's
        # default (op=None: Average)
        if op is None:
            return ReduceOp.Average
        if op.__class__ is ReduceOp and op != ReduceOp.Adasum:
            return op
    op = handle_average_backwards_compatibility(op, average)
    try:
        op = ReduceOp(int(op))
    except (TypeError, ValueError):
        raise ValueError(f"{what}: unknown reduction op {op!r}; use Average, Sum, Min, Max, "
                         "Product or Adasum") from None
    if kind != ALLREDUCE and op not in _SUM_OR_AVERAGE:
        thing = "reducescatter" if kind == REDUCESCATTER else "a sparse allreduce"
        raise UnsupportedOpError(f"{what}: {thing} supports op=Average or op=Sum only, "
                                 f"not {op.name}")
    if op == ReduceOp.Adasum:
        if dtype is not None and np.dtype(dtype).kind != "f" and dtype != BFLOAT16:
            raise TypeError(f"{what}: Adasum reduces floating-point arrays only, got "
                            f"{dtype_name(dtype)}")
        return op
    if dtype is not None and dtype == np.bool_:
        raise TypeError(f"{what}: bool arrays cannot be reduced; cast to uint8 (Max = any, "
                        "Min = all)")
    return op


def predivide_factors(op, gradient_predivide_factor: float, what: str) -> tuple[float, float]:
    """(prescale, postscale) for DistributedOptimizer's gradient_predivide_factor f.

    Horovod splits the average: the gradients are scaled by 1/f before the sum and by
    f/size after it (the engine's Average divides by size), so the result is still the
    average and fp16 sums overflow less. Only op=Average can be split so.
    """
    if gradient_predivide_factor == 1.0:
        return 1.0, 1.0
    if op != ReduceOp.Average:
        raise ValueError(f"{what}: gradient_predivide_factor not supported with op != Average")
    return 1.0 / gradient_predivide_factor, float(gradient_predivide_factor)


def reducescatter_grad_scale(op, prescale_factor: float, postscale_factor: float,
                             process_set=None) -> float:
    """The factor on reducescatter's gradient (the allgather of the incoming gradient).

    Horovod treats the op like an allreduce whose backward is the same allreduce of the
    gradient: Sum multiplies by the number of ranks (of the set), Average by 1, and the
    pre/postscale factors apply again.
    """
    ranks = process_sets.size_of(process_set) if int(op) == int(ReduceOp.Sum) else 1
    return prescale_factor * postscale_factor * ranks


def check_root(root_rank, what: str, set_ranks: list | None = None) -> int:
    """The root's index in the op's communicator, or a TypeError/ValueError naming the problem.

    `root_rank` is a global rank, also for a process set (as in Horovod); `set_ranks` are
    the set's global ranks (None: every rank).
    """
    size = basics.size()
    if not isinstance(root_rank, (int, np.integer)) or isinstance(root_rank, bool):
        raise TypeError(f"{what}: root_rank must be an int, got {type(root_rank).__name__}")
    if not 0 <= root_rank < size:
        raise ValueError(f"{what} on rank {basics.rank()}: root_rank {root_rank} is out of "
                         f"range for {size} ranks")
    if set_ranks is None:
        return int(root_rank)
    if root_rank not in set_ranks:
        raise ValueError(f"{what} on rank {basics.rank()}: root_rank {root_rank} is not in "
                         f"the process set {set_ranks}")
    return set_ranks.index(int(root_rank))


_check_root = check_root


class _Uncached(str):
    """A fixed op name whose response is not worth caching (its shape changes each call)."""


def _name(name: str | None, kind: str, engine=None) -> tuple[str, bool]:
    """The op's name, and whether its agreed response may be cached under that name. An
    unnamed op's is an AutoName (given here, or by _op_name before an express attempt)."""
    if name is None:
        name = (engine or basics.engine()).auto_name(kind)
    if name.__class__ is AutoName:
        return name, False
    if not isinstance(name, str) or not name:
        raise TypeError(f"{kind}: name must be a non-empty str, got {name!r}")
    return str(name), not isinstance(name, _Uncached)


def _submit(kind: str, array, name: str | None, inplace: bool = False, engine=None,
            **sig) -> Handle:
    engine = engine or basics.engine()
    op_name, named = _name(name, kind, engine)
    splits = sig.pop("splits", None)
    pieces = sig.pop("pieces", None)
    req = Request(name=op_name, kind=kind, array=array, inplace=inplace,
                  signature=signature(kind, array, splits=splits, **sig),
                  handle=Handle(op_name), splits=splits, pieces=pieces, named=named)
    engine.submit(req)
    return req.handle


class DerivedHandle(Handle):
    """A handle whose result is computed from another op's result (once, when asked)."""

    __slots__ = ("inner", "compute", "_computed")

    def __init__(self, name: str, inner: Handle, compute):
        super().__init__(name)
        self.inner, self.compute, self._computed = inner, compute, False

    def done(self) -> bool:
        return self.inner.done()

    def wait(self, timeout):
        return self.inner.wait(timeout)

    def drive(self) -> None:
        self.inner.drive()

    def result(self):
        if not self._computed:
            self._result = self.compute(self.inner.result())
            self._computed = True
        return self._result


def _adasum_submit(a: np.ndarray, name, engine, prescale: float, postscale: float,
                   inplace: bool, what: str) -> Handle:
    """Adasum as an allgather of every rank's (prescaled) tensor, combined on each rank."""
    size = engine.size
    if not _adasum.is_power_of_two(size):
        raise ValueError(f"{what} on rank {basics.rank()}: op=Adasum needs a power-of-2 "
                         f"number of ranks, this job has {size}")
    flat = a.reshape(1, -1).astype(np.float64) * prescale
    op_name = None if name is None else f"{name}.adasum"
    inner = _submit(ALLGATHER, flat, op_name, engine=engine)

    def compute(gathered):
        out = _adasum.reduce_tree(list(gathered.reshape(size, -1)))
        if postscale != 1.0:
            out *= postscale
        out = out.astype(a.dtype).reshape(a.shape)
        if inplace:
            a[...] = out
            return a
        return out

    return DerivedHandle(inner.name, inner, compute)


# -- waiting --------------------------------------------------------------------------------
def poll(handle: Handle) -> bool:
    """True when the op behind `handle` has finished."""
    return handle.done()


def synchronize(handle: Handle):
    """Wait for an op and return its result (raises its error).

    The wait wakes every 100 ms so Ctrl-C (a notebook interrupt) gets through; an
    interrupted wait aborts this rank's ops on every rank, then re-raises.
    """
    if not isinstance(handle, Handle):
        raise TypeError(f"synchronize expects a handle returned by an *_async op, got "
                        f"{type(handle).__name__}")
    try:
        handle.drive()
        while not handle.wait(0.1):
            pass
    except KeyboardInterrupt:
        _abort_interrupted(handle.name)
        raise
    return handle.result()


def _abort_interrupted(name: str) -> None:
    """Ctrl-C while this rank waited for op `name`: abort its ops on every rank."""
    if basics.is_initialized():
        basics.engine().abort(f"rank {basics.rank()} was interrupted while waiting for "
                              f"'{name}'")


# -- allreduce -----------------------------------------------------------------------------
def _no_native_express(*args) -> None:
    return None


try:
    # The first thing a synchronous allreduce, allgather or broadcast tries: a CPU op the
    # response cache knows (named or not), checked and run in one native call (the shm
    # agreement's express table). None: not that case, nothing was done; a tuple: started,
    # for Python to finish (_resume).
    from nbdist._native import express_allgather as _native_allgather
    from nbdist._native import express_allreduce as _native_allreduce
    from nbdist._native import express_broadcast as _native_broadcast
except ImportError:  # no native module: no shm agreement either
    _native_allreduce = _native_allgather = _native_broadcast = _no_native_express


# An async allreduce, allgather or broadcast of at most this many bytes (this rank's
# input) whose name the response cache knows runs at once in the submitting thread when
# every rank is there (the express table, as the synchronous forms do; else it waits as
# a queued op): handing it to the engine thread costs ~20 µs of Python per op, more than
# moving its bytes, and an op this small has nothing to overlap with (docs/common-api.md,
# "Small async ops run as they are submitted"). Config.async_express_bytes
# (NBDIST_ASYNC_EXPRESS_BYTES), set by init().
ASYNC_EXPRESS_BYTES = 64 * 1024


def _express_first(array, wait: bool) -> bool:
    """Whether an op is one the express path may take before any check: a synchronous one,
    or a small async one on a numpy array (others are checked first, then may take it)."""
    return wait or (array.__class__ is np.ndarray and array.nbytes <= ASYNC_EXPRESS_BYTES)


def _native_done(kind: str, name, array, inplace: bool, done, wait: bool):
    """What a native express call returned (not None): the op's result or, without `wait`,
    its Handle; an op the call started and did not finish is finished by _resume."""
    if done.__class__ is tuple:
        done = _resume(kind, name, array, inplace, done, wait)
    return done if wait else _as_handle(kind, name, done)


def _allreduce(array, op, name: str | None, prescale: float, postscale: float, process_set,
               inplace: bool, wait: bool):
    """Every allreduce form: checks, then the op submitted (its Handle) or, with `wait`, its
    result. A CPU op the response cache knows, waited for or small, may run at once in this
    thread with no Request: in one native call (the express table), else through
    Engine.express."""
    if _express_first(array, wait):  # an op the response cache knows, in one native call
        done = _native_allreduce(array, op, name, prescale, postscale, process_set, inplace)
        if done is not None:
            return _native_done(ALLREDUCE, name, array, inplace, done, wait)
    what = "allreduce_" if inplace else "allreduce"
    engine, _ = process_sets.resolve(process_set, what)
    if inplace and _device_of(array) != "cpu":
        if op == ReduceOp.Adasum:
            raise NotImplementedError("allreduce_: op=Adasum runs on CPU arrays only in nbdist")
        start = functools.partial(_submit_gpu, ALLREDUCE, array, name, what, engine=engine,
                                  op=resolve_op(op, what), prescale=prescale,
                                  postscale=postscale)
        return _waited(start) if wait else start()
    a = as_array(array, what, inplace=inplace)
    op = resolve_op(op, what, a.dtype)
    if op == ReduceOp.Adasum:
        start = functools.partial(_adasum_submit, a, name, engine, prescale, postscale, inplace,
                                  what)
        return _waited(start) if wait else start()
    if prescale == 1.0 and (wait or a.nbytes <= ASYNC_EXPRESS_BYTES):
        name = _op_name(engine, ALLREDUCE, name)
        done = _express(engine, ALLREDUCE, name, a, inplace, op, postscale, wait=wait)
        if done is not None:
            return done
    start = functools.partial(_submit, ALLREDUCE, a, name, inplace=inplace, engine=engine, op=op,
                              prescale=prescale, postscale=postscale)
    return _waited(start) if wait else start()


def _express(engine, kind: str, name, array: np.ndarray, inplace: bool, op=0,
             postscale: float = 1.0, root: int = -1, wait: bool = True):
    """A synchronous op's result through Engine.express (an op the response cache knows, run
    at once in this thread), or None when that path does not apply. Without `wait` (a
    small async op) its Handle: done when the op ran.

    `name` is the op's name; an unnamed op's is given by _op_name first (the caller submits
    the op under that same name when this returns None)."""
    if engine.agreement is None or (name.__class__ is not str and name.__class__ is not AutoName):
        return None
    done = _express_done(name, wait, engine.express, kind, name, array, inplace, op, postscale,
                         root, wait)
    return done if wait or done is None else _as_handle(kind, name, done)


def try_express_allreduce(array, op, name: str | None, prescale: float, postscale: float,
                          process_set, inplace: bool, wait: bool = True):
    """A synchronous allreduce's result through the native express table (torch's first
    try for a plain CPU tensor; _allreduce makes the same call itself), or None when the
    table did not take it: nothing was done, and the caller goes the checked way. Without
    `wait` (a small async allreduce) the result, or the Handle of an op that waits."""
    done = _native_allreduce(array, op, name, prescale, postscale, process_set, inplace)
    if done.__class__ is tuple:  # started there: finished here
        return _resume(ALLREDUCE, name, array, inplace, done, wait)
    return done


def _resume(kind: str, name: str | None, array: np.ndarray, inplace: bool, started: tuple,
            wait: bool = True):
    """The result of an op the native express table started and did not finish (an
    unnamed op was numbered there: its name is the last one given); without `wait`, or
    its Handle when it waits."""
    engine = basics.engine()
    op_name = engine.last_auto_name(kind) if name is None else name
    return _express_done(op_name, wait, engine.express_resume, kind, op_name, array, inplace,
                         started, wait)


def _express_done(name: str, wait: bool, express, *args):
    """express(*args) (Engine.express or express_resume), then, with `wait`, the wait for a
    Handle it returns; a Ctrl-C meanwhile aborts the op on every rank."""
    try:
        done = express(*args)
    except KeyboardInterrupt:
        _abort_interrupted(name)
        raise
    return synchronize(done) if wait and done.__class__ is Handle else done


def _as_handle(kind: str, name, done) -> Handle:
    """An async op's Handle from what the express path gave: its Handle when the op waits,
    else one that is done, holding the result."""
    if done.__class__ is Handle:
        return done
    handle = Handle(kind if name is None else str(name))
    handle.set_result(done)
    return handle


def _op_name(engine, kind: str, name):
    """A synchronous op's name before its express attempt: an unnamed op is numbered now
    (once: _submit keeps an AutoName) where the express path could take it."""
    if name is None and engine.agreement is not None:
        return engine.auto_name(kind)
    return name


@blocking
def _waited(start):
    """Submit an op (start()) and wait for its result, as a blocking call (engine.blocking)."""
    return synchronize(start())


def allreduce_async(array, op=ReduceOp.Average, name: str | None = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set=None) -> Handle:
    """Start an allreduce; the result is a new array."""
    return _allreduce(array, op, name, prescale_factor, postscale_factor, process_set,
                      inplace=False, wait=False)


def allreduce_async_(array, op=ReduceOp.Average, name: str | None = None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set=None) -> Handle:
    """Start an allreduce that writes its result into `array` (a GPU array goes through NCCL)."""
    return _allreduce(array, op, name, prescale_factor, postscale_factor, process_set,
                      inplace=True, wait=False)


def allreduce(array, op=ReduceOp.Average, name: str | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set=None) -> np.ndarray:
    """Reduce `array` over all ranks (Average by default); returns a new array."""
    return _allreduce(array, op, name, prescale_factor, postscale_factor, process_set,
                      inplace=False, wait=True)


def allreduce_(array, op=ReduceOp.Average, name: str | None = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set=None) -> np.ndarray:
    """Reduce `array` over all ranks in place; returns `array`."""
    return _allreduce(array, op, name, prescale_factor, postscale_factor, process_set,
                      inplace=True, wait=True)


def _group_names(name: str | None, count: int) -> list[str | None]:
    if name is None:
        return [None] * count
    return [f"{name}.{i}" for i in range(count)]


def allreduce_pieces_async_(flat: np.ndarray, pieces: Sequence[np.ndarray], op=ReduceOp.Average,
                            name: str | None = None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0, process_set=None) -> Handle:
    """Start an in-place allreduce of `pieces` as of one array laid end to end (a bucket of
    gradients), without packing them into one first where the transport can reduce them
    where they are.

    The ranks agree on `flat`: a 1-d CPU array of the pieces' dtype and total size. The
    handle's result is the tuple of pieces when they hold the result; otherwise they
    were packed into `flat`, which holds it, and the result is `flat` (the caller copies
    it out). Not part of Horovod's API: nbdist.torch's DistributedOptimizer uses it.
    """
    what = "allreduce_pieces_async_"
    engine, _ = process_sets.resolve(process_set, what)
    if _device_of(flat) != "cpu":
        raise ValueError(f"{what} on rank {basics.rank()}: CPU arrays only")
    a = as_array(flat, what, inplace=True)
    op = resolve_op(op, what, a.dtype)
    parts = tuple(pieces)
    if (a.ndim != 1 or op == ReduceOp.Adasum
            or sum(p.size for p in parts) != a.size
            or any(p.__class__ is not np.ndarray or p.dtype != a.dtype or not p.flags.c_contiguous
                   or not p.flags.writeable for p in parts)):
        raise ValueError(f"{what} on rank {basics.rank()}: expected writeable C-contiguous CPU "
                         f"arrays of {a.dtype} adding up to the 1-d flat array of {a.size} "
                         "elements, and an op other than Adasum")
    if 0 < a.nbytes <= ASYNC_EXPRESS_BYTES:
        # A small bucket (a small model's gradients, all of them): packed into `flat` (a copy
        # of at most 64 KiB), it is one small async allreduce, which may run as it is
        # submitted; its result is `flat` either way.
        np.concatenate([p.reshape(-1) for p in parts], out=a)
        return _allreduce(a, op, name, prescale_factor, postscale_factor, process_set, True,
                          False)
    return _submit(ALLREDUCE, a, name, inplace=True, engine=engine, op=op,
                   prescale=prescale_factor, postscale=postscale_factor, pieces=parts)


def grouped_allreduce_async(arrays: Sequence, op=ReduceOp.Average, name: str | None = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            _inplace: bool = False, process_set=None) -> Handle:
    """Start allreduces of several arrays at once (fused together); one handle, a list result."""
    if isinstance(arrays, np.ndarray) or not isinstance(arrays, (list, tuple)):
        raise TypeError("grouped_allreduce expects a list of arrays")
    start = allreduce_async_ if _inplace else allreduce_async
    parts = [start(a, op, n, prescale_factor, postscale_factor, process_set)
             for a, n in zip(arrays, _group_names(name, len(arrays)))]
    return GroupHandle(name or "grouped_allreduce", parts)


def grouped_allreduce_async_(arrays: Sequence, op=ReduceOp.Average, name: str | None = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set=None) -> Handle:
    """In-place form of grouped_allreduce_async."""
    return grouped_allreduce_async(arrays, op, name, prescale_factor, postscale_factor, True,
                                   process_set)


@blocking
def grouped_allreduce(arrays: Sequence, op=ReduceOp.Average, name: str | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set=None) -> list:
    """Allreduce several arrays at once; returns a list of new arrays."""
    return synchronize(grouped_allreduce_async(arrays, op, name, prescale_factor, postscale_factor,
                                               process_set=process_set))


@blocking
def grouped_allreduce_(arrays: Sequence, op=ReduceOp.Average, name: str | None = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set=None) -> list:
    """Allreduce several arrays in place; returns them."""
    return synchronize(grouped_allreduce_async_(arrays, op, name, prescale_factor,
                                                postscale_factor, process_set))


# -- allgather, broadcast, alltoall, reducescatter ---------------------------------------------
def _allgather(array, name: str | None, process_set, wait: bool):
    """Both allgather forms, as _allreduce: checks, then the Handle or, with `wait`, the
    result (a cached op may run at once in this thread: in one native call, the express
    table, else through Engine.express)."""
    if _express_first(array, wait):
        done = _native_allgather(array, name, process_set)
        if done is not None:
            return _native_done(ALLGATHER, name, array, False, done, wait)
    engine, _ = process_sets.resolve(process_set, "allgather")
    a = as_array(array, "allgather")
    if a.ndim == 0:
        a = a.reshape(1)
    if wait or a.nbytes <= ASYNC_EXPRESS_BYTES:
        name = _op_name(engine, ALLGATHER, name)
        done = _express(engine, ALLGATHER, name, a, False, wait=wait)
        if done is not None:
            return done
    start = functools.partial(_submit, ALLGATHER, a, name, engine=engine)
    return _waited(start) if wait else start()


def allgather_async(array, name: str | None = None, process_set=None) -> Handle:
    """Start an allgather: every rank's array concatenated on the first dimension."""
    return _allgather(array, name, process_set, wait=False)


def allgather(array, name: str | None = None, process_set=None) -> np.ndarray:
    """Concatenate every rank's array along the first dimension (which may differ per rank)."""
    return _allgather(array, name, process_set, wait=True)


def _broadcast(array, root_rank: int, name: str | None, process_set, inplace: bool,
               wait: bool):
    """Every broadcast form, as _allreduce: checks, then the Handle or, with `wait`, the
    result (a cached CPU op may run at once in this thread: in one native call, the express
    table, else through Engine.express)."""
    if _express_first(array, wait):
        done = _native_broadcast(array, root_rank, name, process_set, inplace)
        if done is not None:
            return _native_done(BROADCAST, name, array, inplace, done, wait)
    what = "broadcast_" if inplace else "broadcast"
    engine, ranks = process_sets.resolve(process_set, what)
    root = _check_root(root_rank, what, ranks)
    if inplace and _device_of(array) != "cpu":
        start = functools.partial(_submit_gpu, BROADCAST, array, name, what, engine=engine,
                                  root=root)
        return _waited(start) if wait else start()
    a = as_array(array, what, inplace=inplace)
    if wait or a.nbytes <= ASYNC_EXPRESS_BYTES:
        name = _op_name(engine, BROADCAST, name)
        done = _express(engine, BROADCAST, name, a, inplace, root=root, wait=wait)
        if done is not None:
            return done
    start = functools.partial(_submit, BROADCAST, a, name, inplace=inplace, engine=engine,
                              root=root)
    return _waited(start) if wait else start()


def broadcast_async(array, root_rank: int, name: str | None = None,
                    process_set=None) -> Handle:
    """Start a broadcast from root_rank (a global rank); the result is a new array."""
    return _broadcast(array, root_rank, name, process_set, inplace=False, wait=False)


def broadcast_async_(array, root_rank: int, name: str | None = None,
                     process_set=None) -> Handle:
    """Start a broadcast from root_rank into `array` (a GPU array goes through NCCL)."""
    return _broadcast(array, root_rank, name, process_set, inplace=True, wait=False)


def broadcast(array, root_rank: int, name: str | None = None, process_set=None) -> np.ndarray:
    """root_rank's array on every rank; returns a new array."""
    return _broadcast(array, root_rank, name, process_set, inplace=False, wait=True)


def broadcast_(array, root_rank: int, name: str | None = None, process_set=None) -> np.ndarray:
    """root_rank's array written into `array` on every rank; returns `array`."""
    return _broadcast(array, root_rank, name, process_set, inplace=True, wait=True)


def alltoall_async(array, splits=None, name: str | None = None, process_set=None) -> Handle:
    """Start an alltoall; the result is (received array, received splits)."""
    engine, _ = process_sets.resolve(process_set, "alltoall")
    a = as_array(array, "alltoall")
    if a.ndim == 0:
        raise ValueError("alltoall needs an array with at least one dimension")
    size = engine.size
    if splits is None:
        if a.shape[0] % size:
            raise ValueError(f"alltoall: the first dimension ({a.shape[0]}) does not divide "
                             f"evenly by {size} ranks; pass splits=")
        splits = [a.shape[0] // size] * size
    splits = np.asarray(splits).reshape(-1)
    if splits.dtype.kind not in "iu" or len(splits) != size or (splits < 0).any():
        raise ValueError(f"alltoall: splits must be {size} non-negative ints (one per rank), "
                         f"got {splits.tolist()}")
    if int(splits.sum()) != a.shape[0]:
        raise ValueError(f"alltoall: splits sum to {int(splits.sum())} but the first "
                         f"dimension is {a.shape[0]}")
    return _submit(ALLTOALL, a, name, engine=engine, splits=tuple(int(s) for s in splits))


@blocking
def alltoall(array, splits=None, name: str | None = None, process_set=None):
    """Send splits[p] rows to rank p; returns (received rows in rank order, received splits)."""
    return synchronize(alltoall_async(array, splits, name, process_set))


def reducescatter_async(array, op=ReduceOp.Average, name: str | None = None,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                        process_set=None) -> Handle:
    """Start a reduce-scatter over the first dimension."""
    engine, _ = process_sets.resolve(process_set, "reducescatter")
    a = as_array(array, "reducescatter")
    if a.ndim == 0:
        raise ValueError("reducescatter needs an array with at least one dimension")
    op = resolve_op(op, "reducescatter", a.dtype, kind=REDUCESCATTER)
    return _submit(REDUCESCATTER, a, name, engine=engine, op=op, prescale=prescale_factor,
                   postscale=postscale_factor)


@blocking
def reducescatter(array, op=ReduceOp.Average, name: str | None = None,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                  process_set=None) -> np.ndarray:
    """Reduce over ranks and keep this rank's share of the first dimension."""
    return synchronize(reducescatter_async(array, op, name, prescale_factor, postscale_factor,
                                           process_set))


# -- synchronization and objects -----------------------------------------------------------
@blocking
def barrier(process_set=None) -> None:
    """Wait until every rank (of the process set) reaches this barrier."""
    engine, _ = process_sets.resolve(process_set, "barrier")
    synchronize(_submit(BARRIER, None, None, engine=engine))


@blocking
def join() -> int:
    """This rank is out of data: take part in the others' allreduces with zeros until all join.

    Returns the rank that joined last.
    """
    engine = basics.engine()
    req = Request(name=JOIN_NAME, kind=JOIN, array=None, inplace=False,
                  signature=signature(JOIN, None), handle=Handle(JOIN_NAME), named=False)
    engine.submit(req)
    last = synchronize(req.handle)
    engine.joined_all()
    return last


def _pickle(obj) -> np.ndarray:
    import cloudpickle

    return np.frombuffer(cloudpickle.dumps(obj), dtype=np.uint8)


def _unpickle(data: np.ndarray):
    import pickle

    return pickle.loads(data.tobytes())


@blocking
def broadcast_object(obj, root_rank: int = 0, name: str | None = None, process_set=None):
    """root_rank's Python object on every rank (serialized with cloudpickle)."""
    _, ranks = process_sets.resolve(process_set, "broadcast_object")
    _check_root(root_rank, "broadcast_object", ranks)
    is_root = basics.rank() == root_rank
    # A fixed default name (as Horovod's), not a numbered one: ranks that ran different
    # numbers of unnamed ops (a joined rank skipped some) must still agree on it.
    base = name or "broadcast_object"
    payload = _pickle(obj) if is_root else np.empty(0, np.uint8)
    size = broadcast(np.array([payload.size], np.int64), root_rank, name=f"{base}.size",
                     process_set=process_set)
    data = payload if is_root else np.empty(int(size[0]), np.uint8)
    # the payload's size differs per call: caching its response would only fill the cache
    received = broadcast(data, root_rank, name=_Uncached(f"{base}.data"),
                         process_set=process_set)
    return obj if is_root else _unpickle(received)


@blocking
def allgather_object(obj, name: str | None = None, process_set=None) -> list:
    """Every rank's Python object, as a list in rank order."""
    base = name or "allgather_object"  # fixed, as broadcast_object's
    payload = _pickle(obj)
    sizes = allgather(np.array([payload.size], np.int64), name=f"{base}.sizes",
                      process_set=process_set)
    data = allgather(payload, name=_Uncached(f"{base}.data"), process_set=process_set)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    return [_unpickle(data[offsets[i]:offsets[i + 1]]) for i in range(len(sizes))]


def abort(reason: str) -> None:
    """Fail every in-flight op on every rank with `reason`; the runtime stays usable."""
    if basics.is_initialized():
        basics.engine().abort(reason)
