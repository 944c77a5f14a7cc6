"""nbdist.tensorflow.keras (also `nbdist.keras`): Horovod's Keras API on nbdist.

`import nbdist.keras as hvd` (or nbdist.tensorflow.keras) in place of
`import horovod.keras` / `horovod.tensorflow.keras`. The Keras is TensorFlow's own:
Keras 3, or tf-keras with TF_USE_LEGACY_KERAS=1.
"""
import nbdist.tensorflow as _tfmod

globals().update({_n: getattr(_tfmod, _n) for _n in dir(_tfmod)
                  if not _n.startswith("_") and _n not in ("keras", "elastic")})

from . import callbacks, elastic  # noqa: E402
from ..compression import Compression  # noqa: E402
from ..optimizer import (DistributedOptimizer, PartialDistributedOptimizer,  # noqa: E402
                         _Options, wrap_in_place)


def load_model(filepath, custom_optimizers=None, custom_objects=None,
               compression=Compression.none, **kwargs):
    """Load a saved Keras model and make its optimizer distributed again (state kept)."""
    import tensorflow as tf

    objects = dict(custom_objects or {})
    for cls in custom_optimizers or ():
        objects.setdefault(cls.__name__, cls)
    model = tf.keras.models.load_model(filepath, custom_objects=objects, **kwargs)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        wrap_in_place(optimizer, _Options(compression=compression))
    return model
