"""Average a step's gradients over ranks: the one routine behind the tape and the optimizer.

All gradients of one call go through one submit/wait pair, so a step costs two Python
ops in a graph however many variables the model has, and no ordering between ranks is
needed. Dense gradients are allreduced (fused by the runtime); tf.IndexedSlices (e.g.
from an embedding lookup) are allgathered as values + indices, or densified first with
sparse_as_dense=True. Each op is named after its variable, so ranks match them by name.

Reduced gradients are marked, so that a DistributedOptimizer handed gradients that a
DistributedGradientTape already reduced does not reduce them a second time.
"""
from __future__ import annotations

import threading

import tensorflow as tf

from nbdist import common as _c
from nbdist.common import process_sets as _ps
from nbdist.common.autotune import SizeTuner, agree_by
from nbdist.common.sizes import MiB

from . import _bridge, _naming
from .compression import Compression
from .mpi_ops import check_process_set

_MARK = "_nbdist_reduced"
# NBDIST_AUTOTUNE: the engine's fusion thresholds tried besides the configured one (0: each
# gradient an allreduce of its own). A step's gradients are fused by the engine, so its
# threshold is TensorFlow's unit of fusion (nbdist.common.autotune).
TUNED_FUSION_BYTES = (16 * MiB, 4 * MiB, 1 * MiB, 0)
_tuning = threading.Lock()  # (waits of two reductions may end at once, on TF's threads)
_tuned: tuple | None = None  # (the engine, its SizeTuner): a new one after init() again


def mark_reduced(grad):
    """Remember that `grad` holds the ranks' reduced value; returns it."""
    if grad is not None:
        try:
            setattr(grad, _MARK, True)
        except (AttributeError, TypeError):  # an object that takes no attributes
            pass
    return grad


def is_reduced(grad) -> bool:
    """True for a gradient that came out of reduce_gradients (a distributed tape)."""
    return bool(getattr(grad, _MARK, False))


def reduce_gradients(grads, variables, prefix: str, op=None, compression=Compression.none,
                     sparse_as_dense=False, gradient_predivide_factor=1.0,
                     process_set=None, local=(), scale_local=True) -> list:
    """The gradients averaged (or `op`-reduced) over ranks, in the order given; None stays None.

    `variables` name the ops (one per gradient); `prefix` tells apart the callers, e.g.
    "DistributedGradientTape" and "DistributedOptimizer". With a `process_set` the
    gradients are reduced over its ranks; a rank outside it keeps its own (as Horovod).
    The gradients of the `local` variables (Horovod's local layers) stay on this rank;
    with `scale_local` they are divided by the number of ranks, to match the averaged
    scale of the others (Horovod's scale_local_gradients).
    """
    op = _c.ops.resolve_op(op, prefix)
    grads = list(grads)
    variables = list(variables) if variables is not None else [None] * len(grads)
    if len(variables) != len(grads):
        raise ValueError(f"{prefix}: {len(grads)} gradients for {len(variables)} variables")
    keep = {id(v) for v in local}
    if keep:
        shared = [i for i, v in enumerate(variables) if id(v) not in keep]
        reduced = reduce_gradients([grads[i] for i in shared], [variables[i] for i in shared],
                                   prefix, op, compression, sparse_as_dense,
                                   gradient_predivide_factor, process_set)
        size = _ps.size_of(process_set) if _ps.is_member(process_set) else 1
        out = [g / tf.cast(size, g.dtype) if scale_local and size > 1 and g is not None else g
               for g in grads]
        for i, g in zip(shared, reduced):
            out[i] = g
        return out
    if not _ps.is_member(process_set):
        return grads
    ps = None if process_set is None else check_process_set(process_set, prefix)
    if _ps.size_of(ps) == 1:
        return [mark_reduced(g) for g in grads]
    prescale, postscale = _c.ops.predivide_factors(op, gradient_predivide_factor, prefix)
    names = [f"{prefix}.{n}" for n in _naming.variable_names(variables)]

    dense_at, sparse_at, inputs, contexts = [], [], [], []
    for i, g in enumerate(grads):
        if g is None:
            continue
        if isinstance(g, tf.IndexedSlices):
            if sparse_as_dense:
                g = tf.convert_to_tensor(g)
            else:
                sparse_at.append(i)
                continue
        compressed, ctx = compression.compress(tf.convert_to_tensor(g))
        dense_at.append(i)
        inputs.append(compressed)
        contexts.append(ctx)
    if sparse_at:  # tf.IndexedSlices are gathered: Average or Sum only (Adasum needs dense)
        _c.ops.resolve_op(op, f"{prefix} (sparse gradient; pass sparse_as_dense=True)",
                          kind=_c.ops.SPARSE)
    for i in sparse_at:
        inputs.extend([grads[i].values, grads[i].indices])
    if not inputs:
        return grads

    n_dense = len(dense_at)
    op_names = [names[i] for i in dense_at]
    for i in sparse_at:
        op_names.extend([f"{names[i]}.values", f"{names[i]}.indices"])

    tuned = ps is None and _c.basics.config().autotune  # the global engine's threshold

    def submit(*arrays):
        handles = [_c.allreduce_async(a, op=op, name=n, prescale_factor=prescale,
                                      postscale_factor=postscale, process_set=ps)
                   for a, n in zip(arrays[:n_dense], op_names[:n_dense])]
        handles += [_c.allgather_async(a, name=n, process_set=ps)
                    for a, n in zip(arrays[n_dense:], op_names[n_dense:])]

        def wait():
            results = [_c.synchronize(h) for h in handles]
            if tuned:
                _step_done()
            return results

        return wait

    shapes = [t.shape for t in inputs[:n_dense]]
    shapes += [tf.TensorShape([None]).concatenate(t.shape[1:]) for t in inputs[n_dense:]]
    outputs = _bridge.run(submit, inputs, [t.dtype for t in inputs], shapes,
                          f"{prefix} gradient reduction")

    result = list(grads)
    for k, i in enumerate(dense_at):
        result[i] = compression.decompress(outputs[k], contexts[k])
    sparse_scale = prescale * postscale / (_ps.size_of(ps) if int(op) == int(_c.Average) else 1)
    for k, i in enumerate(sparse_at):
        values, indices = outputs[n_dense + 2 * k], outputs[n_dense + 2 * k + 1]
        if sparse_scale != 1.0:
            values = values * tf.cast(sparse_scale, values.dtype)
        result[i] = tf.IndexedSlices(values, indices, dense_shape=grads[i].dense_shape)
    return [mark_reduced(g) for g in result]


def _step_done() -> None:
    """NBDIST_AUTOTUNE: a step's gradients are reduced; the tuner may move the global
    engine's fusion threshold to its next candidate (or the one chosen), which the engine
    applies on every rank at the same cycle (Engine.set_fusion_threshold)."""
    global _tuned
    engine = _c.basics.engine()
    with _tuning:
        if _tuned is None or _tuned[0] is not engine:
            config = _c.basics.config()
            tuner = SizeTuner("engine fusion_threshold", config.fusion_threshold,
                              TUNED_FUSION_BYTES, config.autotune_steps, config.autotune_warmup,
                              agree_by("nbdist.autotune.fusion_threshold"),
                              config.autotune_log, _c.rank() == 0,
                              zero_label="no fusion")
            _tuned = (engine, tuner)
            engine.set_fusion_threshold(tuner.size)  # the schedule's first: the biggest
        tuner = _tuned[1]
        if tuner.step_done():
            engine.set_fusion_threshold(tuner.size)


def fusion_autotune_scores() -> dict:
    """With NBDIST_AUTOTUNE: each fusion threshold tried so far -> the slowest rank's median
    seconds per step (empty without autotune, or before the first step)."""
    return dict(_tuned[1].scores) if _tuned is not None else {}
