"""Horovod's collectives on tf.Tensor / tf.Variable, eager and in tf.function, differentiable.

Each collective is a raw step (nbdist.common through _bridge) wrapped in
tf.custom_gradient with Horovod's gradient rules:
  allreduce        -> allreduce of the gradient, same op and scale factors
  grouped_allreduce-> grouped allreduce of the gradients
  allgather        -> average of the gradient over ranks, this rank's rows of it
  broadcast        -> average of the gradient on the root, zeros elsewhere
  alltoall         -> alltoall of the gradient back with the received splits
  reducescatter    -> allgather of the gradient (times size for Sum)
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from nbdist import common as _c
from nbdist.common import ops as _ops
from nbdist.common import process_sets as _ps

from . import _bridge, _naming
from .compression import Compression

Average, Sum, Adasum, Min, Max, Product = (_c.Average, _c.Sum, _c.Adasum, _c.Min, _c.Max,
                                           _c.Product)
_DIFFERENTIABLE_REDUCTIONS = (int(_c.Average), int(_c.Sum))


# -- argument handling ---------------------------------------------------------------------
def check_process_set(process_set, what: str):
    """The op's process set (None for the global one), checked by nbdist.common.

    A set that is not registered, or does not hold this rank, is Horovod's
    InvalidArgumentError (also a ValueError), raised when the op is built.
    """
    try:
        _ps.resolve(process_set, what)
    except (ValueError, TypeError) as exc:
        raise _bridge.tf_error(exc) from None
    return None if _ps.is_global(process_set) else process_set


def _tensor(value, what: str) -> tf.Tensor:
    if isinstance(value, tf.IndexedSlices):
        raise TypeError(f"{what}: tf.IndexedSlices is not supported here; densify it with "
                        "tf.convert_to_tensor first")
    return tf.convert_to_tensor(value)


def _same_shape(tensors) -> list:
    return [t.shape for t in tensors]


def _rows_shape(tensor, rows=None) -> tf.TensorShape:
    return tf.TensorShape([rows]).concatenate(tensor.shape[1:]) if tensor.shape.rank else \
        tf.TensorShape(None)


def _check_grad_op(op, what: str) -> None:
    if int(op) not in _DIFFERENTIABLE_REDUCTIONS:
        raise NotImplementedError(f"{what}: the gradient is defined for op=Average and op=Sum "
                                  f"only, not {_c.ReduceOp(int(op)).name}")


# -- raw steps (no gradient) ----------------------------------------------------------------
def _raw_allreduce(tensors, op, prescale, postscale, names, ps=None) -> list:
    def submit(*arrays):
        handles = [_c.allreduce_async(a, op=op, name=n, prescale_factor=prescale,
                                      postscale_factor=postscale, process_set=ps)
                   for a, n in zip(arrays, names)]
        return lambda: [_c.synchronize(h) for h in handles]

    def now(array):
        return [_c.allreduce(array, op=op, name=names[0], prescale_factor=prescale,
                             postscale_factor=postscale, process_set=ps)]

    return _bridge.run(submit, tensors, [t.dtype for t in tensors], _same_shape(tensors),
                       f"allreduce {names[0]!r}", now)


def _raw_allgather(tensors, names, ps=None) -> list:
    def submit(*arrays):
        handles = [_c.allgather_async(a, name=n, process_set=ps) for a, n in zip(arrays, names)]
        return lambda: [_c.synchronize(h) for h in handles]

    def now(array):
        return [_c.allgather(array, name=names[0], process_set=ps)]

    return _bridge.run(submit, tensors, [t.dtype for t in tensors],
                       [_rows_shape(t) for t in tensors], f"allgather {names[0]!r}", now)


def _raw_broadcast(tensors, root_rank, names, ps=None) -> list:
    def submit(*arrays):
        handles = [_c.broadcast_async(a, root_rank, name=n, process_set=ps)
                   for a, n in zip(arrays, names)]
        return lambda: [_c.synchronize(h) for h in handles]

    def now(array):
        return [_c.broadcast(array, root_rank, name=names[0], process_set=ps)]

    return _bridge.run(submit, tensors, [t.dtype for t in tensors], _same_shape(tensors),
                       f"broadcast {names[0]!r}", now)


def _raw_alltoall(tensor, splits, name, ps=None):
    inputs = [tensor] if splits is None else [tensor, splits]

    def submit(array, split_array=None):
        handle = _c.alltoall_async(array, splits=split_array, name=name, process_set=ps)

        def wait():
            received, received_splits = _c.synchronize(handle)
            return [received, np.asarray(received_splits, dtype=np.int32)]
        return wait

    out, received_splits = _bridge.run(submit, inputs, [tensor.dtype, tf.int32],
                                       [_rows_shape(tensor), tf.TensorShape([_ps.size_of(ps)])],
                                       f"alltoall {name!r}")
    return out, received_splits


def _share(rows, size, rank):
    """Rows of a reducescatter result on `rank`: the first len % size ranks get one more."""
    return None if rows is None else rows // size + (1 if rank < rows % size else 0)


def _raw_reducescatter(tensor, op, prescale, postscale, name, ps=None):
    def submit(array):
        handle = _c.reducescatter_async(array, op=op, name=name, prescale_factor=prescale,
                                        postscale_factor=postscale, process_set=ps)
        return lambda: [_c.synchronize(handle)]

    rows = tensor.shape[0] if tensor.shape.rank else None
    shape = _rows_shape(tensor, _share(rows, _ps.size_of(ps), _ps.rank_in(ps)))
    return _bridge.run(submit, [tensor], [tensor.dtype], [shape], f"reducescatter {name!r}")[0]


# -- differentiable collectives -------------------------------------------------------------
def _allreduce_dense(tensors, op, prescale, postscale, names, ps=None) -> list:
    if not _bridge.may_record():  # no gradient can be asked for: the raw step alone
        return _raw_allreduce(tensors, op, prescale, postscale, names, ps)

    @tf.custom_gradient
    def reduce(*xs):
        ys = _raw_allreduce(list(xs), op, prescale, postscale, names, ps)

        def grad(*dys):
            _check_grad_op(op, "allreduce")
            dys = [tf.zeros_like(x) if dy is None else tf.convert_to_tensor(dy)
                   for x, dy in zip(xs, dys)]
            return _allreduce_dense(dys, op, prescale, postscale,
                                    [_naming.gradient(n, dy) for n, dy in zip(names, dys)], ps)
        return ys, grad

    out = reduce(*tensors)
    return list(out) if isinstance(out, (list, tuple)) else [out]


def _check_sparse(op, prescale, postscale) -> None:
    """What Horovod refuses for tf.IndexedSlices, before anything is sent."""
    _ops.resolve_op(op, "allreduce of tf.IndexedSlices", kind=_ops.SPARSE)
    if prescale != 1.0 or postscale != 1.0:
        raise NotImplementedError("prescale_factor/postscale_factor are not supported with "
                                  "tf.IndexedSlices (as in Horovod)")


def _allreduce_sparse(slices: tf.IndexedSlices, op, prescale, postscale, name, ps=None):
    """An allreduce of IndexedSlices: allgather values and indices (Horovod's way)."""
    _check_sparse(op, prescale, postscale)
    values, indices = _raw_allgather([slices.values, slices.indices],
                                     [_naming.derived(name, "values"),
                                      _naming.derived(name, "indices")], ps)
    if int(op) == int(Average):
        # TF's division: integer values become float64 (uint8 / 2 is not rounded to 0)
        values = values / tf.cast(_ps.size_of(ps), values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


def allreduce(tensor, average=None, device_dense="", device_sparse="",
              compression=Compression.none, op=None, prescale_factor=1.0, postscale_factor=1.0,
              name=None, process_set=None, ignore_name_scope=False):
    """Reduce a tensor (or tf.IndexedSlices) over all ranks; Average by default."""
    op = _ops.resolve_op(op, "allreduce", average=average)
    ps = check_process_set(process_set, "allreduce")
    if tensor.__class__ is _bridge.EagerTensor and compression is Compression.none and \
            not _bridge.may_record():  # eager, no tape: the step alone, no graph glue
        return _bridge.eager_step(
            _c.allreduce, tensor, op=op, name=_naming.default_name("Allreduce", tensor, name),
            prescale_factor=prescale_factor, postscale_factor=postscale_factor,
            process_set=ps)
    if isinstance(tensor, tf.IndexedSlices):
        return _allreduce_sparse(tensor, op, prescale_factor, postscale_factor,
                                 _naming.default_name("Allgather", tensor.values, name), ps)
    if not isinstance(tensor, tf.Tensor):  # (an eager tensor as it is: the common case)
        tensor = tf.convert_to_tensor(tensor)
    compressed, ctx = compression.compress(tensor)
    reduced = _allreduce_dense([compressed], op, prescale_factor, postscale_factor,
                               [_naming.default_name("Allreduce", tensor, name)], ps)[0]
    return compression.decompress(reduced, ctx)


def grouped_allreduce(tensors, average=None, device_dense="", device_sparse="",
                      compression=Compression.none, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, name=None, process_set=None):
    """Reduce a list of tensors over all ranks in one fused step; returns a list."""
    op = _ops.resolve_op(op, "grouped_allreduce", average=average)
    ps = check_process_set(process_set, "grouped_allreduce")
    tensors = list(tensors)
    if not tensors:
        return []
    if any(isinstance(t, tf.IndexedSlices) for t in tensors):
        _check_sparse(op, prescale_factor, postscale_factor)
    if name is None and not tf.executing_eagerly():
        first, last = (t.values if isinstance(t, tf.IndexedSlices) else t
                       for t in (tensors[0], tensors[-1]))
        name = f"HorovodGroupedAllreduce_{first.name}_{last.name}_{len(tensors)}"
    results: list = [None] * len(tensors)
    dense_at = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    for i, t in enumerate(tensors):
        if isinstance(t, tf.IndexedSlices):
            results[i] = _allreduce_sparse(t, op, prescale_factor, postscale_factor,
                                           _naming.derived(name, f"sparse{i}"), ps)
    if dense_at:
        dense = [tf.convert_to_tensor(tensors[i]) for i in dense_at]
        packed = [compression.compress(t) for t in dense]
        names = [_naming.derived(_naming.clean(name) if name else None, str(i)) for i in dense_at]
        reduced = _allreduce_dense([p for p, _ in packed], op, prescale_factor,
                                   postscale_factor, names, ps)
        for i, r, (_, ctx) in zip(dense_at, reduced, packed):
            results[i] = compression.decompress(r, ctx)
    return results


def allgather(tensor, name=None, ignore_name_scope=False, process_set=None):
    """Concatenate every rank's tensor along the first dimension (which may differ)."""
    ps = check_process_set(process_set, "allgather")
    tensor = _tensor(tensor, "allgather")
    op_name = _naming.default_name("Allgather", tensor, name)
    if not _bridge.may_record():
        return _raw_allgather([tensor], [op_name], ps)[0]

    @tf.custom_gradient
    def gather(x):
        y = _raw_allgather([x], [op_name], ps)[0]

        def grad(dy):
            dy = tf.convert_to_tensor(dy)
            rows_name = _naming.gradient(op_name, dy, "grad.rows")
            dy = _allreduce_dense([dy], Average, 1.0, 1.0, [_naming.gradient(op_name, dy)], ps)[0]
            rows = tf.reshape(tf.shape(x, out_type=tf.int64)[0], [1])
            all_rows = _raw_allgather([rows], [rows_name], ps)[0]
            return tf.split(dy, all_rows, num=_ps.size_of(ps), axis=0)[_ps.rank_in(ps)]
        return y, grad

    return gather(tensor)


def broadcast(tensor, root_rank, name=None, ignore_name_scope=False, process_set=None):
    """root_rank's tensor on every rank."""
    ps = check_process_set(process_set, "broadcast")
    tensor = _tensor(tensor, "broadcast")
    op_name = _naming.default_name("Broadcast", tensor, name)
    if not _bridge.may_record():
        return _raw_broadcast([tensor], root_rank, [op_name], ps)[0]

    @tf.custom_gradient
    def bcast(x):
        y = _raw_broadcast([x], root_rank, [op_name], ps)[0]

        def grad(dy):
            dy = tf.convert_to_tensor(dy)
            reduced = _allreduce_dense([dy], Average, 1.0, 1.0,
                                       [_naming.gradient(op_name, dy)], ps)[0]
            if _c.rank() == root_rank:
                return reduced
            # zeros_like alone would not run the allreduce in a graph (its shape is
            # known), and the root would wait for this rank
            with tf.control_dependencies([reduced]):
                return tf.zeros_like(reduced)
        return y, grad

    return bcast(tensor)


def alltoall(tensor, splits=None, name=None, ignore_name_scope=False, process_set=None):
    """Send splits[p] rows of `tensor` to rank p; returns what arrived (and its splits).

    As in Horovod, the received splits come back only when `splits` was given.
    """
    ps = check_process_set(process_set, "alltoall")
    tensor = _tensor(tensor, "alltoall")
    op_name = _naming.default_name("Alltoall", tensor, name)
    split_tensor = None if splits is None else tf.cast(tf.convert_to_tensor(splits), tf.int32)

    @tf.custom_gradient
    def exchange(x):
        out, received = _raw_alltoall(x, split_tensor, op_name, ps)

        def grad(dy, _dsplits=None):
            dy = tf.convert_to_tensor(dy)
            back, _ = _raw_alltoall(dy, received, _naming.gradient(op_name, dy), ps)
            return back
        return (out, received), grad

    out, received = exchange(tensor)
    return (out, received) if splits is not None else out


def reducescatter(tensor, op=None, name=None, ignore_name_scope=False, process_set=None,
                  prescale_factor=1.0, postscale_factor=1.0, average=None):
    """Reduce over ranks, then give rank r its share of the first dimension."""
    op = _ops.resolve_op(op, "reducescatter", average=average, kind=_ops.REDUCESCATTER)
    ps = check_process_set(process_set, "reducescatter")
    tensor = _tensor(tensor, "reducescatter")
    op_name = _naming.default_name("Reducescatter", tensor, name)

    @tf.custom_gradient
    def scatter(x):
        y = _raw_reducescatter(x, op, prescale_factor, postscale_factor, op_name, ps)

        def grad(dy):
            _check_grad_op(op, "reducescatter")
            dy = tf.convert_to_tensor(dy)
            scale = _ops.reducescatter_grad_scale(op, prescale_factor, postscale_factor, ps)
            if scale != 1.0:
                dy = dy * tf.cast(scale, dy.dtype)
            return _raw_allgather([dy], [_naming.gradient(op_name, dy)], ps)[0]
        return y, grad

    return scatter(tensor)


def broadcast_(variables, root_rank, name=None, process_set=None):
    """Broadcast variables in place from root_rank; returns their new values."""
    from .functions import broadcast_variables

    variables = list(variables)
    group = broadcast_variables(variables, root_rank, process_set=process_set, name=name)
    if group is None:  # eager: done
        return [tf.convert_to_tensor(v) for v in variables]
    # in a graph the values returned must be read after the assignments
    with tf.control_dependencies([group]):
        return [tf.identity(v.read_value() if hasattr(v, "read_value") else v)
                for v in variables]


def grouped_allgather(tensors, name=None, process_set=None):
    """Allgather each tensor of a list; all are submitted before any is waited on."""
    ps = check_process_set(process_set, "grouped_allgather")
    tensors = [_tensor(t, "grouped_allgather") for t in tensors]
    if not tensors:
        return []
    if name is None and not tf.executing_eagerly():
        name = f"HorovodGroupedAllgather_{tensors[0].name}_{tensors[-1].name}_{len(tensors)}"
    names = [_naming.derived(_naming.clean(name) if name else None, str(i))
             for i in range(len(tensors))]

    @tf.custom_gradient
    def gather(*xs):
        ys = _raw_allgather(list(xs), names, ps)

        def grad(*dys):
            dys = [tf.convert_to_tensor(dy) for dy in dys]
            rows_names = [_naming.gradient(n, dy, "grad.rows") for n, dy in zip(names, dys)]
            averaged = _allreduce_dense(dys, Average, 1.0, 1.0,
                                        [_naming.gradient(n, dy) for n, dy in zip(names, dys)], ps)
            rows = [tf.reshape(tf.shape(x, out_type=tf.int64)[0], [1]) for x in xs]
            all_rows = _raw_allgather(rows, rows_names, ps)
            return [tf.split(dy, r, num=_ps.size_of(ps), axis=0)[_ps.rank_in(ps)]
                    for dy, r in zip(averaged, all_rows)]
        return ys, grad

    out = gather(*tensors)
    return list(out) if isinstance(out, (list, tuple)) else [out]


def grouped_reducescatter(tensors, op=None, name=None, process_set=None, prescale_factor=1.0,
                          postscale_factor=1.0, average=None):
    """Reducescatter each tensor of a list; all are submitted before any is waited on."""
    op = _ops.resolve_op(op, "grouped_reducescatter", average=average,
                          kind=_ops.REDUCESCATTER)
    ps = check_process_set(process_set, "grouped_reducescatter")
    tensors = [_tensor(t, "grouped_reducescatter") for t in tensors]
    if not tensors:
        return []
    for t in tensors:
        if t.shape.rank == 0:
            raise ValueError("grouped_reducescatter: scalars cannot be scattered; pass tensors "
                             "with at least one dimension")
    if name is None and not tf.executing_eagerly():
        name = (f"HorovodGroupedReducescatter_{tensors[0].name}_{tensors[-1].name}_"
                f"{len(tensors)}")
    names = [_naming.derived(_naming.clean(name) if name else None, str(i))
             for i in range(len(tensors))]
    size, rank = _ps.size_of(ps), _ps.rank_in(ps)

    @tf.custom_gradient
    def scatter(*xs):
        def submit(*arrays):
            handles = [_c.reducescatter_async(a, op=op, name=n, prescale_factor=prescale_factor,
                                              postscale_factor=postscale_factor, process_set=ps)
                       for a, n in zip(arrays, names)]
            return lambda: [_c.synchronize(h) for h in handles]

        shapes = [_rows_shape(x, _share(x.shape[0] if x.shape.rank else None, size, rank))
                  for x in xs]
        ys = _bridge.run(submit, list(xs), [x.dtype for x in xs], shapes,
                         f"grouped_reducescatter {names[0]!r}")

        def grad(*dys):
            _check_grad_op(op, "grouped_reducescatter")
            scale = _ops.reducescatter_grad_scale(op, prescale_factor, postscale_factor, ps)
            dys = [tf.convert_to_tensor(dy) for dy in dys]
            names_of_grads = [_naming.gradient(n, dy) for n, dy in zip(names, dys)]
            if scale != 1.0:
                dys = [dy * tf.cast(scale, dy.dtype) for dy in dys]
            return _raw_allgather(dys, names_of_grads, ps)
        return ys, grad

    out = scatter(*tensors)
    return list(out) if isinstance(out, (list, tuple)) else [out]


def _topology_op(value_of, name: str):
    """A graph op that reads a topology value when it runs (so a graph built before init works)."""
    @tf.autograph.experimental.do_not_convert
    def read():
        return np.int32(value_of())

    if tf.executing_eagerly():
        return tf.constant(read(), dtype=tf.int32, name=name)
    out = tf.numpy_function(read, [], tf.int32, stateful=False, name=name)
    out.set_shape([])
    return out


def rank_op(name=None):
    """This rank, as an int32 tensor (Horovod's graph op)."""
    return _topology_op(_c.rank, name or "HorovodRank")


def local_rank_op(name=None):
    """This rank's local rank, as an int32 tensor."""
    return _topology_op(_c.local_rank, name or "HorovodLocalRank")


def size_op(process_set_id=0, name=None):
    """The number of ranks (of a process set), as an int32 tensor."""
    process_set = _ps.by_id(process_set_id, "size_op")
    return _topology_op(lambda: _ps.size_of(process_set), name or "HorovodSize")


def process_set_included_op(process_set_id=0, name=None):
    """1 if this rank belongs to the process set with this id, else 0 (an int32 tensor)."""
    process_set = _ps.by_id(process_set_id, "process_set_included_op")
    return _topology_op(lambda: int(_ps.is_member(process_set)),
                        name or "HorovodProcessSetIncluded")


def local_size_op(name=None):
    """The number of ranks on this node, as an int32 tensor."""
    return _topology_op(_c.local_size, name or "HorovodLocalSize")
