"""SyncBatchNormalization for Keras 3: batch statistics over every rank's batch."""
from __future__ import annotations

import keras
import tensorflow as tf

from nbdist import common as _c


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """BatchNormalization whose training-time mean and variance are those of the global
    batch (all ranks' batches together), as Horovod's. One allreduce per call carries
    the per-channel sums, sums of squares and the element count (in float32); its
    gradient is the allreduce of the gradient, so backward is synchronized too."""

    def _moments(self, inputs, mask):
        if mask is not None or _c.size() == 1:
            return super()._moments(inputs, mask)
        from .mpi_ops import allreduce

        axes = list(self._reduction_axes)
        x = tf.cast(inputs, tf.float32)
        shape = tf.shape(x)
        count = tf.cast(tf.reduce_prod(tf.gather(shape, axes)), tf.float32)
        local = tf.concat([tf.reduce_sum(x, axis=axes), tf.reduce_sum(tf.square(x), axis=axes),
                           tf.reshape(count, [1])], axis=0)
        total = allreduce(local, op=_c.Sum, name=f"SyncBatchNormalization.{self.name}")
        channels = (tf.shape(total)[0] - 1) // 2
        n = total[-1]
        mean = total[:channels] / n
        variance = tf.maximum(total[channels:2 * channels] / n - tf.square(mean), 0.0)
        return tf.cast(mean, inputs.dtype), tf.cast(variance, inputs.dtype)
