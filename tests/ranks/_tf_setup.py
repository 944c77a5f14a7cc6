"""Shared set-up of the TensorFlow rank tests: quiet logs, one thread per op, nbdist started."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

# 4 ranks share 2 cores: one thread each keeps the runs from thrashing.
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import nbdist.tensorflow as hvd  # noqa: E402

hvd.init()
