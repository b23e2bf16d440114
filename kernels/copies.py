"""Host side of tensor fusion: many arrays gathered into one buffer and scattered back, each
array one memcpy, all of them in one compiled call (Numba)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["gather", "scatter"]

# see reduce.py: no parallel=True (each MPI rank owns a core), cached, compiled on first call
_jit = numba.njit(cache=True, nogil=True, boundscheck=False)


def _copy_bytes_typer(typingctx: Any, dst: types.Type, src: types.Type, nbytes: types.Type) -> Any:
    """memcpy(dst, src, nbytes), the addresses given as integers."""
    if not all(isinstance(t, types.Integer) for t in (dst, src, nbytes)):
        return None

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        byte_ptr = ir.IntType(8).as_pointer()
        d, s, n = (context.cast(builder, a, t, types.intp) for a, t in zip(args, sig.args))
        cgutils.raw_memcpy(
            builder, builder.inttoptr(d, byte_ptr), builder.inttoptr(s, byte_ptr), n, 1
        )
        return context.get_dummy_value()

    return types.void(dst, src, nbytes), codegen


# called from jitted code as _copy_bytes(dst, src, nbytes): numba supplies the typing context
_copy_bytes = cast("Callable[[int, int, int], None]", intrinsic(_copy_bytes_typer))


@_jit
def _fits(fused: np.ndarray, counts: np.ndarray, itemsize: int) -> bool:
    total = 0
    for i in range(counts.size):
        if counts[i] < 0:
            return False
        total += counts[i]
    return total * itemsize <= fused.size


@_jit
def _copy_all(
    fused: np.ndarray, addresses: np.ndarray, counts: np.ndarray, itemsize: int, into_fused: bool
) -> bool:
    """Each array's bytes to its place in `fused` (into_fused), or back; False when `fused`
    is too small."""
    if not _fits(fused, counts, itemsize):
        return False
    at = np.int64(fused.ctypes.data)
    for i in range(addresses.size):
        n = counts[i] * itemsize
        if into_fused:
            _copy_bytes(at, addresses[i], n)
        else:
            _copy_bytes(addresses[i], at, n)
        at += n
    return True


def _table(fused: np.ndarray, addresses: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """`fused` as bytes, once the tables are int64, one row per array."""
    if addresses.dtype != np.int64 or counts.dtype != np.int64 or addresses.ndim != 1:
        raise ValueError(
            f"addresses and counts must be 1-D int64 arrays, got "
            f"{addresses.ndim}-D {addresses.dtype} and {counts.dtype}"
        )
    if addresses.shape != counts.shape:
        raise ValueError(f"{addresses.size} addresses but {counts.size} counts")
    if fused.ndim != 1 or not fused.flags.c_contiguous:
        raise ValueError(f"fused must be a contiguous 1-D array, got strides {fused.strides}")
    return fused.view(np.uint8)


def _too_small(fused: np.ndarray, counts: np.ndarray, itemsize: int) -> ValueError:
    return ValueError(
        f"fused holds {fused.nbytes} bytes, the arrays "
        f"{int(counts.sum()) * itemsize} (or a count is negative)"
    )


def gather(fused: np.ndarray, addresses: np.ndarray, counts: np.ndarray, itemsize: int) -> None:
    """Copy counts[i] elements of `itemsize` bytes from addresses[i] into `fused`, one array
    after the other. The caller vouches for the addresses: each the start of that many
    contiguous, readable bytes, none of them inside `fused`."""
    if not _copy_all(_table(fused, addresses, counts), addresses, counts, itemsize, True):
        raise _too_small(fused, counts, itemsize)


def scatter(fused: np.ndarray, addresses: np.ndarray, counts: np.ndarray, itemsize: int) -> None:
    """The reverse of gather: each array's part of `fused` copied back to addresses[i]."""
    if not _copy_all(_table(fused, addresses, counts), addresses, counts, itemsize, False):
        raise _too_small(fused, counts, itemsize)
