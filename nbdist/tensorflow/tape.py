"""DistributedGradientTape: a tf.GradientTape whose gradient() averages over ranks."""
from __future__ import annotations

import tensorflow as tf

from nbdist.common import process_sets as _ps

from .compression import Compression
from .gradients import reduce_gradients

_classes: dict[type, type] = {}


def _distributed_class(base: type) -> type:
    """A subclass of the tape's own class whose gradient() reduces (cached per class)."""
    if base not in _classes:
        def _split(self, target, sources, output_gradients, unconnected_gradients):
            """(local grads, global grads) in source order; None where not of that kind."""
            grads = base.gradient(self, target, sources, output_gradients,
                                  unconnected_gradients)
            flat_sources = tf.nest.flatten(sources)
            flat_grads = tf.nest.flatten(grads, expand_composites=False)
            local = [id(v) in self._nbdist_local for v in flat_sources]
            reduced = reduce_gradients(flat_grads, flat_sources, self._nbdist_prefix,
                                       local=[v for v, loc in zip(flat_sources, local) if loc],
                                       scale_local=self._nbdist_scale_local,
                                       **self._nbdist_options)
            out_local = [g if loc else None for g, loc in zip(reduced, local)]
            out_global = [None if loc else g for g, loc in zip(reduced, local)]
            return grads, out_local, out_global

        def gradient(self, target, sources, output_gradients=None,
                     unconnected_gradients=tf.UnconnectedGradients.NONE):
            grads, local, shared = _split(self, target, sources, output_gradients,
                                          unconnected_gradients)
            merged = [g if g is not None else s for g, s in zip(local, shared)]
            return tf.nest.pack_sequence_as(grads, merged)

        def get_local_and_global_gradients(self, target, sources, output_gradients=None,
                                           unconnected_gradients=tf.UnconnectedGradients.NONE):
            """(local variables' gradients, the others' reduced gradients), as Horovod's."""
            _, local, shared = _split(self, target, sources, output_gradients,
                                      unconnected_gradients)
            return ([g for g in local if g is not None], [g for g in shared if g is not None])

        def register_local_source(self, source):
            """Keep `source`'s gradient local to this rank (not reduced)."""
            for v in tf.nest.flatten(source):
                self._nbdist_local.add(id(v))

        _classes[base] = type(base.__name__, (base,), {
            "gradient": gradient,
            "get_local_and_global_gradients": get_local_and_global_gradients,
            "register_local_source": register_local_source,
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

    if _ps.is_member(process_set):
        check_process_set(process_set, "DistributedGradientTape")
    if getattr(gradtape, "_nbdist_distributed", False):
        return gradtape
    cls = _distributed_class(type(gradtape))
    tape = cls.__new__(cls)
    tape.__dict__.update(gradtape.__dict__)  # the same recorded tape, not a copy of it
    tape._nbdist_prefix = name
    tape._nbdist_options = dict(op=op, compression=compression, sparse_as_dense=sparse_as_dense,
                                gradient_predivide_factor=gradient_predivide_factor,
                                process_set=process_set)
    tape._nbdist_local = set()  # id() of sources whose gradients stay on this rank
    tape._nbdist_scale_local = scale_local_gradients
    return tape


def PartialDistributedGradientTape(gradtape, device_dense="", device_sparse="",
                                   compression=Compression.none, sparse_as_dense=False, op=None,
                                   gradient_predivide_factor=1.0, num_groups=0, groups=None,
                                   process_set=None, local_layers=None,
                                   scale_local_gradients=True):
    """A DistributedGradientTape whose `local_layers`' variables keep their own gradients.

    Those gradients are not reduced; with scale_local_gradients they are divided by
    size() (Horovod's default). More sources can be kept local with
    `tape.register_local_source(variable)`.
    """
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression,
                                   sparse_as_dense, op, gradient_predivide_factor, num_groups,
                                   groups, process_set, scale_local_gradients,
                                   name="PartialDistributedGradientTape")
    layers = local_layers if isinstance(local_layers, (list, tuple)) else (
        [] if local_layers is None else [local_layers])
    for layer in layers:
        tape.register_local_source(list(layer.trainable_weights))
    return tape
