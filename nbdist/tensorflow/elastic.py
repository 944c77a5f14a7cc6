"""Horovod's elastic API for TensorFlow 2 / Keras: `hvd.elastic.run`, `TensorFlowKerasState`,
`TensorFlowState` (see nbdist.common.elastic and docs/elastic.md)."""
from __future__ import annotations

import functools

import tensorflow as tf

from nbdist.common import errors as _errors
from nbdist.common.elastic import (HorovodInternalError, HostsUpdatedInterrupt, ObjectState, State,
                                   reset_world, run_fn)

from .functions import broadcast_object, broadcast_variables

# The runtime errors a new world can cure, as they surface through a tf.function (model.fit):
# TensorFlow re-raises our numpy_function's exception as an OpError naming it in its text.
_RETRYABLE_NAMES = ("RuntimeBrokenError", "CollectiveError")


def _internal_error(exc: BaseException) -> BaseException | None:
    """The HorovodInternalError a TensorFlow error stands for, or None."""
    from nbdist.failure import unwrap

    if isinstance(exc, HorovodInternalError):
        return exc
    if isinstance(exc, tf.errors.OpError):
        name, message = unwrap(type(exc).__name__, exc.message or "")
        if name in _RETRYABLE_NAMES:
            return _errors.RuntimeBrokenError(message)
    return None


def run(func):
    """Run `func(state, ...)` elastically (Horovod's hvd.elastic.run for TensorFlow/Keras)."""

    @functools.wraps(func)
    def unwrapped(state, *args, **kwargs):
        try:
            return func(state, *args, **kwargs)
        except tf.errors.OpError as exc:
            internal = _internal_error(exc)
            if internal is None or internal is exc:
                raise
            raise internal from exc

    return run_fn(unwrapped, reset_world)


def _optimizer_variables(optimizer) -> list:
    if optimizer is None:
        return []
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


class TensorFlowKerasState(ObjectState):
    """A built Keras model and its optimizer (or the model's compiled one), plus plain values."""

    def __init__(self, model, optimizer=None, backend=None, **kwargs):
        if not getattr(model, "built", True):
            raise ValueError("the model must be built before it goes into the elastic state: "
                             "call model.build(input_shape) or run it on a batch first")
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        self._save_model()
        super().__init__(bcast_object=broadcast_object, **kwargs)

    def _build_optimizer(self) -> None:
        """A new rank's optimizer has no slots yet: build them, so its variables match rank 0's."""
        opt = self.optimizer
        if opt is not None and hasattr(opt, "build") and not getattr(opt, "built", True):
            opt.build(self.model.trainable_variables)

    def _save_model(self) -> None:
        self._saved_model = [v.numpy() for v in self.model.variables]
        self._saved_optimizer = [v.numpy() for v in _optimizer_variables(self.optimizer)]

    def _load_model(self) -> None:
        for var, value in zip(self.model.variables, self._saved_model):
            var.assign(value)
        for var, value in zip(_optimizer_variables(self.optimizer), self._saved_optimizer):
            var.assign(value)

    def save(self) -> None:
        self._save_model()
        super().save()

    def restore(self) -> None:
        self._load_model()
        super().restore()

    def sync(self) -> None:
        self._build_optimizer()
        broadcast_variables(self.model.variables, root_rank=0)
        optimizer_variables = _optimizer_variables(self.optimizer)
        if optimizer_variables:
            broadcast_variables(optimizer_variables, root_rank=0)
        self._save_model()
        super().sync()


class TensorFlowState(ObjectState):
    """A list of tf.Variable objects, plus plain values (TensorFlow 2, eager)."""

    def __init__(self, variables=None, session=None, **kwargs):
        if variables is None:
            raise ValueError("TensorFlowState needs variables= in TensorFlow 2 (there are no "
                             "global variables)")
        self.variables = list(variables)
        self._values = [v.numpy() for v in self.variables]
        super().__init__(bcast_object=broadcast_object, **kwargs)

    def save(self) -> None:
        self._values = [v.numpy() for v in self.variables]
        super().save()

    def restore(self) -> None:
        for var, value in zip(self.variables, self._values):
            var.assign(value)
        super().restore()

    def sync(self) -> None:
        if self.variables:
            broadcast_variables(self.variables, root_rank=0)
        self._values = [v.numpy() for v in self.variables]
        super().sync()


__all__ = ["run", "TensorFlowKerasState", "TensorFlowState", "ObjectState", "State",
           "HorovodInternalError", "HostsUpdatedInterrupt"]
