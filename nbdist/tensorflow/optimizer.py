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
    backward_passes_per_step: int = 1
    average_aggregated_gradients: bool = False
    scale_local_gradients: bool = True


def _reduce(optimizer, grads: list, variables: list) -> list:
    """Reduce the gradients not reduced yet (None and tape-reduced ones pass through)."""
    options = getattr(optimizer, "_nbdist_options", None) or _Options()
    todo = [i for i, g in enumerate(grads) if g is not None and not is_reduced(g)]
    if not todo:
        return grads
    local_ids = getattr(optimizer, "_nbdist_local", ())
    reduced = reduce_gradients([grads[i] for i in todo], [variables[i] for i in todo],
                               options.prefix, op=options.op, compression=options.compression,
                               sparse_as_dense=options.sparse_as_dense,
                               gradient_predivide_factor=options.gradient_predivide_factor,
                               process_set=options.process_set,
                               local=[variables[i] for i in todo if id(variables[i]) in local_ids],
                               scale_local=options.scale_local_gradients)
    grads = list(grads)
    for i, g in zip(todo, reduced):
        grads[i] = g
    return grads


def _accumulating(optimizer) -> bool:
    options = getattr(optimizer, "_nbdist_options", None)
    return options is not None and options.backward_passes_per_step > 1


def _reduce_accumulated(optimizer, grads: list) -> list:
    """At Keras' update step: the N accumulated gradients, reduced over ranks.

    Keras hands the mean of the N passes' gradients; Horovod reduces their sum unless
    average_aggregated_gradients, so the mean is scaled back up first. Each rank runs
    this once every N steps, so the ranks communicate once per N passes.
    """
    options = optimizer._nbdist_options
    if not options.average_aggregated_gradients:
        steps = options.backward_passes_per_step
        grads = [g if g is None else g * tf.cast(steps, g.dtype) for g in grads]
    return _reduce(optimizer, grads, optimizer._nbdist_step_variables)


def _local_ids(optimizer) -> set:
    ids = getattr(optimizer, "_nbdist_local", None)
    if ids is None:
        ids = set()
        object.__setattr__(optimizer, "_nbdist_local", ids)  # not tracked by Keras
    return ids


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
            if _accumulating(self):  # reduced at Keras' update step (_clip_gradients below)
                return base.apply(self, grads, trainable_variables)
            variables = (list(trainable_variables) if trainable_variables is not None
                         else list(self._trainable_variables))
            grads = _reduce(self, list(grads), variables)
            return base.apply(self, grads, variables if trainable_variables is not None
                              else None)

        def _backend_apply_gradients(self, grads, trainable_variables):
            # the variables of this step (Keras has filtered out those without a gradient),
            # for the op names of the reduction in _clip_gradients
            object.__setattr__(self, "_nbdist_step_variables", list(trainable_variables))
            return base._backend_apply_gradients(self, grads, trainable_variables)

        def _clip_gradients(self, grads):
            if _accumulating(self):
                grads = _reduce_accumulated(self, list(grads))
            return base._clip_gradients(self, grads)

        namespace.update(apply=apply, _backend_apply_gradients=_backend_apply_gradients,
                         _clip_gradients=_clip_gradients)
    else:
        def apply_gradients(self, grads_and_vars, *args, **kwargs):
            pairs = list(grads_and_vars)
            grads = _reduce(self, [g for g, _ in pairs], [v for _, v in pairs])
            return base.apply_gradients(self, list(zip(grads, [v for _, v in pairs])),
                                        *args, **kwargs)
        namespace["apply_gradients"] = apply_gradients
    def register_local_var(self, var):
        """Keep `var`'s gradient on this rank (not reduced), as Horovod's."""
        _local_ids(self).add(id(var))

    def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
        """Horovod's: (gradient, variable) pairs of `loss` for `var_list`, reduced over ranks.

        `loss` is a tensor recorded on `tape`, or a callable run under a new tape. With
        backward_passes_per_step > 1 the pairs are this rank's (Keras accumulates them
        and the reduction runs at its update step).
        """
        var_list = list(var_list)
        if callable(loss):
            tape = tf.GradientTape() if tape is None else tape
            with tape:
                loss = loss()
        elif tape is None:
            raise ValueError("compute_gradients: a loss tensor needs the tape that recorded "
                             "it (tape=)")
        grads = tape.gradient(loss, var_list, grad_loss)
        if not _accumulating(self):
            grads = _reduce(self, list(grads), var_list)
        return list(zip(grads, var_list))

    def compute_gradients(self, loss, var_list, tape=None):
        """Horovod's public form of _compute_gradients."""
        return self._compute_gradients(loss, var_list, None, tape)

    namespace.update(register_local_var=register_local_var,
                     _compute_gradients=_compute_gradients,
                     compute_gradients=compute_gradients)
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
    _check_keras_optimizer(optimizer)
    steps = _check_passes(optimizer, backward_passes_per_step)
    options = _Options(prefix=name or "DistributedOptimizer", op=op, compression=compression,
                       sparse_as_dense=sparse_as_dense,
                       gradient_predivide_factor=gradient_predivide_factor,
                       process_set=process_set, backward_passes_per_step=steps,
                       average_aggregated_gradients=average_aggregated_gradients,
                       scale_local_gradients=scale_local_gradients)
    if getattr(optimizer, "_nbdist_distributed", False) or _has_state(optimizer):
        return _accumulate(wrap_in_place(optimizer, options), steps)
    cls = distributed_class(type(optimizer))
    try:
        new = cls.from_config(optimizer.get_config())
    except Exception:  # a custom optimizer whose config does not round-trip
        return _accumulate(wrap_in_place(optimizer, options), steps)
    object.__setattr__(new, "_nbdist_options", options)
    return _accumulate(new, steps)


def _check_passes(optimizer, backward_passes_per_step) -> int:
    """backward_passes_per_step, checked: > 1 needs an unbuilt Keras 3 optimizer."""
    steps = int(backward_passes_per_step)
    if steps < 1:
        raise ValueError(f"DistributedOptimizer: backward_passes_per_step must be >= 1, got "
                         f"{backward_passes_per_step}")
    if steps == 1:
        return steps
    if not _is_keras3(type(optimizer)):
        raise NotImplementedError(
            "DistributedOptimizer: backward_passes_per_step > 1 needs a Keras 3 optimizer "
            "(keras.optimizers.*); tf-keras optimizers are not supported")
    if getattr(optimizer, "gradient_accumulation_steps", None):
        raise ValueError("DistributedOptimizer: pass either backward_passes_per_step or the "
                         "optimizer's own gradient_accumulation_steps, not both")
    if getattr(optimizer, "built", False):
        raise ValueError("DistributedOptimizer: backward_passes_per_step > 1 needs an "
                         "optimizer that has not been built yet (its gradient accumulators "
                         "are made when it is built)")
    return steps


def _accumulate(optimizer, steps: int):
    """Let Keras 3 accumulate `steps` passes' gradients locally (its own accumulators and
    update step); the distributed class reduces them once, at the update step.

    As with Keras' gradient_accumulation_steps, `optimizer.iterations` counts updates.
    """
    if steps > 1:
        optimizer.gradient_accumulation_steps = steps
    return optimizer


def PartialDistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                                compression=Compression.none, sparse_as_dense=False,
                                gradient_predivide_factor=1.0, op=None,
                                backward_passes_per_step=1, average_aggregated_gradients=False,
                                groups=None, process_set=None, local_layers=None,
                                scale_local_gradients=True):
    """A DistributedOptimizer whose `local_layers`' variables keep their own gradients.

    Those gradients are not reduced; with scale_local_gradients they are divided by the
    number of ranks (Horovod's default). More can be kept local with
    `optimizer.register_local_var(variable)` (Keras 3).
    """
    opt = DistributedOptimizer(optimizer, name or "PartialDistributedOptimizer", device_dense,
                               device_sparse, compression, sparse_as_dense,
                               gradient_predivide_factor, op, backward_passes_per_step,
                               average_aggregated_gradients, groups=groups,
                               process_set=process_set,
                               scale_local_gradients=scale_local_gradients)
    layers = local_layers if isinstance(local_layers, (list, tuple)) else (
        [] if local_layers is None else [local_layers])
    ids = _local_ids(opt)
    for layer in layers:
        ids.update(id(v) for v in layer.trainable_weights)
    return opt
