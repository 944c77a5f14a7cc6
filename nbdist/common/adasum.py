"""Adasum (Maleki et al., "Scaling Distributed Training with Adaptive Summation"), CPU.

Two gradients a and b combine as

    adasum(a, b) = (1 - a·b / (2|a|²)) a + (1 - a·b / (2|b|²)) b

so orthogonal gradients add up and parallel ones average. Over 2^k ranks the pairs
combine in a binary tree by distance doubling, as Horovod's VHDD does: rank r with r^1,
then those pairs two apart, and so on. The dot products and norms are taken over each
whole tensor, in float64.

This implementation gathers every rank's tensor (one allgather) and evaluates the tree
on every rank in the same order, so all ranks hold bit-identical results. It moves
size x the tensor's bytes: simple and exact, not bandwidth-optimal (Horovod's VHDD
halves the vector at each level).
"""
from __future__ import annotations

import math
import sys

import numpy as np

# Horovod skips the correction only for a vector whose squared norm is below
# sqrt(DBL_MIN) (~1.5e-154), where the division would lose all precision. A larger floor
# would treat small but real gradients (norm < 1e-4 for a floor of 1e-8) as zero and sum
# them instead of combining them.
_NORM_FLOOR = math.sqrt(sys.float_info.min)


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def combine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """adasum(a, b) of two flat float64 vectors."""
    dot = float(np.dot(a, b))
    a_sq = float(np.dot(a, a))
    b_sq = float(np.dot(b, b))
    a_coeff = 1.0 - dot / a_sq * 0.5 if a_sq >= _NORM_FLOOR else 1.0
    b_coeff = 1.0 - dot / b_sq * 0.5 if b_sq >= _NORM_FLOOR else 1.0
    return a_coeff * a + b_coeff * b


def reduce_tree(vectors: list) -> np.ndarray:
    """The Adasum of one vector per rank (rank order; a power-of-2 count), in float64."""
    level = [np.asarray(v, dtype=np.float64).reshape(-1) for v in vectors]
    if not is_power_of_two(len(level)):
        raise ValueError(f"Adasum needs a power-of-2 number of ranks, got {len(level)}")
    while len(level) > 1:
        level = [combine(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]


def reduce_gathered(gathered: np.ndarray, size: int, shape: tuple, dtype: np.dtype) -> np.ndarray:
    """Adasum of an allgather's result (`size` equal rows, one per rank) as `shape`/`dtype`."""
    rows = np.asarray(gathered).reshape(size, -1)
    return reduce_tree(list(rows)).astype(dtype).reshape(shape)
