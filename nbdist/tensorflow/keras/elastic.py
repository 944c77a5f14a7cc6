"""Horovod's elastic Keras API: `hvd.elastic.KerasState`, the commit/batch/epoch callbacks, `run`."""
from __future__ import annotations

import tensorflow as tf

from ..elastic import TensorFlowKerasState, run

__all__ = ["KerasState", "CommitStateCallback", "UpdateBatchStateCallback",
           "UpdateEpochStateCallback", "run"]


class KerasState(TensorFlowKerasState):
    """A Keras model and optimizer (default: the model's compiled one), plus plain values."""

    def __init__(self, model, optimizer=None, **kwargs):
        super().__init__(model, optimizer=optimizer, backend=tf.keras.backend, **kwargs)


class CommitStateCallback(tf.keras.callbacks.Callback):
    """Commit `state` every `batches_per_commit` batches and at the end of every epoch."""

    def __init__(self, state, batches_per_commit: int = 1):
        super().__init__()
        self.state = state
        self.batches_per_commit = int(batches_per_commit)
        self._left = self.batches_per_commit

    def on_train_begin(self, logs=None):
        self._left = self.batches_per_commit  # every rank counts from the same sync point

    def on_train_batch_end(self, batch, logs=None):
        self._left -= 1
        if self._left == 0:
            self.state.commit()
            self._left = self.batches_per_commit

    def on_epoch_end(self, epoch, logs=None):
        self.state.commit()


class UpdateBatchStateCallback(tf.keras.callbacks.Callback):
    """Keep `state.batch` at the number of batches done in this epoch (0 after an epoch)."""

    def __init__(self, state):
        super().__init__()
        self.state = state

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch = self.state.batch + 1

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochStateCallback(tf.keras.callbacks.Callback):
    """Keep `state.epoch` as the global epoch number across resets (Keras counts from 0 per fit)."""

    def __init__(self, state):
        super().__init__()
        self.state = state
        self._initial = state.epoch

    def on_train_begin(self, logs=None):
        self._initial = self.state.epoch

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = self._initial + epoch + 1
