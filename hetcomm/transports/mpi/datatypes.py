"""What MPI is given for each hetcomm dtype and reduce op: its datatype, the MPI operation
that reduces it (a predefined one, or hetcomm's own kernel inside a user-defined one where the
library has none or gets it wrong), and the persistent reduction kind that serves the pair."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

from ...dtypes import BOOL_AS_MINMAX, TABLE
from ...ops import ReduceOp
from . import persistent

_NATIVE_OPS = {
    ReduceOp.SUM: MPI.SUM,
    ReduceOp.AVG: MPI.SUM,
    ReduceOp.PROD: MPI.PROD,
    ReduceOp.MIN: MPI.MIN,
    ReduceOp.MAX: MPI.MAX,
}
# the MPI datatype each dtype travels as (dtypes.Dtype.mpi)
DATATYPES = {name: getattr(MPI, d.mpi) for name, d in TABLE.items()}
_INTS = tuple(n for n, d in TABLE.items() if d.kind in ("int", "uint"))


def _bool_as(op: ReduceOp) -> ReduceOp:
    """The MAX or MIN that reduces bool's 0/1 as `op` (dtypes.BOOL_AS_MINMAX)."""
    return ReduceOp(BOOL_AS_MINMAX[op.value])


def _wrong_integer_ops() -> frozenset[tuple[str, str]]:
    """(dtype, op) pairs that this MPI library does not reduce the way C integers wrap.

    Open MPI 5.0's vectorized operations (the op/avx component) saturate SUM of 8- and 16-bit
    integers (127 + 1 gives 127, not -128) once an array holds 16 elements or more. One local
    MPI_Reduce_local per pair, at import, finds out; hetcomm's own kernels reduce those pairs.
    """
    wrong = set()
    for name in _INTS:
        dtype = np.dtype(name)
        big = np.iinfo(dtype).max - 1
        for op, mpi in ((ReduceOp.SUM, MPI.SUM), (ReduceOp.PROD, MPI.PROD)):
            a, b = np.full(64, big, dtype), np.full(64, big, dtype)
            want = a.astype(np.int64) * b if op is ReduceOp.PROD else a.astype(np.int64) + b
            mpi.Reduce_local((a, DATATYPES[name]), (b, DATATYPES[name]))
            if not np.array_equal(b, want.astype(dtype)):
                wrong.add((name, op.value))
                if op is ReduceOp.SUM:
                    wrong.add((name, ReduceOp.AVG.value))
    return frozenset(wrong)


# MPI has no bfloat16 (and float16 only as an extension): those are reduced by hetcomm's own
# kernels inside user-defined MPI operations, one per (dtype, op), created on first use; so are
# the integer reductions that the MPI library gets wrong.
_OWN_OPS: dict[tuple[str, ReduceOp], MPI.Op] = {}
_WRONG = _wrong_integer_ops()
_AVG = ReduceOp.AVG


def _persistent_kinds() -> dict[tuple[str, str], persistent.Kind]:
    """(dtype name, op) -> the kind of persistent reduction that serves it, for every pair MPI
    reduces with a predefined operation (bool as uint8; AVG reduces as SUM, then divides, and
    shares SUM's kind)."""
    kinds: dict[tuple[str, str], persistent.Kind] = {}
    for name, datatype in DATATYPES.items():
        if name in ("float16", "bfloat16"):
            continue
        for op in ReduceOp:
            reduce_as = ReduceOp.SUM if op is _AVG else op
            if (name, reduce_as.value) in _WRONG or (name == "bool" and op is _AVG):
                continue
            kind = kinds.get((name, reduce_as.value))
            if kind is None:
                mop = _NATIVE_OPS[_bool_as(reduce_as)] if name == "bool" else _NATIVE_OPS[reduce_as]
                kind = persistent.Kind(np.dtype(name), datatype, mop)
            kinds[(name, op.value)] = kinds[(name, reduce_as.value)] = kind
    return kinds


PERSISTENT = _persistent_kinds()
_OPS = {
    (d, op.value): mpi
    for d in DATATYPES
    if d not in ("bool", "float16", "bfloat16")
    for op, mpi in _NATIVE_OPS.items()
    if (d, op.value) not in _WRONG
}


def mpi_op(dtype: str, op: ReduceOp) -> MPI.Op:
    """The MPI operation that reduces `dtype` with `op` (AVG reduces as SUM, then divides)."""
    found = _OPS.get((dtype, op._value_))
    if found is not None:
        return found
    if dtype == "bool":
        return _NATIVE_OPS[_bool_as(op)]
    key = (dtype, op)
    found = _OWN_OPS.get(key)
    if found is None:
        found = _OWN_OPS[key] = MPI.Op.Create(_own_reducer(dtype, op), commute=True)
    return found


def _own_reducer(dtype: str, op: ReduceOp) -> Callable[[Any, Any, Any], None]:
    from ...kernels import reduce

    kind = "sum" if op is ReduceOp.AVG else op.value
    combine, storage = reduce.combine, reduce.storage_dtype(dtype)

    def reducer(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
        combine(
            np.frombuffer(inoutbuf, dtype=storage),
            np.frombuffer(inbuf, dtype=storage),
            kind,
            dtype,
        )

    return reducer
