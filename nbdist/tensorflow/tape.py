"""DistributedGradientTape: a tf.GradientTape whose gradient() averages over ranks."""
from __future__ import annotations

import tensorflow as tf

from .compression import Compression
from .gradients import reduce_gradients

_classes: dict[type, type] = {}


def _distributed_class(base: type) -> type:
    """A subclass of the tape's own class whose gradient() reduces (cached per class)."""
    if base not in _classes:
        def gradient(self, target, sources, output_gradients=None,
                     unconnected_gradients=tf.UnconnectedGradients.NONE):
            grads = base.gradient(self, target, sources, output_gradients,
                                  unconnected_gradients)
            flat_sources = tf.nest.flatten(sources)
            flat_grads = tf.nest.flatten(grads, expand_composites=False)
            reduced = reduce_gradients(flat_grads, flat_sources, self._nbdist_prefix,
                                       **self._nbdist_options)
            return tf.nest.pack_sequence_as(grads, reduced)

        _classes[base] = type(base.__name__, (base,), {
            "gradient": gradient,
            "__doc__": "A gradient tape that averages gradients over nbdist ranks.",
            "_nbdist_distributed": True,
        })
    return _classes[base]


def DistributedGradientTape(gradtape, device_dense="", device_sparse="",
                            compression=Compression.none, sparse_as_dense=False, op=None,
                            gradient_predivide_factor=1.0, num_groups=0, groups=None,
                            process_set=None, scale_local_gradients=True,
                            name="DistributedGradientTape"):
    """Wrap a tf.GradientTape so that gradient() returns gradients reduced over ranks.

    As in Horovod, call it after the `with tf.GradientTape() as tape:` block. The new
    tape shares the recorded operations of the given one. All gradients of one call
    are reduced together (`num_groups` / `groups` are accepted for compatibility).
    `name` prefixes the op names: give two tapes used in one step different names.
    """
    from .mpi_ops import check_process_set

    check_process_set(process_set, "DistributedGradientTape")
    if getattr(gradtape, "_nbdist_distributed", False):
        return gradtape
    cls = _distributed_class(type(gradtape))
    tape = cls.__new__(cls)
    tape.__dict__.update(gradtape.__dict__)  # the same recorded tape, not a copy of it
    tape._nbdist_prefix = name
    tape._nbdist_options = dict(op=op, compression=compression, sparse_as_dense=sparse_as_dense,
                                gradient_predivide_factor=gradient_predivide_factor)
    return tape
