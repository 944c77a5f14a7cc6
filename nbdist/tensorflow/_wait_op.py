"""The asynchronous wait op for TF1 graphs (native/tf_ops.cpp), loaded once.

`wait_op()` is the op's Python wrapper, or None where the library was not built (no
TensorFlow when nbdist was installed) or does not load; the bridge then keeps its
numpy_function wait.
"""
from __future__ import annotations

import ctypes
import threading
import warnings
from pathlib import Path
from typing import Callable

import tensorflow as tf

LIBRARY = "libnbdist_tf_ops.so"

_lock = threading.Lock()
_state: dict = {"loaded": False, "op": None, "keep": None}


def _library_path() -> Path:
    # Installed beside the native module (CMakeLists.txt), also in an editable install.
    from nbdist import _native

    return Path(_native.__file__).parent / LIBRARY


def wait_op(waiter: Callable[[int], object]):
    """The NbdistWait op wrapper with `waiter` registered as what its kernels call, or None."""
    with _lock:
        if not _state["loaded"]:
            _state["loaded"] = True
            try:
                path = _library_path()
                if not path.exists():  # not built: no TensorFlow at build time
                    return None
                module = tf.load_op_library(str(path))
                lib = ctypes.PyDLL(str(path))
                lib.nbdist_tf_set_waiter.argtypes = [ctypes.py_object]
                lib.nbdist_tf_set_waiter(waiter)
                _state.update(op=module.nbdist_wait, keep=(lib, waiter))
            except Exception as exc:  # OSError, tf.errors.NotFoundError: e.g. built for another TF
                warnings.warn(f"nbdist: {path.name} did not load ({type(exc).__name__}: {exc}); "
                              "TF1 graphs use the numpy_function wait, which can stall a "
                              "Session.run that fetches many collectives. Reinstall nbdist "
                              "against this TensorFlow.", RuntimeWarning, stacklevel=2)
        return _state["op"]
