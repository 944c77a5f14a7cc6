"""DistributedOptimizer: a Keras optimizer that averages gradients over ranks before applying.

The wrapper is a subclass of the optimizer's own class (made once per class, with the
same name and module, so a saved model's config reads as the plain optimizer), so
`isinstance`, get_config, checkpoints and Keras' own code keep working. It hooks
  - Keras 3: `apply(grads, variables)` (apply_gradients and model.fit both go through it),
  - tf-keras (TF_USE_LEGACY_KERAS=1) and legacy optimizers: `apply_gradients`.
Gradients that a DistributedGradientTape already reduced pass through untouched.

Keras 3 turned `optimizer.variables` into a property, which breaks Horovod code calling
`opt.variables()`; the wrapper answers both spellings with a list that is also callable.
"""
from __future__ import annotations

import dataclasses
import inspect

import tensorflow as tf

from .compression import Compression
from .gradients import is_reduced, reduce_gradients


class CallableList(list):
    """A list that also returns itself when called: `opt.variables` == `opt.variables()`."""

    def __call__(self):
        return self


@dataclasses.dataclass(frozen=True)
class _Options:
    # A frozen plain object: TF's trackable __setattr__ would wrap a dict attribute.
    prefix: str = "DistributedOptimizer"
    op: object = None
    compression: type = Compression.none
    sparse_as_dense: bool = False
    gradient_predivide_factor: float = 1.0
    process_set: object = None


def _reduce(optimizer, grads: list, variables: list) -> list:
    """Reduce the gradients not reduced yet (None and tape-reduced ones pass through)."""
    options = getattr(optimizer, "_nbdist_options", None) or _Options()
    todo = [i for i, g in enumerate(grads) if g is not None and not is_reduced(g)]
    if not todo:
        return grads
    reduced = reduce_gradients([grads[i] for i in todo], [variables[i] for i in todo],
                               options.prefix, op=options.op, compression=options.compression,
                               sparse_as_dense=options.sparse_as_dense,
                               gradient_predivide_factor=options.gradient_predivide_factor,
                               process_set=options.process_set)
    grads = list(grads)
    for i, g in zip(todo, reduced):
        grads[i] = g
    return grads


def _is_keras3(base: type) -> bool:
    try:
        from keras.src.optimizers.base_optimizer import BaseOptimizer
    except ImportError:  # pragma: no cover - Keras 3 not installed
        return False
    return issubclass(base, BaseOptimizer)


_classes: dict[type, type] = {}


def distributed_class(base: type) -> type:
    """The distributed subclass of a Keras optimizer class (made once per class)."""
    if getattr(base, "_nbdist_distributed", False):
        return base
    if base in _classes:
        return _classes[base]
    namespace: dict = {"_nbdist_distributed": True, "__module__": base.__module__,
                       "__qualname__": base.__qualname__,
                       "__doc__": f"{base.__name__} that averages gradients over nbdist ranks."}
    if _is_keras3(base):
        def apply(self, grads, trainable_variables=None):
            variables = (list(trainable_variables) if trainable_variables is not None
                         else list(self._trainable_variables))
            grads = _reduce(self, list(grads), variables)
            return base.apply(self, grads, variables if trainable_variables is not None
                              else None)
        namespace["apply"] = apply
    else:
        def apply_gradients(self, grads_and_vars, *args, **kwargs):
            pairs = list(grads_and_vars)
            grads = _reduce(self, [g for g, _ in pairs], [v for _, v in pairs])
            return base.apply_gradients(self, list(zip(grads, [v for _, v in pairs])),
                                        *args, **kwargs)
        namespace["apply_gradients"] = apply_gradients
    if isinstance(inspect.getattr_static(base, "variables", None), property):
        prop = inspect.getattr_static(base, "variables")
        namespace["variables"] = property(lambda self: CallableList(prop.fget(self)),
                                          doc="The optimizer's variables; also callable.")
    cls = type(base.__name__, (base,), namespace)
    _classes[base] = cls
    return cls


def _check_keras_optimizer(optimizer) -> None:
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        raise NotImplementedError(
            "DistributedOptimizer: TensorFlow 1 optimizers (tf.compat.v1.train.*) are not "
            "supported; use a Keras optimizer (tf.keras.optimizers.*), or "
            "DistributedGradientTape with your own update")
    if not (hasattr(optimizer, "get_config") and hasattr(optimizer, "apply_gradients")):
        raise TypeError(f"DistributedOptimizer expects a Keras optimizer, got "
                        f"{type(optimizer).__name__}")


def _has_state(optimizer) -> bool:
    if getattr(optimizer, "built", False):
        return True
    try:
        return int(tf.convert_to_tensor(optimizer.iterations).numpy()) > 0
    except Exception:
        return False


def wrap_in_place(optimizer, options: _Options):
    """Make this optimizer object distributed (its state kept); returns it."""
    optimizer.__class__ = distributed_class(type(optimizer))
    object.__setattr__(optimizer, "_nbdist_options", options)
    return optimizer


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                         compression=Compression.none, sparse_as_dense=False,
                         gradient_predivide_factor=1.0, op=None, backward_passes_per_step=1,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=None, scale_local_gradients=True):
    """A Keras optimizer that averages gradients over ranks before it applies them.

    As in Horovod the result is a new optimizer made from the given one's config; an
    optimizer that already has state (built, or stepped) is made distributed in place
    so that its state survives. `name` prefixes the op names.
    """
    from nbdist.common import process_sets as _ps

    from .mpi_ops import check_process_set

    if _ps.is_member(process_set):
        check_process_set(process_set, "DistributedOptimizer")
    if backward_passes_per_step != 1:
        raise NotImplementedError(
            "DistributedOptimizer: backward_passes_per_step > 1 is not supported; with Keras 3 "
            "pass gradient_accumulation_steps=N to the optimizer itself instead")
    _check_keras_optimizer(optimizer)
    options = _Options(prefix=name or "DistributedOptimizer", op=op, compression=compression,
                       sparse_as_dense=sparse_as_dense,
                       gradient_predivide_factor=gradient_predivide_factor,
                       process_set=process_set)
    if getattr(optimizer, "_nbdist_distributed", False) or _has_state(optimizer):
        return wrap_in_place(optimizer, options)
    cls = distributed_class(type(optimizer))
    try:
        new = cls.from_config(optimizer.get_config())
    except Exception:  # a custom optimizer whose config does not round-trip
        return wrap_in_place(optimizer, options)
    object.__setattr__(new, "_nbdist_options", options)
    return new
