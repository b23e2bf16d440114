"""Local memory steps the transports share: a region of bytes, host copies and reductions.

Host views come as the caller's numpy dtype (float16) or as storage (bfloat16 in uint16):
copies move bytes, reductions see the storage the kernels expect (kernels/reduce.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..ops import ReduceOp


@dataclass
class Region:
    """Bytes an operation reads or writes: a flat uint8 host view, or a device pointer."""

    nbytes: int
    host: np.ndarray | None = None
    dev: int = 0
    keep: Any = None  # keeps a temporary allocation alive

    def sub(self, offset: int, nbytes: int) -> Region:
        """The `nbytes` bytes from `offset` on, as a Region of the same memory."""
        if self.host is not None:
            return Region(nbytes, self.host[offset : offset + nbytes])
        return Region(nbytes, None, self.dev + offset, self.keep)


def flat_bytes(a: np.ndarray) -> np.ndarray:
    """The bytes of a contiguous host array, as a flat uint8 view (no copy)."""
    return (a if a.ndim == 1 else a.reshape(-1)).view(np.uint8)


def copy_host(dst: np.ndarray, src: np.ndarray) -> None:
    """Copy the bytes of `src` into `dst` (same byte length, any dtypes)."""
    np.copyto(dst.view(np.uint8), src.view(np.uint8))


def combine_host(dst: np.ndarray, src: np.ndarray, dtype: str, op: ReduceOp) -> None:
    """dst = dst (op) src elementwise on host memory holding values of `dtype` (AVG sums: the
    caller divides once at the end)."""
    from ..kernels import reduce

    storage = reduce.storage_dtype(dtype)
    kind = "sum" if op is ReduceOp.AVG else op.value
    reduce.combine(dst.view(storage), src.view(storage), kind, dtype)


def divide_host(arr: np.ndarray, n: int, dtype: str) -> None:
    """arr /= n on host memory holding values of `dtype` (the last step of an AVG)."""
    from ..kernels import reduce

    reduce.divide(arr.view(reduce.storage_dtype(dtype)), n, dtype)
