"""Run nbdist.common collectives on TensorFlow tensors, eagerly or inside a tf.function.

Eagerly a collective is a direct call on the tensors' numpy values. Inside a graph it
becomes two stateful ops: *submit* (hands the arrays to the runtime, returns a handle
id at once) and *wait* (blocks until the result is ready). Splitting them matters:
TensorFlow's executor runs blocking Python ops on a small thread pool, and one op that
both submitted and waited could block the only thread before this rank submitted the
op a peer is waiting for. With the split every submit is cheap, and each new submit in
a graph carries a control dependency on the previous one, so a rank submits in the
order the program traced, and the waits may finish in any order.

A TF1 graph (Session.run) runs only what its fetches need, so its submits cannot be
chained, and its waits are an asynchronous op of our own (native/tf_ops.cpp, loaded by
_wait_op) that holds no inter-op thread while it waits and fails with the TF error type
Horovod's op raises; where that library was not built the numpy_function wait is used.
"""
from __future__ import annotations

import functools
import itertools
import threading
from typing import Callable, Sequence

import numpy as np
import tensorflow as tf

from nbdist.common import errors as _errors

from . import _wait_op

# A submit callable takes numpy arrays and returns a `wait` callable that blocks and
# returns the list of result arrays.
Submit = Callable[..., Callable[[], list]]

_pending: dict[int, Callable[[], list]] = {}
_pending_lock = threading.Lock()
_handle_ids = itertools.count(1)

# The attribute on a FuncGraph that remembers its last submit op (the program order).
_LAST_SUBMIT = "_nbdist_last_submit"


def executing_eagerly() -> bool:
    """True outside any graph being traced (tf.function, Keras' train_function)."""
    return tf.executing_eagerly()


try:  # (private: whether any GradientTape may record now)
    from tensorflow.python.eager.record import could_possibly_record as _tape_may_record
except ImportError:  # pragma: no cover - a TF without it: assume a tape may record
    def _tape_may_record() -> bool:
        return True


def may_record() -> bool:
    """True where a collective may need its gradient: while a graph is traced (tf.gradients
    may ask later), or eagerly under a GradientTape. Elsewhere tf.custom_gradient would
    only cost time (its eager wrapper is most of a small op's time)."""
    return not tf.executing_eagerly() or bool(_tape_may_record())


def to_numpy(value) -> np.ndarray:
    """The numpy value of an eager tensor, variable (tf or Keras 3) or array, to be read
    (not written) by a collective that returns before the tensor could change.

    A CPU tensor's value is a view of its own buffer (EagerTensor._numpy), not the copy
    that .numpy() makes: an eager collective then reads the bytes where they are. A
    variable's read is safe to alias: TensorFlow copies a variable's buffer before an
    assign when a read still holds it."""
    if isinstance(value, np.ndarray):
        return value
    if not isinstance(value, tf.Tensor) or not hasattr(value, "numpy"):
        value = tf.convert_to_tensor(value)  # a variable, a list: its eager tensor
    view = getattr(value, "_numpy", None)  # (private; the copy where TF lacks it)
    return np.asarray(view() if view is not None else value.numpy())


try:  # (private: the eager tensor constructor that tf.convert_to_tensor ends in)
    from tensorflow.python.eager import context as _context
    from tensorflow.python.framework.ops import EagerTensor as EagerTensor
except ImportError:  # pragma: no cover - moved in a later TensorFlow
    EagerTensor = None


def eager_result(array, dtype: tf.DType) -> tf.Tensor:
    """An eager tensor of `dtype` holding `array`, a result array that is ours alone.

    tf.convert_to_tensor copies a numpy array first (the caller might change it later)
    and looks up its conversion function: about half of a small eager collective's time.
    A collective's result is a fresh array no one else holds, so the tensor may take it
    as it is (TensorFlow shares an aligned buffer, copies otherwise)."""
    np_dtype, enum = _dtype_codes(dtype)
    if array.__class__ is not np.ndarray or array.dtype is not np_dtype:
        array = np.asarray(array, dtype=np_dtype)
    if EagerTensor is None or not array.flags.c_contiguous:
        return tf.convert_to_tensor(array)
    ctx = _context.context()
    ctx.ensure_initialized()
    device = ctx.device_name  # '' outside a tf.device scope: TF's default placement
    if not device and not _default_places_on_accelerator():
        device = None  # the host, as '' would place it, without the placing op (~9 µs)
    return EagerTensor(array, device, enum)


@functools.cache  # (DType's properties cost about 0.4 µs each: a small op's tenth)
def _dtype_codes(dtype: tf.DType) -> tuple[np.dtype, int]:
    """`dtype`'s numpy dtype and TF enum."""
    return np.dtype(dtype.as_numpy_dtype), dtype.as_datatype_enum


@functools.cache  # (TF's devices are fixed once it is initialised)
def _default_places_on_accelerator() -> bool:
    """Whether TF places a new tensor outside a tf.device scope on a GPU (or another
    accelerator) rather than the host CPU: whether this process sees any such device."""
    return bool({d.device_type for d in tf.config.list_logical_devices()} - {"CPU"})


def in_xla_context() -> bool:
    """True while tracing a function compiled with XLA (jit_compile=True)."""
    try:
        from tensorflow.python.ops import control_flow_util

        return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))
    except Exception:  # pragma: no cover - private TF helper moved
        return False


# nbdist's collective errors as the TensorFlow error types Horovod's TF ops raise.
_TF_ERROR_OF = (
    (_errors.MismatchError, tf.errors.FailedPreconditionError),
    (_errors.CollectiveTimeoutError, tf.errors.DeadlineExceededError),
    (_errors.AbortedError, tf.errors.AbortedError),
    # bad input, found before anything is sent: TF's kernels say InvalidArgument
    (ValueError, tf.errors.InvalidArgumentError),
    (TypeError, tf.errors.InvalidArgumentError),
)
_CONVERTED = (_errors.CollectiveError, ValueError, TypeError)
_dual_classes: dict = {}


def _dual_class(ours: type, theirs: type) -> type:
    """A class that is both our error and TensorFlow's, so either `except` catches it."""
    cls = _dual_classes.get(ours)
    if cls is None:
        def __init__(self, message):
            theirs.__init__(self, None, None, message)

        cls = type(ours.__name__, (ours, theirs), {"__init__": __init__,
                                                    "__module__": __name__})
        _dual_classes[ours] = cls
    return cls


def tf_error(exc: BaseException) -> BaseException:
    """The exception to raise eagerly for an nbdist error (or bad input) in a TF collective:
    an instance of both our class and TF's (MismatchError and FailedPreconditionError, ...),
    so either `except` catches it.

    Inside a graph (tf.function, a Session) TensorFlow turns whatever a Python op raises
    into UnknownError (ValueError/TypeError into InvalidArgumentError), whatever its class,
    so there the error stays ours and its message reaches the user in TF's.
    """
    for ours, theirs in _TF_ERROR_OF:
        if isinstance(exc, ours) and not isinstance(exc, tf.errors.OpError):
            return _dual_class(ours, theirs)(str(exc))
    return exc


def _is_function_graph(graph) -> bool:
    """True for a tf.function's graph (runs as a whole), False for a TF1 Session graph."""
    try:
        from tensorflow.python.framework.func_graph import FuncGraph
    except ImportError:  # pragma: no cover - private TF module moved
        return True
    return isinstance(graph, FuncGraph)


def _register(wait: Callable[[], list]) -> np.int64:
    with _pending_lock:
        handle = next(_handle_ids)
        _pending[handle] = wait
    return np.int64(handle)


def _take(handle) -> Callable[[], list]:
    with _pending_lock:
        return _pending.pop(int(handle))


def _error_code(exc: BaseException) -> int:
    """The TF error code of what a graph op raises for `exc` (as tf_error would convert it)."""
    if isinstance(exc, tf.errors.OpError):
        return exc.error_code
    for ours, theirs in _TF_ERROR_OF:
        if isinstance(exc, ours):
            return _ERROR_CODES[theirs]
    return tf.errors.UNKNOWN


# Each TF class's code, from TensorFlow itself (not a second table beside _TF_ERROR_OF).
_ERROR_CODES = {theirs: theirs(None, None, "").error_code for _, theirs in _TF_ERROR_OF}


def _wait_for(handle) -> list | tuple[int, str]:
    """What the native wait op calls (on a thread of its own): the results, or the error
    as (TF error code, message), so the graph raises the type Horovod's op would."""
    try:
        return _take(handle)()
    except Exception as exc:
        message = str(exc) if isinstance(exc, _CONVERTED) else f"{type(exc).__name__}: {exc}"
        return _error_code(exc), message


def eager_step(now: Callable[..., np.ndarray], tensor: tf.Tensor, **kwargs) -> tf.Tensor:
    """run()'s eager case for one EagerTensor whose result has its dtype, with nothing
    else to decide: now(array, **kwargs) on its value, the result as an eager tensor. A
    small eager collective (a loss, a metric) spends most of its time in TensorFlow and
    this glue (hence no functools.partial, and the tensor's own _numpy(): to_numpy's)."""
    try:
        result = now(tensor._numpy(), **kwargs)
    except _CONVERTED as exc:
        _raise_as_tf(exc)
    return eager_result(result, tensor.dtype)


def _raise_as_tf(exc: Exception):
    """Raise `exc`, one of nbdist's errors, as the TF error type Horovod's op raises."""
    converted = tf_error(exc)
    if converted is exc:
        raise exc
    raise converted from None


def run(submit: Submit, inputs: Sequence, out_dtypes: Sequence[tf.DType],
        out_shapes: Sequence, what: str, now: Callable[..., list] | None = None) -> list:
    """Run one collective step on `inputs`; returns tensors of `out_dtypes` / `out_shapes`.

    `what` names the operation in error messages (e.g. "allreduce 'grad.dense/kernel'").
    `now(array)`, where given, runs a step of one input eagerly instead of submit: its
    results through nbdist.common's synchronous forms (a cached op may run at once, in this
    thread). Several inputs are always submitted together, then waited for: no rank then
    waits on one op alone while its peers wait on another.
    """
    out_dtypes = [d if d.__class__ is tf.DType else tf.as_dtype(d) for d in out_dtypes]
    if executing_eagerly():
        arrays = [to_numpy(t) for t in inputs]
        try:
            results = (now(arrays[0]) if now is not None and len(arrays) == 1
                       else submit(*arrays)())
        except _CONVERTED as exc:
            _raise_as_tf(exc)
        return [eager_result(r, d) for r, d in zip(results, out_dtypes)]
    if in_xla_context():
        raise RuntimeError(
            f"{what}: nbdist collectives cannot run inside an XLA-compiled function. Compile "
            "the model with model.compile(..., jit_compile=False), or use "
            "@tf.function(jit_compile=False).")

    # Plain Python on numpy arrays: keep autograph from rewriting these.
    @tf.autograph.experimental.do_not_convert
    def _submit(*arrays):
        wait = submit(*arrays)
        # Results in the declared dtypes, C-ordered (what either wait op copies out).
        return _register(lambda: [np.asarray(r, dtype=d.as_numpy_dtype, order="C")
                                  for r, d in zip(wait(), out_dtypes)])

    @tf.autograph.experimental.do_not_convert
    def _wait_results(handle):
        return _take(handle)()

    graph = tf.compat.v1.get_default_graph()
    # Chain the submits of a tf.function, which runs whole. A TF1 graph (Session.run) runs
    # only what a fetch needs: a chain would re-run earlier steps' submits with no wait
    # for them (a name "submitted twice", or an op no peer runs), so there none is kept.
    chained = _is_function_graph(graph)
    previous = getattr(graph, _LAST_SUBMIT, None) if chained else None
    deps = [previous] if previous is not None else []
    with tf.control_dependencies(deps):
        handle = tf.numpy_function(_submit, list(inputs), tf.int64, stateful=True,
                                   name="NbdistSubmit")
    if chained:
        setattr(graph, _LAST_SUBMIT, handle.op)
    wait_op = None if chained or not out_dtypes else _wait_op.wait_op(_wait_for)
    if wait_op is not None:
        # A TF1 graph: the wait must not hold one of the Session's few inter-op threads
        # while this rank has yet to submit what a peer waits for (native/tf_ops.cpp).
        outputs = wait_op(handle, Tout=list(out_dtypes), name="NbdistWait")
    elif not out_dtypes:
        # Nothing comes back (e.g. a check): the wait still has to run for its error.
        @tf.autograph.experimental.do_not_convert
        def _wait_only(h):
            _wait_results(h)
            return np.int64(0)

        done = tf.numpy_function(_wait_only, [handle], tf.int64, stateful=True,
                                 name="NbdistWait")
        return [done]
    else:
        outputs = tf.numpy_function(_wait_results, [handle], list(out_dtypes), stateful=True,
                                    name="NbdistWait")
    outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
    for tensor, shape in zip(outputs, out_shapes):
        tensor.set_shape(shape)
    return outputs
