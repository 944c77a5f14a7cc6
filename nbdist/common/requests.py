"""What a rank submits (Request), what it waits on (Handle), and the agreed answer (Response)."""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import errors
from .ops_base import numpy_dtype

# Kinds of op the engine negotiates.
ALLREDUCE, ALLGATHER, BROADCAST, ALLTOALL, REDUCESCATTER, BARRIER, JOIN = (
    "allreduce", "allgather", "broadcast", "alltoall", "reducescatter", "barrier", "join")


_WAITERS = threading.Lock()  # makes a handle's Event, once, for a thread that must sleep


class Handle:
    """An in-flight op: poll it, or wait for its result (see ops.synchronize).

    Completion is a flag; the Event a sleeping waiter needs is made only when one does.
    Most synchronous ops complete in the thread that waits for them (Engine.drive), so
    the Event (a Condition and two locks, made and set once per op) is rarely needed.
    """

    __slots__ = ("name", "_done", "_event", "_result", "_error", "engine")

    def __init__(self, name: str):
        self.name = name
        self._done = False
        self._event: threading.Event | None = None
        self._result: Any = None
        self._error: BaseException | None = None
        self.engine: Any = None  # set by Engine.submit: the engine that runs the op

    def done(self) -> bool:
        """True once the op finished (successfully or not)."""
        return self._done

    def drive(self) -> None:
        """About to wait: let the waiting thread run the engine's agreement (Engine.drive)."""
        if self.engine is not None and not self._done:
            self.engine.drive(self)

    def _finish(self) -> None:
        # The flag first: a waiter that makes its Event after this read sees the flag
        # when it looks again under _WAITERS; one that made it before is woken here.
        self._done = True
        event = self._event
        if event is not None:
            event.set()

    def set_result(self, result: Any) -> None:
        self._result = result
        self._finish()

    def set_error(self, error: BaseException) -> None:
        if not self._done:
            self._error = error
            self._finish()

    def wait(self, timeout: float | None) -> bool:
        if self._done:
            return True
        event = self._event
        if event is None:
            with _WAITERS:
                if self._event is None:
                    self._event = threading.Event()
                event = self._event
            if self._done:
                return True
        return event.wait(timeout)

    def result(self) -> Any:
        """The op's result; raises the op's error. Call only when done()."""
        if self._error is not None:
            raise self._error
        return self._result

    def __repr__(self) -> str:
        state = "done" if self.done() else "in flight"
        return f"<nbdist Handle {self.name!r} {state}>"


class GroupHandle(Handle):
    """One handle over several ops (grouped_allreduce): done when all are done."""

    __slots__ = ("parts",)

    def __init__(self, name: str, parts: list[Handle]):
        super().__init__(name)
        self.parts = parts

    def done(self) -> bool:
        return all(p.done() for p in self.parts)

    def drive(self) -> None:
        for p in self.parts:
            p.drive()

    def wait(self, timeout: float | None) -> bool:
        for p in self.parts:
            if not p.wait(timeout):
                return False
        return True

    def result(self) -> Any:
        return [p.result() for p in self.parts]


class AutoName(str):
    """The name an unnamed op was given (Engine.auto_name): ranks match such ops by the order
    in which they submit them, which the number in the name encodes."""


@dataclass(eq=False)
class Request:
    """One op submitted on this rank, waiting for the ranks to agree to run it."""

    name: str
    kind: str
    array: np.ndarray | None  # the input, C-contiguous (None for barrier/join)
    inplace: bool  # write the result into `array`
    signature: tuple  # what the coordinator compares across ranks
    handle: Handle
    device: str = "cpu"
    splits: tuple | None = None  # alltoall: rows sent to each rank
    # An in-place allreduce whose data lives in these arrays laid end to end, not in
    # `array` (which then only gives the size and dtype the ranks agree on, and is where
    # the executor packs them when it cannot reduce them where they are): see
    # ops.allreduce_pieces_async_.
    pieces: tuple | None = None
    # The result array made already, by an express attempt that a late peer made wait
    # (see ShmAgreement.express): the executor writes the result there instead of taking
    # a second one, which would leave the buffer pool short and fault fresh memory in on
    # the next call. A broadcast's holds the root's input already.
    out: np.ndarray | None = None
    named: bool = True  # user-named (cacheable by name), or auto-named / uncached
    sent_at: float = 0.0  # when this rank sent it to rank 0 (monotonic clock)

    @property
    def auto_named(self) -> bool:
        """Unnamed (an AutoName): matched with its peers by the order of submission."""
        return self.name.__class__ is AutoName


def signature(kind: str, array: np.ndarray | None, op: int = 0, prescale: float = 1.0,
              postscale: float = 1.0, root: int = -1, device: str = "cpu",
              splits: tuple | None = None) -> tuple:
    """The tuple every rank sends for an op; the coordinator compares these."""
    if array is None:
        return (kind, None, None, op, prescale, postscale, root, device, splits)
    dtype = array.dtype
    name = _DTYPE_NAMES.get(dtype)
    if name is None:  # numpy computes dtype.name in Python: once per dtype is enough
        name = _DTYPE_NAMES[dtype] = dtype.name
    return (kind, name, tuple(array.shape), int(op), float(prescale),
            float(postscale), int(root), device, splits)


_DTYPE_NAMES: dict = {}


# Field positions in a signature tuple.
SIG_KIND, SIG_DTYPE, SIG_SHAPE, SIG_OP, SIG_PRE, SIG_POST, SIG_ROOT, SIG_DEVICE, SIG_SPLITS = range(9)


@dataclass
class Response:
    """What the coordinator tells every rank to run (or to fail), in order.

    A fused allreduce is one Response with several names and shapes.
    """

    kind: str
    names: list[str]
    dtype: str | None = None
    shapes: list[tuple] = field(default_factory=list)  # per name (the agreed shape)
    op: int = 0
    prescale: float = 1.0
    postscale: float = 1.0
    root: int = -1
    device: str = "cpu"
    first_dims: list[list[int]] | None = None  # allgather/alltoall: per name, rows per rank
    splits: list[list[int]] | None = None  # alltoall: splits[src][dst]
    joined: tuple = ()  # ranks that joined (contribute zeros / nothing)
    last_joined: int = -1  # join: the last rank to join
    error: tuple | None = None  # (exception class name, message)
    targets: tuple | None = None  # error: the ranks that must fail it (None: all)
    cache_id: int = -1  # >= 0: every rank caches this response under that id

    def nbytes(self) -> int:
        """Bytes of an allreduce's data, to bound fusion."""
        item = numpy_dtype(self.dtype).itemsize if self.dtype else 0
        return sum(math.prod(s) for s in self.shapes) * item


ERROR_CLASSES = {
    "MismatchError": errors.MismatchError,
    "CollectiveTimeoutError": errors.CollectiveTimeoutError,
    "AbortedError": errors.AbortedError,
    "CollectiveError": errors.CollectiveError,
    "ValueError": ValueError,
}


def make_error(error: tuple) -> BaseException:
    """Turn a response's (class name, message) into the exception to raise."""
    cls_name, message = error
    return ERROR_CLASSES.get(cls_name, errors.CollectiveError)(message)
