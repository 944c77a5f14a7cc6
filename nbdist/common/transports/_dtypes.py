"""numpy dtypes ↔ the native module's dtype codes (native/kernels.hpp, enum DType)."""
from __future__ import annotations

import numpy as np

from ..ops_base import BFLOAT16, ReduceOp

_NAMES = ["float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64",
          "uint8", "uint16", "uint32", "uint64"]
CODES = {name: code for code, name in enumerate(_NAMES)}

# The reductions the native side implements (Horovod's numbering, as ReduceOp).
NATIVE_OPS = {ReduceOp.Sum, ReduceOp.Min, ReduceOp.Max, ReduceOp.Product}


# Every transport call asks for both codes (twice per small op: the agreement's control
# vector and the data). Working them out costs ~3 µs on an idle core (12 µs under load);
# a dict hit costs 0.1 µs.
_DTYPE_CODES: dict = {}
_OP_CODES = {op: int(op) for op in NATIVE_OPS}


def dtype_code(dtype: np.dtype) -> int:
    """The native code of a numpy dtype; TypeError if the native side cannot reduce it."""
    code = _DTYPE_CODES.get(dtype)
    if code is None:
        as_dtype = np.dtype(dtype)
        name = "bfloat16" if BFLOAT16 is not None and as_dtype == BFLOAT16 else as_dtype.name
        if name not in CODES:
            raise TypeError(f"the native transports cannot reduce {name} arrays")
        code = _DTYPE_CODES[dtype] = CODES[name]
    return code


def op_code(op) -> int:
    """The native code of a reduction op; ValueError for Average/Adasum (the engine's job)."""
    code = _OP_CODES.get(op)
    if code is None:
        op = ReduceOp(op)
        raise ValueError(f"a transport only reduces with Sum, Min, Max or Product, not {op.name}")
    return code
