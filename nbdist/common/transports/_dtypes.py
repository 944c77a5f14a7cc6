"""numpy dtypes ↔ the native module's dtype codes (native/kernels.hpp, enum DType)."""
from __future__ import annotations

import numpy as np

from ..ops_base import BFLOAT16, ReduceOp

_NAMES = ["float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64",
          "uint8", "uint16", "uint32", "uint64"]
CODES = {name: code for code, name in enumerate(_NAMES)}

# The reductions the native side implements (Horovod's numbering, as ReduceOp).
NATIVE_OPS = {ReduceOp.Sum, ReduceOp.Min, ReduceOp.Max, ReduceOp.Product}


def dtype_code(dtype: np.dtype) -> int:
    """The native code of a numpy dtype; TypeError if the native side cannot reduce it."""
    dtype = np.dtype(dtype)
    name = "bfloat16" if BFLOAT16 is not None and dtype == BFLOAT16 else dtype.name
    try:
        return CODES[name]
    except KeyError:
        raise TypeError(f"the native transports cannot reduce {name} arrays") from None


def op_code(op) -> int:
    """The native code of a reduction op; ValueError for Average/Adasum (the engine's job)."""
    op = ReduceOp(op)
    if op not in NATIVE_OPS:
        raise ValueError(f"a transport only reduces with Sum, Min, Max or Product, not {op.name}")
    return int(op)
