"""numpy float64 references shared by the GPU tests (no GPU library imported here)."""

from __future__ import annotations

import numpy as np

from hetcomm import ReduceOp


def small_values(rng: np.random.Generator, dtype: str, shape: int | tuple[int, ...]) -> np.ndarray:
    """float64 values every dtype holds exactly (small integers): sums and products are exact."""
    if dtype == "bool":
        return rng.integers(0, 2, shape).astype(np.float64)
    low, high = (0, 4) if dtype == "uint8" else (-3, 4)
    return rng.integers(low, high, shape).astype(np.float64)


def reference(stack: np.ndarray, op: ReduceOp, dtype: str) -> np.ndarray:
    """The reduction of the ranks' inputs (rows of `stack`) as hetcomm defines it: bool SUM/MAX
    is 'any', PROD/MIN 'all'; integer AVG truncates toward zero."""
    if dtype == "bool":
        return (stack.any(0) if op in (ReduceOp.SUM, ReduceOp.MAX) else stack.all(0)).astype(float)
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        s = stack.sum(0)
        if op is ReduceOp.AVG:
            s = s / len(stack)
            if not dtype.startswith(("float", "bfloat")):
                s = np.trunc(s)
        return s
    if op is ReduceOp.PROD:
        return stack.prod(0)
    return stack.min(0) if op is ReduceOp.MIN else stack.max(0)


def wrapped(ref: np.ndarray, dtype: str) -> np.ndarray:
    """The reference as an integer dtype holds it (sums and products wrap around)."""
    if dtype == "bool" or dtype.startswith(("float", "bfloat")):
        return ref
    return ref.astype(np.int64).astype(dtype).astype(np.float64)
