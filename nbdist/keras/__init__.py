"""`nbdist.keras` is the very module nbdist.tensorflow.keras (as with horovod.keras)."""
import sys

from nbdist.tensorflow import keras as _keras
from nbdist.tensorflow.keras import callbacks as _callbacks

# One module under two names: the same classes, the same state, whichever is imported.
sys.modules[__name__] = _keras
sys.modules[__name__ + ".callbacks"] = _callbacks
