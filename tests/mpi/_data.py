"""Inputs, placements and reference results shared by the MPI tests.

Every rank draws the inputs of *every* rank from one generator seeded with `shared_seed`, so each
rank computes the expected result by itself, with numpy, without trusting any communication.
Values are "logical" numpy arrays: bool, int64 for the integer dtypes, float64 for the floats,
always exactly representable in the dtype under test.

Arrays handed to hetcomm are "placed" inside a larger backing array whose other elements hold a
sentinel, so that a test can check that an operation wrote its output and nothing else.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch

from hetcomm import ReduceOp, dtypes

DTYPES = dtypes.DTYPES  # every dtype of the API (tests/unit/test_dtypes.py pins them)
INTS = ("int8", "int16", "int32", "int64", "uint8")
FLOATS = ("float16", "bfloat16", "float32", "float64")
REDUCE_OPS = tuple(ReduceOp)

# (library, dtype): numpy has no bfloat16, so that one runs with torch only
CASES = [
    pytest.param(lib, dtype, id=f"{lib}-{dtype}")
    for lib in ("numpy", "torch")
    for dtype in DTYPES
    if not (lib == "numpy" and dtype == "bfloat16")
]

# (logical shape, layout): empty, one element, odd sizes, 2-D, large, and two non-contiguous
# layouts
SHAPES: tuple[tuple[tuple[int, ...], str], ...] = (
    ((0,), "contiguous"),
    ((), "contiguous"),  # a 0-d array: one element
    ((1,), "contiguous"),
    ((7,), "contiguous"),
    ((3, 5), "contiguous"),
    ((20_001,), "contiguous"),  # over 64 KiB for the wider dtypes: the "large" size class
    ((5,), "strided"),  # every other element of a 1-D array
    ((3, 5), "transposed"),  # numpy .T / torch .t() of a (5, 3) array
)

# unit of relative error allowed per rank taking part, by dtype (see `compare`)
_EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-22, "float64": 2.0**-50}
_PAD = 3  # sentinel elements before and after a placed array


# ---- drawing inputs ---------------------------------------------------------------------------


def draw(rng: np.random.Generator, dtype: str, shape: Sequence[int], size: int) -> np.ndarray:
    """The inputs of all `size` ranks, stacked: logical values of shape (size, *shape).

    Integers are small enough that the product over the ranks stays in range; floats have
    magnitudes in [0.5, 2] (random sign) so that products neither underflow nor overflow.
    """
    full = (size, *shape)
    if dtype == "bool":
        return rng.random(full) < 0.75
    if dtype in INTS:
        info = np.iinfo(dtype)
        hi = max(1, min(1000, int(float(info.max) ** (1.0 / size))))
        lo = 0 if info.min == 0 else -hi
        return rng.integers(lo, hi, size=full, endpoint=True, dtype=np.int64)
    values = rng.uniform(0.5, 2.0, size=full) * rng.choice([-1.0, 1.0], size=full)
    return round_to(values, dtype)


def round_to(values: np.ndarray, dtype: str) -> np.ndarray:
    """float64 values rounded to the nearest value of `dtype` (still as float64)."""
    if dtype == "bfloat16":
        t = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float64))
        return t.to(torch.bfloat16).to(torch.float64).numpy()
    if dtype in FLOATS:
        return values.astype(dtype).astype(np.float64)
    return values


def sentinel(dtype: str) -> Any:
    """A value, exact in `dtype`, that the inputs never take."""
    if dtype == "bool":
        return True
    if dtype == "uint8":
        return 177
    return -77


# ---- converting -------------------------------------------------------------------------------


def to_array(values: np.ndarray, dtype: str, lib: str) -> Any:
    """A new contiguous numpy array or torch CPU tensor of `dtype` holding `values`."""
    if lib == "numpy":
        assert dtype != "bfloat16", "numpy has no bfloat16"
        return np.array(values, dtype=dtype)
    t = torch.from_numpy(np.array(values))
    return t.to(getattr(torch, dtype)).clone()


def logical(arr: Any) -> np.ndarray:
    """A numpy copy of `arr` in its logical domain: bool, int64 or float64."""
    if isinstance(arr, torch.Tensor):
        t = arr.detach()
        if t.dtype == torch.bool:
            return t.numpy().copy()
        if t.is_floating_point():
            return t.to(torch.float64).numpy()
        return t.to(torch.int64).numpy()
    a = np.asarray(arr)
    if a.dtype == np.bool_:
        return a.copy()
    if a.dtype.kind in "iu":
        return a.astype(np.int64)
    return a.astype(np.float64)


# ---- placing arrays inside sentinels ----------------------------------------------------------


class Placed:
    """An array of logical `shape` and `layout` carved out of a sentinel-filled backing array.

    `array` is what the test hands to hetcomm; `intact()` says whether every backing element
    outside it (the padding and, for strided layouts, the gaps) still holds the sentinel.
    """

    def __init__(self, values: np.ndarray, dtype: str, lib: str, layout: str) -> None:
        shape = tuple(values.shape)
        n = int(np.prod(shape, dtype=np.int64))
        self.dtype, self.layout = dtype, layout
        self.sentinel = sentinel(dtype)
        span = 2 * n if layout == "strided" else n
        self._total = span + 2 * _PAD
        self.backing = to_array(np.full(self._total, self.sentinel), dtype, lib)
        self.array = _carve(self.backing, shape, layout)
        self.positions = _carve(np.arange(self._total), shape, layout)  # backing index of each
        self.array[...] = to_array(values, dtype, lib)
        assert (logical(self.backing)[self.positions] == values).all(), "a view, not a copy"
        contiguous = (
            self.array.flags.c_contiguous
            if isinstance(self.array, np.ndarray)
            else self.array.is_contiguous()
        )
        assert contiguous == (layout == "contiguous" or n <= 1), (layout, shape)

    def values(self) -> np.ndarray:
        """The logical values now in the placed array."""
        return logical(self.array)

    def intact(self) -> bool:
        """True when nothing outside the placed array was written."""
        outside = np.ones(self._total, dtype=bool)
        outside[self.positions.reshape(-1)] = False
        return bool((logical(self.backing)[outside] == self.sentinel).all())


def _carve(base: Any, shape: tuple[int, ...], layout: str) -> Any:
    n = int(np.prod(shape, dtype=np.int64))
    if layout == "contiguous":
        return base[_PAD : _PAD + n].reshape(shape)
    if layout == "strided":
        assert len(shape) == 1, "strided layouts are 1-D"
        return base[_PAD : _PAD + 2 * n : 2]
    if layout == "transposed":
        assert len(shape) == 2, "transposed layouts are 2-D"
        inner = base[_PAD : _PAD + n].reshape(shape[1], shape[0])
        return inner.T if isinstance(inner, np.ndarray) else inner.t()
    raise ValueError(layout)


# ---- references -------------------------------------------------------------------------------


def reference(stack: np.ndarray, op: ReduceOp, dtype: str) -> np.ndarray:
    """The reduction over axis 0 (the ranks) of logical values, as hetcomm defines it.

    bool: SUM and MAX are "any", PROD and MIN are "all". Integers wrap around in their dtype
    (SUM and PROD) and AVG truncates the wrapped sum toward zero. Floats: exact, in float64.
    """
    n = stack.shape[0]
    if dtype == "bool":
        return stack.any(axis=0) if op in (ReduceOp.SUM, ReduceOp.MAX) else stack.all(axis=0)
    if op is ReduceOp.MIN:
        return stack.min(axis=0)
    if op is ReduceOp.MAX:
        return stack.max(axis=0)
    if dtype in INTS:
        if op is ReduceOp.PROD:
            return _wrap(stack.prod(axis=0), dtype)
        total = _wrap(stack.sum(axis=0), dtype)
        if op is ReduceOp.AVG:
            return np.sign(total) * (np.abs(total) // n)
        return total
    if op is ReduceOp.PROD:
        return stack.prod(axis=0)
    total = stack.sum(axis=0)
    return total / n if op is ReduceOp.AVG else total


def _wrap(values: np.ndarray, dtype: str) -> np.ndarray:
    return values.astype(dtype).astype(np.int64)


def compare(
    got: np.ndarray,
    want: np.ndarray,
    what: str,
    *,
    stack: np.ndarray | None = None,
    op: ReduceOp | None = None,
    dtype: str = "",
) -> list[str]:
    """[] when `got` matches `want`, else one message naming `what` and the first differences.

    Exact, except for float SUM, AVG and PROD of `stack` (the inputs of every rank): there each
    pairwise step rounds, so |got - want| may reach size * eps(dtype) * scale, where scale is
    sum(|x|) for SUM, that divided by size for AVG and |product| for PROD.
    """
    if got.shape != want.shape:
        return [f"{what}: shape {got.shape}, expected {want.shape}"]
    inexact = stack is not None and dtype in FLOATS and op not in (ReduceOp.MIN, ReduceOp.MAX)
    if not inexact:
        bad = got != want
    else:
        assert stack is not None
        n = stack.shape[0]
        if op is ReduceOp.PROD:
            scale = np.abs(stack).prod(axis=0)
        else:
            scale = np.abs(stack).sum(axis=0) / (n if op is ReduceOp.AVG else 1)
        tol = n * _EPS[dtype] * scale
        bad = ~(np.abs(got - want) <= tol)  # NaN counts as bad
    if not bad.any():
        return []
    where = np.argwhere(bad)[:3]
    shown = ", ".join(
        f"{tuple(int(i) for i in w)}: got {got[tuple(w)]}, want {want[tuple(w)]}" for w in where
    )
    return [f"{what}: {int(bad.sum())} of {bad.size} elements differ ({shown})"]


# ---- bad calls -----------------------------------------------------------------------------------

# what the call was -> (the call, words its error message must hold)
Cases = dict[str, tuple[Callable[[], Any], Sequence[str]]]


def expect_raises(
    errors, exc_type: type[Exception], cases: Cases, untouched: Sequence[Any] = ()
) -> None:
    """Each call of `cases` must raise `exc_type` with every one of its words in the message,
    and leave every array of `untouched` with the contents it had before."""
    for what, (call, words) in cases.items():
        before = [snapshot(a) for a in untouched]
        try:
            call()
        except exc_type as exc:
            missing = [w for w in words if w not in str(exc)]
            errors.expect(not missing, f"{what}: message {str(exc)!r} lacks {missing}")
        except Exception as exc:
            errors.append(f"{what}: raised {type(exc).__name__}({exc}), not {exc_type.__name__}")
        else:
            errors.append(f"{what}: did not raise {exc_type.__name__}")
        for i, (a, old) in enumerate(zip(untouched, before)):
            errors.expect(np.array_equal(snapshot(a), old), f"{what}: buffer {i} was changed")


def snapshot(a: Any) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        t = a.detach()
        return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().copy()
    return np.array(a, copy=True)


def pair_exchange(comm: Any, peer: int, send: Any, recv_into: Any, tag: int = 0) -> None:
    """One message each way between `comm`'s rank and `peer`: the even rank sends first, the
    odd one receives first (a send over the rails waits for its receive)."""
    if comm.rank % 2 == 0:
        comm.send(send, peer, tag=tag)
        comm.recv(recv_into, peer, tag=tag)
    else:
        comm.recv(recv_into, peer, tag=tag)
        comm.send(send, peer, tag=tag)
