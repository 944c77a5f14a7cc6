"""Horovod's Keras callbacks on nbdist, plus ProgressCallback for the notebook widget.

Put MetricAverageCallback before callbacks that read the epoch's metrics (checkpoints,
early stopping), as with Horovod, so that they see the averages.
"""
from __future__ import annotations


import numpy as np
import tensorflow as tf

from nbdist import common as _c
from nbdist.rank.report import KerasProgress  # the reporting logic shared with keras_progress_callback

from ..functions import broadcast_variables

Callback = tf.keras.callbacks.Callback


def _model_variables(model) -> list:
    """The model's state to keep identical: weights and the like, not dropout seed state.

    Keras 3 keeps each dropout layer's random seed in a variable; broadcasting it would
    give every rank the same dropout masks.
    """
    return [v for v in model.variables if "seed_generator" not in str(getattr(v, "path", ""))]


def _optimizer_variables(optimizer) -> list:
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


class BroadcastGlobalVariablesCallback(Callback):
    """Broadcast the model's and optimizer's variables from root_rank when training starts.

    If the model and optimizer exist on every rank at train begin (a built model), the
    broadcast happens before the first step; otherwise (Keras builds lazily) after the
    first batch, as Horovod does. Every rank decides the same way. `local_variables`
    (e.g. a PartialDistributedOptimizer's local layers' variables) keep each rank's own
    values.
    """

    def __init__(self, root_rank=0, device="", local_variables=None):
        super().__init__()
        self.root_rank = root_rank
        self.broadcast_done = False
        self._local_ids = {id(v) for v in (local_variables or ())}

    def _broadcast(self):
        shared = [v for v in _model_variables(self.model) if id(v) not in self._local_ids]
        broadcast_variables(shared, self.root_rank,
                            name="BroadcastGlobalVariablesCallback.model")
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None:
            broadcast_variables(_optimizer_variables(optimizer), self.root_rank,
                                name="BroadcastGlobalVariablesCallback.optimizer")
        self.broadcast_done = True

    def on_train_begin(self, logs=None):
        if self.broadcast_done:
            return
        optimizer = getattr(self.model, "optimizer", None)
        ready = bool(self.model.built)
        if ready and optimizer is not None and hasattr(optimizer, "build") \
                and not getattr(optimizer, "built", True):
            try:  # Keras 3: create the slots now so that they are broadcast too
                optimizer.build(self.model.trainable_variables)
            except Exception:
                ready = False
        # All ranks must take the same branch, or some would wait in a broadcast.
        if all(_c.allgather_object(ready, name="BroadcastGlobalVariablesCallback.ready")):
            self._broadcast()

    def on_train_batch_end(self, batch, logs=None):
        if not self.broadcast_done:
            self._broadcast()


def _number(value):
    try:
        return float(np.asarray(value))
    except (TypeError, ValueError):
        return None


class MetricAverageCallback(Callback):
    """At each epoch's end, replace every metric in the logs by its average over ranks."""

    def __init__(self, device=""):
        super().__init__()

    def on_epoch_end(self, epoch, logs=None):
        if logs is None or _c.size() == 1:
            return
        keys = sorted(k for k, v in logs.items() if _number(v) is not None)
        values = np.array([_number(logs[k]) for k in keys], dtype=np.float64)
        # One op for all metrics; ranks with different metric sets get a MismatchError.
        averaged = _c.allreduce(values, op=_c.Average, name=f"MetricAverageCallback.{epoch}")
        for k, v in zip(keys, averaged):
            logs[k] = float(v)


def _get_lr(optimizer) -> float:
    return float(np.asarray(tf.convert_to_tensor(optimizer.learning_rate)))


def _set_lr(optimizer, value: float) -> None:
    lr = optimizer.learning_rate
    if hasattr(lr, "assign"):
        lr.assign(value)
    else:
        try:
            optimizer.learning_rate = value
        except Exception as exc:
            raise TypeError("learning-rate callbacks need an optimizer with a float learning "
                            "rate, not a LearningRateSchedule") from exc


class LearningRateScheduleCallback(Callback):
    """lr = initial_lr * multiplier(epoch) between start_epoch and end_epoch.

    staircase=True changes it at epoch starts; otherwise every batch with a fractional
    epoch (needs steps_per_epoch, taken from fit's params when not given).
    momentum_correction scales a momentum *variable* for the batch after a change
    (Keras 3 optimizers keep momentum as a constant, so there it does nothing).
    """

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=True, steps_per_epoch=None, verbose=0):
        super().__init__()
        self.initial_lr = initial_lr
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.verbose = verbose
        self.current_epoch = None
        self._restore_momentum = None
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch: multiplier)

    def _in_range(self, epoch) -> bool:
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def _adjust(self, epoch):
        optimizer = self.model.optimizer
        old_lr = _get_lr(optimizer)
        new_lr = self.initial_lr * self.multiplier(epoch)
        _set_lr(optimizer, new_lr)
        momentum = getattr(optimizer, "momentum", None)
        if self.momentum_correction and hasattr(momentum, "assign") and old_lr > 0:
            self._restore_momentum = float(np.asarray(momentum))
            momentum.assign(self._restore_momentum * new_lr / old_lr)

    def on_train_begin(self, logs=None):
        if self.steps_per_epoch is None:
            self.steps_per_epoch = (self.params or {}).get("steps")

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch
        if self.staircase and self._in_range(epoch):
            self._adjust(epoch)

    def on_train_batch_begin(self, batch, logs=None):
        if self.staircase or not self._in_range(self.current_epoch):
            return
        if not self.steps_per_epoch:
            raise ValueError(f"{type(self).__name__}: staircase=False needs steps_per_epoch "
                             "(pass it, or give model.fit steps_per_epoch)")
        self._adjust(self.current_epoch + batch / self.steps_per_epoch)

    def on_train_batch_end(self, batch, logs=None):
        if self._restore_momentum is not None:
            self.model.optimizer.momentum.assign(self._restore_momentum)
            self._restore_momentum = None

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = _get_lr(self.model.optimizer)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramp the learning rate from initial_lr / size() to initial_lr over warmup_epochs.

    The usual companion of scaling the learning rate by size(): large steps from the
    start can diverge (Goyal et al., "Accurate, Large Minibatch SGD").
    """

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True,
                 steps_per_epoch=None, verbose=0):
        size = _c.size()

        def multiplier(epoch):
            return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch, verbose=verbose)
        self.warmup_epochs = warmup_epochs

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.end_epoch - 1:
            # The per-batch ramp stops one batch short; land on initial_lr exactly.
            _set_lr(self.model.optimizer, self.initial_lr)
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and _c.rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{_get_lr(self.model.optimizer):g}.")


class ProgressCallback(KerasProgress, Callback):
    """Report training to the notebook's progress widget (nbdist.report).

    Every batch is reported (rate-limited by nbdist.rank.report), every epoch end is
    flushed so each epoch's validation metrics stay in the history.
    """

