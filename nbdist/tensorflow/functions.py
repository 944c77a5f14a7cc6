"""broadcast_variables, with a check that every rank passed the same variables; objects.

The classic mistake this catches: the model is built on rank 0 only (`if hvd.rank() ==
0: model(x)`), so the other ranks pass no variables. Without a check some ranks would
wait for broadcasts that never come. Here every rank first publishes the signature of
what it passed (names, shapes, dtypes); if the ranks disagree, every rank raises the
same error at once, listing what each rank passed and how to fix it.
"""
from __future__ import annotations

import tensorflow as tf

from nbdist import common as _c

from . import _bridge, _naming

_SHOWN = 6  # variables listed per rank in a mismatch message


def _variable_list(variables) -> list:
    if isinstance(variables, dict):
        variables = list(variables.values())
    return list(variables)


def _signature(var) -> tuple:
    shape = tuple(int(d) if d is not None else -1 for d in tf.TensorShape(var.shape).as_list())
    return (_naming.variable_name(var), shape, tf.as_dtype(var.dtype).name)


def _describe(rank: int, sig: list) -> str:
    shown = ", ".join(f"{n} {s} {d}" for n, s, d in sig[:_SHOWN])
    more = f", ... ({len(sig) - _SHOWN} more)" if len(sig) > _SHOWN else ""
    plural = "" if len(sig) == 1 else "s"
    return f"  rank {rank}: {len(sig)} variable{plural}" + (f": {shown}{more}" if sig else "")


def check_same_variables(signatures: list, root_rank: int, what: str,
                         ranks: list | None = None) -> None:
    """Raise MismatchError (on every rank alike) unless all ranks match the root's variables.

    `signatures` are in the order of `ranks`, the global ranks of the op's process set
    (None: every rank); `root_rank` is a global rank.
    """
    ranks = list(range(len(signatures))) if ranks is None else list(ranks)
    root = [(s, d) for _, s, d in signatures[ranks.index(root_rank)]]
    bad = [r for r, sig in zip(ranks, signatures) if [(s, d) for _, s, d in sig] != root]
    if not bad:
        return
    lines = [f"{what}: the ranks passed different variables (count, shapes or dtypes differ "
             f"from root rank {root_rank}'s), so they cannot be broadcast:"]
    lines += [_describe(r, sig) for r, sig in zip(ranks, signatures)]
    lines.append("Fix: build the model on every rank before broadcasting, e.g. call "
                 "model(sample_batch) or model.build(input_shape) on all ranks (not only "
                 "under `if hvd.rank() == 0`), and build the optimizer on all ranks too.")
    raise _c.MismatchError("\n".join(lines))


def broadcast_variables(variables, root_rank, process_set=None, inplace=False, name=None):
    """Assign root_rank's values to `variables` on every rank (eager or in tf.function)."""
    from .mpi_ops import check_process_set

    ps = check_process_set(process_set, "broadcast_variables")
    ranks = None if ps is None else list(ps.ranks)
    try:
        _c.ops.check_root(root_rank, "broadcast_variables", ranks)
    except (TypeError, ValueError) as exc:
        raise _bridge.tf_error(exc) from None
    variables = _variable_list(variables)
    base = _naming.clean(name or "broadcast_variables")
    signature = [_signature(v) for v in variables]
    what = f"broadcast_variables(root_rank={root_rank})"

    def submit(*arrays):
        # Synchronous on purpose: the check must finish before any broadcast starts, and
        # no two calls' ops are ever in flight together under the same names.
        signatures = _c.allgather_object(signature, name=f"{base}.signature", process_set=ps)
        check_same_variables(signatures, root_rank, what, ranks)
        # Op names from the root's signature, identical on every rank even if Keras
        # numbered the layers differently somewhere.
        root_signature = signatures[ranks.index(root_rank) if ranks else root_rank]
        names = _naming.variable_names([_Named(n) for n, _, _ in root_signature])
        handles = [_c.broadcast_async(a, root_rank, name=f"{base}.{n}", process_set=ps)
                   for a, n in zip(arrays, names)]
        results = [_c.synchronize(h) for h in handles]
        return lambda: results

    values = [tf.convert_to_tensor(v) for v in variables]
    outputs = _bridge.run(submit, values, [v.dtype for v in values], [v.shape for v in values],
                          what)
    if not variables:
        return tf.group(*outputs) if outputs and not tf.executing_eagerly() else None
    assigns = [v.assign(out) for v, out in zip(variables, outputs)]
    return None if tf.executing_eagerly() else tf.group(*[a for a in assigns if a is not None])


def _checked(process_set, what: str):
    from .mpi_ops import check_process_set

    return check_process_set(process_set, what)


class _Named:
    """A stand-in carrying only a name, for _naming.variable_names."""

    def __init__(self, name):
        self.name = name


def broadcast_global_variables(root_rank):
    """TF1 graphs: an op that broadcasts every global variable from root_rank.

    Eagerly there are no global variables (as Horovod, a RuntimeError): use
    broadcast_variables(model.variables, root_rank), or the Keras
    BroadcastGlobalVariablesCallback.
    """
    if tf.executing_eagerly():
        raise RuntimeError("broadcast_global_variables works in TensorFlow 1 graphs only; "
                           "eagerly use broadcast_variables(model.variables, root_rank) (and "
                           "the optimizer's variables), or BroadcastGlobalVariablesCallback")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank,
                               name="broadcast_global_variables")


def broadcast_object(obj, root_rank=0, session=None, name=None, process_set=None):
    """root_rank's Python object on every rank (eager; pickled with cloudpickle)."""
    return _c.broadcast_object(obj, root_rank=root_rank, name=name,
                               process_set=_checked(process_set, "broadcast_object"))


def allgather_object(obj, session=None, name=None, process_set=None):
    """Every rank's Python object (of the process set), as a list in rank order."""
    return _c.allgather_object(obj, name=name,
                               process_set=_checked(process_set, "allgather_object"))


def broadcast_object_fn(root_rank=0, session=None, name=None, process_set=None):
    """Horovod's factory for TF1 sessions: a function that broadcasts an object from root.

    nbdist's broadcast_object needs no session or graph, so the function returned calls
    it; `session` is accepted for Horovod code and not used.
    """
    base = name or "broadcast_object_fn"
    ps = _checked(process_set, "broadcast_object_fn")

    def _bcast(obj):
        return _c.broadcast_object(obj, root_rank=root_rank, name=base, process_set=ps)

    return _bcast
