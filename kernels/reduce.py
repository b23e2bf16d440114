"""Element-wise reductions of host arrays, compiled by Numba."""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import Any, cast

import llvmlite.binding as llvm
import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import config
from numba.extending import intrinsic, overload

from ..dtypes import BOOL_REDUCTION, DTYPES, HALVES, TABLE

__all__ = [
    "DTYPES",
    "OPS",
    "combine",
    "divide",
    "from_float32",
    "reduce_rows",
    "storage_dtype",
    "to_float32",
]

OPS = ("sum", "prod", "min", "max")

# Numba cannot do float16 arithmetic on the CPU and numpy has no bfloat16, so both halves are
# stored as uint16 bit patterns and widened to float32 inside the kernels (dtypes.Dtype.bits).
_STORAGE = {name: d.bits for name, d in TABLE.items()}
_OP_CODE = {op: code for code, op in enumerate(OPS)}

# Standard dtypes go through numpy ufuncs with out=: they are already vectorized and wrap integers
# the way MPI expects. bool has no arithmetic, so the ops become logical or/and.
_UFUNCS = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}
_LOGICAL_UFUNCS = {"or": np.logical_or, "and": np.logical_and}

_U = np.uint32
# No parallel=True: each MPI rank already owns a core. cache=True spares later processes the
# compile; nothing compiles at import, each kernel compiles on its first call.
_jit = numba.njit(cache=True, nogil=True, fastmath=False, boundscheck=False)


# ---- scalar casts: Numba has no scalar view() or half type, so emit the LLVM instructions -----


def _cast_intrinsic(
    src: types.Type, dst: types.Type, emit: Callable[[ir.IRBuilder, ir.Value], ir.Value]
) -> Callable[[Any], Any]:
    def typer(typingctx: Any, x: types.Type) -> Any:
        return (dst(src), lambda ctx, b, sig, args: emit(b, args[0])) if x == src else None

    return cast("Callable[[Any], Any]", intrinsic(typer))


_as_f32 = _cast_intrinsic(types.uint32, types.float32, lambda b, v: b.bitcast(v, ir.FloatType()))
_as_u32 = _cast_intrinsic(types.float32, types.uint32, lambda b, v: b.bitcast(v, ir.IntType(32)))
_fpext_half = _cast_intrinsic(
    types.uint16, types.float32, lambda b, v: b.fpext(b.bitcast(v, ir.HalfType()), ir.FloatType())
)
_fptrunc_half = _cast_intrinsic(
    types.float32, types.uint16, lambda b, v: b.bitcast(b.fptrunc(v, ir.HalfType()), ir.IntType(16))
)


@functools.cache
def _hardware_half() -> bool:
    """Whether LLVM will lower half<->float to F16C instructions for Numba's target.

    Without F16C, LLVM emits calls to compiler-rt helpers that Numba's JIT does not provide (the
    process crashes), so only x86-64 targets that advertise F16C take the hardware path. The
    decision follows Numba's own target features, which are also part of its cache key.
    """
    if not llvm.get_process_triple().startswith("x86_64"):
        return False
    features = getattr(config, "CPU_FEATURES", None)  # NUMBA_CPU_FEATURES, if set
    if features is None:
        features = llvm.get_host_cpu_features().flatten()
    return "+f16c" in features.split(",")


# ---- portable conversions (bit manipulation; exhaustively checked against numpy) -------------
# Numba widens uint32 arithmetic to uint64; the _U() casts keep it 32-bit (twice the vector
# lanes) and make the wrap-around in the rounding arithmetic explicit.


@numba.njit(inline="always")
def _soft_f16_to_f32(h: np.uint16) -> np.float32:
    mag = _U(_U(h & 0x7FFF) << 13)
    # Read as float32 this is the value scaled by 2**-112; multiplying back by a power of two is
    # exact and turns float16 subnormals (float32 subnormals here) into normal numbers.
    bits = _as_u32(_as_f32(mag) * np.float32(2.0**112))
    # Exponent 31 (Inf/NaN) must become 255, keeping the mantissa (NaN payload, quiet bit).
    bits = _U(mag | 0x7F800000) if mag >= _U(0x0F800000) else bits
    return _as_f32(_U(bits | _U(_U(h & 0x8000) << 16)))


@numba.njit(inline="always")
def _soft_f32_to_f16(f: np.float32) -> np.uint16:
    u = _as_u32(f)
    sign = _U(_U(u >> 16) & 0x8000)
    a = _U(u & 0x7FFFFFFF)
    # Results below 2**-14 are float16 subnormals: adding 0.5 puts their bits at the bottom of
    # the float32 mantissa, and the FPU's own round-to-nearest-even does the rounding.
    sub = _U(_as_u32(_as_f32(a) + np.float32(0.5)) - _U(0x3F000000))
    # Normal results: rebias the exponent (+0xC8000000 == -112 << 23 mod 2**32) and round the 13
    # dropped bits to nearest even; a carry out of the mantissa bumps the exponent, up to Inf.
    nrm = _U(_U(_U(a + _U(0xC8000FFF)) + _U(_U(a >> 13) & 1)) >> 13)
    r = sub if a < _U(0x38800000) else nrm
    r = _U(0x7C00) if a >= _U(0x47800000) else r  # >= 65520 rounds to Inf (also Inf itself)
    r = _U(_U(_U(a >> 13) & 0x1FF) | 0x7E00) if a > _U(0x7F800000) else r  # NaN: quiet
    return np.uint16(r | sign)


def _f16_to_f32(h: np.uint16) -> np.float32:
    raise NotImplementedError("only callable from Numba-compiled code")


def _f32_to_f16(f: np.float32) -> np.uint16:
    raise NotImplementedError("only callable from Numba-compiled code")


# The overloads pick the implementation while a kernel is being compiled: F16C's vcvtph2ps and
# vcvtps2ph are exact IEEE conversions (RNE) and make float16 reductions memory-bound.
@overload(_f16_to_f32)
def _ov_f16_to_f32(h):
    if _hardware_half():
        return lambda h: _fpext_half(h)
    return lambda h: _soft_f16_to_f32(h)


@overload(_f32_to_f16)
def _ov_f32_to_f16(f):
    if _hardware_half():
        return lambda f: _fptrunc_half(f)
    return lambda f: _soft_f32_to_f16(f)


@numba.njit(inline="always")
def _bf16_to_f32(h: np.uint16) -> np.float32:
    return _as_f32(_U(_U(h) << 16))


@numba.njit(inline="always")
def _f32_to_bf16(f: np.float32) -> np.uint16:
    u = _as_u32(f)
    # Round to nearest even on the dropped low half; overflow carries into Inf naturally.
    r = _U(_U(_U(u + 0x7FFF) + _U(_U(u >> 16) & 1)) >> 16)
    # NaN must not round (it could carry into Inf or the sign): truncate and set the quiet bit.
    r = _U(_U(u >> 16) | 0x40) if _U(u & 0x7FFFFFFF) > _U(0x7F800000) else r
    return np.uint16(r)


@numba.njit(inline="always")
def _apply(a: np.float32, b: np.float32, op: int) -> np.float32:
    # op is loop-invariant, so LLVM unswitches the loops below into one vectorized loop per op.
    if op == 0:
        return a + b
    if op == 1:
        return a * b
    # Like numpy's minimum/maximum, a NaN in either operand wins; returning a + b for it (rather
    # than the NaN operand) quiets a signaling NaN, which LLVM would otherwise pass through by
    # folding away the float16 -> float32 -> float16 round trip of a selected operand.
    if op == 2:
        return a if a <= b else (b if b < a else a + b)
    return a if a >= b else (b if b > a else a + b)


# ---- kernels ----------------------------------------------------------------------------------


@_jit
def _combine_f16(x: np.ndarray, y: np.ndarray, op: int) -> None:
    for i in range(x.shape[0]):
        x[i] = _f32_to_f16(_apply(_f16_to_f32(x[i]), _f16_to_f32(y[i]), op))


@_jit
def _combine_bf16(x: np.ndarray, y: np.ndarray, op: int) -> None:
    for i in range(x.shape[0]):
        x[i] = _f32_to_bf16(_apply(_bf16_to_f32(x[i]), _bf16_to_f32(y[i]), op))


@_jit
def _divide_f16(x: np.ndarray, n: np.int64) -> None:
    d = np.float32(n)
    for i in range(x.shape[0]):
        x[i] = _f32_to_f16(_f16_to_f32(x[i]) / d)


@_jit
def _divide_bf16(x: np.ndarray, n: np.int64) -> None:
    d = np.float32(n)
    for i in range(x.shape[0]):
        x[i] = _f32_to_bf16(_bf16_to_f32(x[i]) / d)


@_jit
def _divide_int(x: np.ndarray, n: np.int64) -> None:
    # Numba's // floors like Python; MPI/C averaging truncates toward zero, so undo the floor
    # for negative quotients with a remainder. |q| <= |v|, so narrowing back cannot overflow.
    for i in range(x.shape[0]):
        v = np.int64(x[i])
        q = v // n
        if v < 0 and q * n != v:
            q += 1
        x[i] = q


@_jit
def _f16_to_f32_array(src: np.ndarray, out: np.ndarray) -> None:
    for i in range(src.shape[0]):
        out[i] = _f16_to_f32(src[i])


@_jit
def _f32_to_f16_array(src: np.ndarray, out: np.ndarray) -> None:
    for i in range(src.shape[0]):
        out[i] = _f32_to_f16(src[i])


@_jit
def _bf16_to_f32_array(src: np.ndarray, out: np.ndarray) -> None:
    for i in range(src.shape[0]):
        out[i] = _bf16_to_f32(src[i])


@_jit
def _f32_to_bf16_array(src: np.ndarray, out: np.ndarray) -> None:
    for i in range(src.shape[0]):
        out[i] = _f32_to_bf16(src[i])


# The portable path, compiled on demand so tests can check it on machines that have F16C.
@_jit
def _soft_f16_to_f32_array(src: np.ndarray, out: np.ndarray) -> None:
    for i in range(src.shape[0]):
        out[i] = _soft_f16_to_f32(src[i])


@_jit
def _soft_f32_to_f16_array(src: np.ndarray, out: np.ndarray) -> None:
    for i in range(src.shape[0]):
        out[i] = _soft_f32_to_f16(src[i])


# ---- validation and public API ----------------------------------------------------------------


def _check_dtype(dtype: object) -> str:
    if not isinstance(dtype, str):
        raise TypeError(f"dtype must be a str, one of {DTYPES}; got {type(dtype).__name__}")
    if dtype not in _STORAGE:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {DTYPES}")
    return dtype


def _check_half(dtype: object) -> None:
    if _check_dtype(dtype) not in HALVES:
        raise ValueError(f"dtype must be one of {HALVES}, got {dtype!r}")


def _check_array(
    name: str,
    arr: object,
    expected: np.dtype,
    what: str,
    writeable: bool = False,
    one_d: bool = True,
) -> np.ndarray:
    if not isinstance(arr, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray, got {type(arr).__name__}")
    if arr.dtype != expected:
        raise TypeError(f"{name} must have dtype {expected} ({what}), got {arr.dtype}")
    if one_d and arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got {arr.ndim}-D with shape {arr.shape}")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous, got strides {arr.strides}")
    if writeable and not arr.flags.writeable:
        raise ValueError(f"{name} must be writeable, got a read-only array")
    return arr


def storage_dtype(dtype: str) -> np.dtype:
    """The numpy dtype that stores values of the logical *dtype* (uint16 bits for halves)."""
    return _STORAGE[_check_dtype(dtype)]


def combine(inout: np.ndarray, other: np.ndarray, op: str, dtype: str) -> None:
    """In place, element-wise: ``inout[i] = inout[i] <op> other[i]``."""
    expected = storage_dtype(dtype)
    if not isinstance(op, str) or op not in _OP_CODE:
        raise ValueError(f"unknown op {op!r}; expected one of {OPS}")
    what = f"storage of {dtype}"
    _check_array("inout", inout, expected, what, writeable=True)
    _check_array("other", other, expected, what)
    if inout.shape != other.shape:
        raise ValueError(
            f"inout and other must have the same length, got {inout.shape[0]} and {other.shape[0]}"
        )
    if inout.size == 0:
        return
    if dtype == "float16":
        _combine_f16(inout, other, _OP_CODE[op])
    elif dtype == "bfloat16":
        _combine_bf16(inout, other, _OP_CODE[op])
    elif dtype == "bool":
        _LOGICAL_UFUNCS[BOOL_REDUCTION[op]](inout, other, out=inout)
    else:
        # Overflow to Inf and Inf - Inf = NaN are the IEEE results we want, not warnings.
        with np.errstate(all="ignore"):
            _UFUNCS[op](inout, other, out=inout)


@_jit
def _reduce_rows(op: int, rows: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover (jit)
    n, m = rows.shape
    for j in range(m):
        acc = rows[0, j]
        for i in range(1, n):
            v = rows[i, j]
            if op == 0:
                acc = acc + v
            elif op == 1:
                acc = acc * v
            elif op == 2:
                if v < acc or v != v:  # a NaN wins, as np.minimum's does
                    acc = v
            elif v > acc or v != v:
                acc = v
        out[j] = acc


def reduce_rows(rows: np.ndarray, out: np.ndarray, op: str) -> None:
    """``out[j] = rows[0, j] <op> rows[1, j] <op> ...``, in row order, for a 2-D `rows` of any
    strides and a 1-D `out` of its dtype and row length: one call where `combine` would take one
    per row (each paying numpy's dispatch and error-state switch, microseconds at small sizes).
    numpy dtypes only (not the halves' bit patterns); integers wrap, and on bool sum and max are
    "or", prod and min "and", as `combine` makes them. The caller has checked the arguments."""
    _reduce_rows(_OP_CODE[op], rows, out)


def rows_reducer(op: str) -> Callable[[np.ndarray, np.ndarray], None]:
    """`reduce_rows(rows, out, op)` as `f(rows, out)`, the op looked up once: one jitted call
    for callers that reduce with one op again and again (a carried collective's route)."""
    if op not in _OP_CODE:
        raise ValueError(f"unknown op {op!r}; expected one of {OPS}")
    return functools.partial(_reduce_rows, _OP_CODE[op])


def divide(inout: np.ndarray, n: int, dtype: str) -> None:
    """In place ``inout[i] /= n`` for averaging; integers truncate toward zero like C."""
    expected = storage_dtype(dtype)
    if dtype == "bool":
        raise TypeError("divide is not defined for dtype 'bool'")
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise TypeError(f"n must be an int, got {type(n).__name__}")
    n = operator.index(n)
    if not 1 <= n <= np.iinfo(np.int64).max:
        raise ValueError(f"n must be in [1, 2**63 - 1], got {n}")
    _check_array("inout", inout, expected, f"storage of {dtype}", writeable=True)
    if inout.size == 0 or n == 1:
        return
    if dtype == "float16":
        _divide_f16(inout, np.int64(n))
    elif dtype == "bfloat16":
        _divide_bf16(inout, np.int64(n))
    elif dtype in ("float32", "float64"):
        with np.errstate(all="ignore"):
            np.divide(inout, inout.dtype.type(n), out=inout)
    else:
        _divide_int(inout, np.int64(n))


def to_float32(src: np.ndarray, dtype: str) -> np.ndarray:
    """Widen float16/bfloat16 bit patterns (uint16, any shape) to a new float32 array, exactly."""
    _check_half(dtype)
    _check_array("src", src, np.dtype(np.uint16), f"bits of {dtype}", one_d=False)
    out = np.empty(src.shape, np.float32)
    if src.size:
        kernel = _f16_to_f32_array if dtype == "float16" else _bf16_to_f32_array
        kernel(src.reshape(-1), out.reshape(-1))
    return out


def from_float32(src: np.ndarray, dtype: str, out: np.ndarray | None = None) -> np.ndarray:
    """Round float32 values to float16/bfloat16 bit patterns (uint16), to nearest even."""
    _check_half(dtype)
    _check_array("src", src, np.dtype(np.float32), "float32 values", one_d=False)
    if out is None:
        out = np.empty(src.shape, np.uint16)
    else:
        _check_array(
            "out", out, np.dtype(np.uint16), f"bits of {dtype}", writeable=True, one_d=False
        )
        if out.shape != src.shape:
            raise ValueError(f"out must have the shape of src {src.shape}, got {out.shape}")
    if src.size:
        kernel = _f32_to_f16_array if dtype == "float16" else _f32_to_bf16_array
        kernel(src.reshape(-1), out.reshape(-1))
    return out
