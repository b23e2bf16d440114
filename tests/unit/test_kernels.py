"""Unit tests for hetcomm.kernels.reduce: Numba element-wise reductions of host arrays."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np
import pytest
import torch
from hetcomm.kernels import reduce

INTS = ("int8", "int16", "int32", "int64", "uint8")
HALVES = ("float16", "bfloat16")
FLOATS = ("float16", "bfloat16", "float32", "float64")
LENGTHS = (0, 1, 7, 4097)
QUIET = {"float16": 0x0200, "bfloat16": 0x0040}


@pytest.fixture
def rng() -> tuple[np.random.Generator, str]:
    """A fresh generator per test, and a note naming its seed for failure messages."""
    seed = int(os.environ.get("HETCOMM_TEST_SEED") or np.random.SeedSequence().entropy)
    return np.random.default_rng(seed), f"(seed {seed}; rerun with HETCOMM_TEST_SEED={seed})"


# ---- independent references: numpy's float16 and torch's bfloat16 (both round to nearest even)


def decode(bits: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float16":
        return bits.view(np.float16).astype(np.float32)
    return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float().numpy()


def encode(values: np.ndarray, dtype: str) -> np.ndarray:
    values = np.ascontiguousarray(values, np.float32)
    if dtype == "float16":
        with np.errstate(all="ignore"):
            return values.astype(np.float16).view(np.uint16)
    return torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def special_values(dtype: str) -> np.ndarray:
    """Bit patterns of edge cases; every pair of them is combined in test_half_special_pairs."""
    if dtype == "float16":
        tiny, eps, big = 2.0**-24, 2.0**-10, 65504.0  # min subnormal, ulp of 1, max finite
        extra = [2.0**-14, 2.0**-14 - tiny, 3 * tiny, 16.0, 15.0, 2048.0]
        raw = [0x7C01, 0xFE00, 0x7E00]  # signaling NaN, negative NaN, quiet NaN
    else:
        tiny, eps = 2.0**-133, 2.0**-7
        big = float(np.array([0x7F7F0000], np.uint32).view(np.float32)[0])
        extra = [2.0**-126, 2.0**-126 - tiny, 3 * tiny, 2.0**120, 256.0]
        raw = [0x7F81, 0xFFC0, 0x7FC0]
    values = [
        0.0,
        -0.0,
        np.inf,
        -np.inf,
        big,
        -big,
        tiny,
        -tiny,
        0.5,
        1.5,
        -1.0,
        3.0,
        1.0 + eps,
        eps / 2,
        -eps / 2,
        eps / 4,
        *extra,
    ]
    bits = encode(np.array(values, np.float32), dtype)
    assert (decode(bits, dtype) == np.array(values, np.float32)).all(), "not representable"
    return np.concatenate([bits, np.array(raw, np.uint16)])


def random_bits(rng: np.random.Generator, n: int, dtype: str) -> np.ndarray:
    """A mix of arbitrary bit patterns, values near 1, tiny values, and special values."""
    kind = rng.integers(0, 4, size=n)
    scale = 2.0**-14 if dtype == "float16" else 2.0**-126
    out = np.where(
        kind == 0,
        rng.integers(0, 1 << 16, size=n).astype(np.uint16),
        encode(rng.standard_normal(n) * 4, dtype),
    )
    out = np.where(kind == 2, encode(rng.standard_normal(n) * scale, dtype), out)
    specials = special_values(dtype)
    return np.where(kind == 3, specials[rng.integers(0, specials.size, size=n)], out)


def random_values(rng: np.random.Generator, n: int, dtype: str) -> np.ndarray:
    if dtype in HALVES:
        return random_bits(rng, n, dtype)
    if dtype == "bool":
        return rng.integers(0, 2, size=n).astype(bool)
    if dtype in INTS:
        info = np.iinfo(dtype)
        out = rng.integers(info.min, info.max, size=n, dtype=dtype, endpoint=True)
        small = rng.integers(-20, 21, size=n).astype(dtype)  # small products do not only wrap
        out = np.where(rng.integers(0, 2, size=n) == 0, small, out)
        out[rng.random(n) < 0.05] = info.min
        out[rng.random(n) < 0.05] = info.max
        return out
    bits = rng.integers(0, 2**64, size=n, dtype=np.uint64)
    # arbitrary bit patterns: NaN, Inf, subnormals, huge, tiny
    raw = bits.astype(np.uint32).view(np.float32) if dtype == "float32" else bits.view(np.float64)
    out = np.where(rng.integers(0, 2, size=n) == 0, raw, rng.standard_normal(n).astype(dtype))
    specials = np.array(
        [
            0.0,
            -0.0,
            np.inf,
            -np.inf,
            np.nan,
            np.finfo(dtype).max,
            np.finfo(dtype).smallest_subnormal,
            0.5,
            1.0,
        ],
        dtype,
    )
    pick = rng.random(n) < 0.2
    out[pick] = specials[rng.integers(0, specials.size, size=int(pick.sum()))]
    return out


def minmax_ref(a: np.ndarray, b: np.ndarray, op: str) -> np.ndarray:
    """NaN-propagating min/max written out, rather than trusting np.minimum/np.maximum."""
    pick_a = a <= b if op == "min" else a >= b
    return np.where(np.isnan(a) | np.isnan(b), np.nan, np.where(pick_a, a, b)).astype(a.dtype)


def float_ref(a: np.ndarray, b: np.ndarray, op: str) -> np.ndarray:
    with np.errstate(all="ignore"):
        if op == "sum":
            return a + b
        if op == "prod":
            return a * b
    return minmax_ref(a, b, op)


def wrap_int(values: list[int], dtype: str) -> np.ndarray:
    """Two's complement wrap of exact Python integers into `dtype`."""
    info, bits = np.iinfo(dtype), np.dtype(dtype).itemsize * 8
    wrapped = [v % (1 << bits) for v in values]
    if info.min < 0:
        wrapped = [w - (1 << bits) if w > info.max else w for w in wrapped]
    return np.array(wrapped, dtype=dtype)


def reference(a: np.ndarray, b: np.ndarray, op: str, dtype: str) -> np.ndarray:
    if dtype == "bool":
        return (a | b) if op in ("sum", "max") else (a & b)
    if dtype in INTS:
        fn: dict[str, Callable[[int, int], int]] = {
            "sum": lambda x, y: x + y,
            "prod": lambda x, y: x * y,
            "min": min,
            "max": max,
        }
        return wrap_int([fn[op](int(x), int(y)) for x, y in zip(a, b, strict=True)], dtype)
    if dtype in HALVES:
        return encode(float_ref(decode(a, dtype), decode(b, dtype), op), dtype)
    return float_ref(a, b, op)


def assert_matches(
    got: np.ndarray, want: np.ndarray, dtype: str, exact_zero: bool, note: str, quiet: bool = True
) -> None:
    """NaN positions must agree (payloads may differ); other values must agree bit for bit, or
    by value (so +0 == -0) when `exact_zero` is False. Half NaN results must be quiet NaNs."""
    assert got.dtype == want.dtype and got.shape == want.shape, note
    if dtype == "bool" or dtype in INTS:
        bad = np.flatnonzero(got != want)
        assert bad.size == 0, (
            f"{bad.size} mismatches, first at {bad[:5]}: got {got[bad[:5]]} "
            f"want {want[bad[:5]]} {note}"
        )
        return
    gv, wv = (decode(got, dtype), decode(want, dtype)) if dtype in HALVES else (got, want)
    gnan, wnan = np.isnan(gv), np.isnan(wv)
    bad = np.flatnonzero(gnan != wnan)
    assert bad.size == 0, (
        f"NaN positions differ at {bad[:5]}: got {gv[bad[:5]]} want {wv[bad[:5]]} {note}"
    )
    if dtype in HALVES and quiet:
        assert (got[gnan] & QUIET[dtype]).all(), f"a NaN result is not quiet {note}"
    same = (got == want) if exact_zero else (gv == wv)
    bad = np.flatnonzero(~same & ~gnan)
    assert bad.size == 0, (
        f"{bad.size} mismatches, first at {bad[:5]}: got {got[bad[:5]]} "
        f"({gv[bad[:5]]}) want {want[bad[:5]]} ({wv[bad[:5]]}) {note}"
    )


# ---- combine ------------------------------------------------------------------------------------


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("op", reduce.OPS)
@pytest.mark.parametrize("dtype", reduce.DTYPES)
def test_combine(dtype: str, op: str, length: int, rng: tuple[np.random.Generator, str]) -> None:
    gen, note = rng
    a, b = random_values(gen, length, dtype), random_values(gen, length, dtype)
    want = reference(a, b, op, dtype)
    inout, other = a.copy(), b.copy()
    reduce.combine(inout, other, op, dtype)
    assert_matches(inout, want, dtype, op in ("sum", "prod"), f"{dtype} {op} n={length} {note}")
    assert other.tobytes() == b.tobytes(), f"other was modified {note}"


@pytest.mark.parametrize("op", reduce.OPS)
@pytest.mark.parametrize("dtype", HALVES)
def test_half_special_pairs(dtype: str, op: str) -> None:
    """Every pair of edge cases: overflow to Inf, ties to even, subnormal results, NaN, -0."""
    specials = special_values(dtype)
    a, b = (x.ravel().copy() for x in np.meshgrid(specials, specials))
    want = reference(a, b, op, dtype)
    reduce.combine(a, b, op, dtype)
    assert_matches(a, want, dtype, op in ("sum", "prod"), f"{dtype} {op}")


def test_half_rounding_spot_checks() -> None:
    def f16(*values: float) -> np.ndarray:
        return np.array(values, np.float16).view(np.uint16)

    x = f16(1.0, 1.0 + 2**-10, 65504.0, 65504.0, 2.0**-24, -0.0, 1.0)
    reduce.combine(x, f16(2**-11, 2**-11, 15.0, 16.0, 2.0**-24, -0.0, -1.0), "sum", "float16")
    assert x.view(np.float16).tolist() == [1.0, 1.0 + 2**-9, 65504.0, np.inf, 2.0**-23, 0.0, 0.0]
    assert np.signbit(x.view(np.float16)).tolist() == [False] * 5 + [True, False]
    y = f16(2.0**-24, 2.0**-24)
    reduce.combine(y, f16(0.5, 1.5), "prod", "float16")  # ties between subnormals go to even
    assert y.view(np.float16).tolist() == [0.0, 2.0**-23]
    bf = np.array([0x3F80, 0x3F81, 0x7F7F, 0x7F80], np.uint16)  # 1, 1+2**-7, max, Inf
    reduce.combine(bf, np.array([0x3B80, 0x3B80, 0x7F7F, 0xFF80], np.uint16), "sum", "bfloat16")
    assert bf[:3].tolist() == [0x3F80, 0x3F82, 0x7F80] and np.isnan(decode(bf, "bfloat16")[3])


def test_combine_in_place_with_itself() -> None:
    x = np.array([1.0, -2.5, 3.0], np.float16).view(np.uint16)
    reduce.combine(x, x, "sum", "float16")
    assert x.view(np.float16).tolist() == [2.0, -5.0, 6.0]


# ---- divide -------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("dtype", FLOATS)
def test_divide_floats(dtype: str, n: int, rng: tuple[np.random.Generator, str]) -> None:
    gen, note = rng
    a = random_values(gen, 4097, dtype)
    x = a.copy()
    reduce.divide(x, n, dtype)
    with np.errstate(all="ignore"):
        if dtype in HALVES:
            want = encode(decode(a, dtype) / np.float32(n), dtype)
        else:
            want = a / a.dtype.type(n)
    # n == 1 leaves the data alone, signaling NaNs included
    assert_matches(x, want, dtype, True, f"{dtype} / {n} {note}", quiet=n > 1)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 128, 1000, 2**62])
@pytest.mark.parametrize("dtype", INTS)
def test_divide_ints_truncate(dtype: str, n: int, rng: tuple[np.random.Generator, str]) -> None:
    gen, note = rng
    a = random_values(gen, 4097, dtype)
    x = a.copy()
    reduce.divide(x, n, dtype)
    # exact integer division, truncated toward zero as in C
    want = np.array([(abs(int(v)) // n) * (1 if v >= 0 else -1) for v in a], dtype=dtype)
    assert_matches(x, want, dtype, True, f"{dtype} / {n} {note}")


def test_divide_spot_checks() -> None:
    x = np.array([-7, 7, -6, -1, -128, 127], np.int8)
    reduce.divide(x, 2, "int8")
    assert x.tolist() == [-3, 3, -3, 0, -64, 63]
    y = np.array([-128, 100], np.int8)
    reduce.divide(y, 128, "int8")  # n beyond the dtype's range is fine
    assert y.tolist() == [-1, 0]
    z = np.array([3.0, -1.0, np.inf], np.float16).view(np.uint16)
    reduce.divide(z, 2, "float16")
    assert z.view(np.float16).tolist() == [1.5, -0.5, np.inf]
    reduce.divide(np.empty(0, np.int32), 3, "int32")


def test_divide_rejects() -> None:
    with pytest.raises(TypeError, match="bool"):
        reduce.divide(np.ones(3, bool), 2, "bool")
    x = np.ones(3, np.float32)
    for bad_n, exc in [
        (0, ValueError),
        (-2, ValueError),
        (2**63, ValueError),
        (1.5, TypeError),
        (True, TypeError),
        ("2", TypeError),
    ]:
        with pytest.raises(exc, match="n must"):
            reduce.divide(x, bad_n, "float32")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"float32.*got float64"):
        reduce.divide(np.ones(3), 2, "float32")
    with pytest.raises(ValueError, match="writeable"):
        x.flags.writeable = False
        reduce.divide(x, 2, "float32")


# ---- conversions --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", HALVES)
def test_to_float32_exhaustive(dtype: str) -> None:
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    got, want = reduce.to_float32(bits, dtype), decode(bits, dtype)
    assert got.dtype == np.float32 and got.shape == bits.shape
    nan = np.isnan(want)
    assert (np.isnan(got) == nan).all()
    assert (got.view(np.uint32)[~nan] == want.view(np.uint32)[~nan]).all()
    assert reduce.to_float32(bits.reshape(256, 256), dtype).shape == (256, 256)


@pytest.mark.parametrize("dtype", HALVES)
def test_from_float32(dtype: str, rng: tuple[np.random.Generator, str]) -> None:
    gen, note = rng
    # arbitrary bit patterns, plus values on and next to the midpoints between halves
    raw = gen.integers(0, 1 << 32, size=1 << 20, dtype=np.uint64).astype(np.uint32)
    shift = 13 if dtype == "float16" else 16
    mid = (
        gen.integers(0, 1 << 32, size=1 << 16, dtype=np.uint64).astype(np.uint32) >> shift << shift
    ) | np.uint32(1 << (shift - 1))
    src = np.concatenate([raw, mid, mid - 1, mid + 1]).view(np.float32)
    assert_matches(reduce.from_float32(src, dtype), encode(src, dtype), dtype, True, note)
    out = np.empty(src.shape, np.uint16)
    assert reduce.from_float32(src, dtype, out=out) is out
    assert reduce.from_float32(np.zeros((2, 3), np.float32), dtype).shape == (2, 3)


def test_portable_path_matches_numpy(rng: tuple[np.random.Generator, str]) -> None:
    """The bit-manipulation float16 path used where F16C is missing, checked on any machine."""
    gen, note = rng
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    got = np.empty(bits.shape, np.float32)
    reduce._soft_f16_to_f32_array(bits, got)
    want = decode(bits, "float16")
    nan = np.isnan(want)
    assert (np.isnan(got) == nan).all()
    assert (got.view(np.uint32)[~nan] == want.view(np.uint32)[~nan]).all()
    src = gen.integers(0, 1 << 32, size=1 << 20, dtype=np.uint64).astype(np.uint32)
    # around and below float16's subnormal range, and exact ties between subnormals
    src[: 1 << 16] = (gen.standard_normal(1 << 16) * 2.0**-14).astype(np.float32).view(np.uint32)
    ties = (np.arange(1, 2048, 2) * 2.0**-25).astype(np.float32).view(np.uint32)
    src[1 << 16 : (1 << 16) + ties.size] = ties
    out = np.empty(src.shape, np.uint16)
    reduce._soft_f32_to_f16_array(src.view(np.float32), out)
    assert_matches(out, encode(src.view(np.float32), "float16"), "float16", True, note)


# ---- argument checks ----------------------------------------------------------------------------


def test_storage_dtype() -> None:
    assert (
        reduce.storage_dtype("float16") == np.uint16
        and reduce.storage_dtype("bfloat16") == np.uint16
    )
    assert reduce.storage_dtype("bool") == np.bool_ and reduce.storage_dtype("int8") == np.int8
    assert [reduce.storage_dtype(d).name for d in reduce.DTYPES[1:6]] == list(reduce.DTYPES[1:6])
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        reduce.storage_dtype("float8")
    with pytest.raises(TypeError, match="dtype must be a str"):
        reduce.storage_dtype(np.float32)  # type: ignore[arg-type]


def test_combine_rejects() -> None:
    x, y = np.zeros(4, np.uint16), np.zeros(4, np.uint16)
    with pytest.raises(ValueError, match="same length, got 4 and 3"):
        reduce.combine(x, y[:3], "sum", "float16")
    with pytest.raises(TypeError, match=r"inout must have dtype uint16.*got float16"):
        reduce.combine(x.view(np.float16), y, "sum", "float16")
    with pytest.raises(TypeError, match=r"other must have dtype int64.*got int32"):
        reduce.combine(np.zeros(4, np.int64), np.zeros(4, np.int32), "sum", "int64")
    with pytest.raises(ValueError, match="C-contiguous"):
        reduce.combine(np.zeros(8, np.uint16)[::2], y, "sum", "bfloat16")
    with pytest.raises(ValueError, match="1-D"):
        reduce.combine(x.reshape(2, 2), y.reshape(2, 2), "sum", "float16")
    with pytest.raises(ValueError, match=r"unknown op 'avg'; expected one of \('sum'"):
        reduce.combine(x, y, "avg", "float16")
    with pytest.raises(ValueError, match="unknown dtype 'half'"):
        reduce.combine(x, y, "sum", "half")
    with pytest.raises(TypeError, match=r"numpy.ndarray, got list"):
        reduce.combine(x, [0, 0, 0, 0], "sum", "float16")  # type: ignore[arg-type]
    x.flags.writeable = False
    with pytest.raises(ValueError, match="inout must be writeable"):
        reduce.combine(x, y, "sum", "float16")
    y.flags.writeable = False  # a read-only `other` is fine
    reduce.combine(np.ones(4, np.uint16), y, "max", "float16")


def test_conversions_reject() -> None:
    with pytest.raises(ValueError, match="float16"):
        reduce.to_float32(np.zeros(3, np.uint16), "float32")
    with pytest.raises(TypeError, match="src must have dtype uint16"):
        reduce.to_float32(np.zeros(3, np.float16), "float16")
    with pytest.raises(TypeError, match=r"src must have dtype float32.*got float64"):
        reduce.from_float32(np.zeros(3), "bfloat16")
    with pytest.raises(ValueError, match="out must have the shape"):
        reduce.from_float32(np.zeros(3, np.float32), "bfloat16", out=np.zeros(4, np.uint16))
    with pytest.raises(TypeError, match="out must have dtype uint16"):
        reduce.from_float32(np.zeros(3, np.float32), "float16", out=np.zeros(3, np.int16))


def test_import_is_light() -> None:
    """Importing compiles nothing, and the package itself does not pull in Numba."""
    code = (
        "import sys, hetcomm\n"
        "before = 'numba' in sys.modules\n"
        "import hetcomm.kernels\n"
        "assert ('numba' in sys.modules) == before, 'hetcomm.kernels imported numba'\n"
        "assert 'hetcomm.kernels.reduce' not in sys.modules\n"
        "from hetcomm.kernels import reduce as kr\n"
        "from numba.core.dispatcher import Dispatcher\n"
        "ds = [v for v in vars(kr).values() if isinstance(v, Dispatcher)]\n"
        "assert ds and not any(d.signatures for d in ds), ds\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)


def test_speed_report(capsys: pytest.CaptureFixture[str]) -> None:
    """Not an assertion: prints the time of an 8M-element (16 MiB) half-precision sum."""
    n = 8 << 20
    gen = np.random.default_rng()
    lines = []
    for dtype in HALVES:
        a, b = encode(gen.standard_normal(n), dtype), encode(gen.standard_normal(n), dtype)
        reduce.combine(a[:8].copy(), b[:8], "sum", dtype)  # compile outside the timing
        best = float("inf")
        for _ in range(5):
            x = a.copy()
            t0 = time.perf_counter()
            reduce.combine(x, b, "sum", dtype)
            best = min(best, time.perf_counter() - t0)
        lines.append(f"{dtype} sum of {n} elements: {best * 1e3:.2f} ms")
    with capsys.disabled():
        print("\n" + "\n".join(lines), f"(F16C path: {reduce._hardware_half()})")
