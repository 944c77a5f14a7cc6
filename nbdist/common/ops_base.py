"""Reduction ops and dtypes shared by the runtime, the transports and the bindings."""
from __future__ import annotations

import enum

import numpy as np


class ReduceOp(enum.IntEnum):
    """Horovod's reduction ops, with Horovod's numbering."""

    Average = 0
    Sum = 1
    Adasum = 2
    Min = 3
    Max = 4
    Product = 5


class UnsupportedOpError(ValueError, NotImplementedError):
    """A reduction op that this kind of collective does not support (reducescatter or a
    sparse allreduce with Min, Max, Product or Adasum).

    Both a ValueError and a NotImplementedError: Horovod's torch and TensorFlow bindings
    raise these two for the same refusal, and code written for either catches it.
    """


Average = ReduceOp.Average
Sum = ReduceOp.Sum
Adasum = ReduceOp.Adasum
Min = ReduceOp.Min
Max = ReduceOp.Max
Product = ReduceOp.Product

try:  # numpy has no bfloat16; ml_dtypes (shipped with TensorFlow and JAX) does.
    import ml_dtypes as _ml_dtypes

    BFLOAT16: np.dtype | None = np.dtype(_ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - depends on what is installed
    BFLOAT16 = None

# dtypes the collectives accept; the reductions accept the same set but bool.
SUPPORTED_DTYPES = {
    np.dtype(t) for t in (np.float16, np.float32, np.float64, np.int8, np.int16, np.int32,
                          np.int64, np.uint8, np.uint16, np.uint32, np.uint64, np.bool_)
}
if BFLOAT16 is not None:
    SUPPORTED_DTYPES.add(BFLOAT16)

HALF_DTYPES = {np.dtype(np.float16)} | ({BFLOAT16} if BFLOAT16 is not None else set())


def dtype_name(dtype: np.dtype) -> str:
    """A dtype's short name ('float32', 'bfloat16'), as error messages show it."""
    return np.dtype(dtype).name


def numpy_dtype(name: str) -> np.dtype:
    """The dtype of a name as signatures carry it ('float32', 'bfloat16')."""
    return BFLOAT16 if name == "bfloat16" else np.dtype(name)  # type: ignore[return-value]


def is_half(dtype: np.dtype) -> bool:
    """True for 16-bit floats, which reductions accumulate in float32."""
    return np.dtype(dtype) in HALF_DTYPES
