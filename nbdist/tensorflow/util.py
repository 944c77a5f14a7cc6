"""Small helpers Horovod keeps in horovod.tensorflow.util (its tests and some user code
call them as `hvd.util._executing_eagerly()`)."""
from __future__ import annotations

import tensorflow as tf


def _executing_eagerly() -> bool:
    """True outside any graph being built (TF2 eager code)."""
    return tf.executing_eagerly()
