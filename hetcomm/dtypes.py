"""The dtypes hetcomm moves, and every fact about them the library and its kernels use.

One row per logical dtype: its numpy view, what hetcomm's CPU kernels compute on, the C type
of the GPU kernels, the MPI datatype and NCCL code it travels as, and its fingerprint code.
Every transport, arrays.py, ops.py, comm.py and kernels/ read this table; none keeps its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Dtype:
    """What one logical dtype is, for each library that handles it."""

    name: str
    #: "bool", "int", "uint" or "float"
    kind: str
    #: the numpy dtype of a host view (numpy has no bfloat16: its bits live in uint16)
    numpy: np.dtype
    #: what the CPU kernels compute on (Numba has no float16 arithmetic: halves as uint16 bits)
    bits: np.dtype
    #: the element type of the CUDA/HIP kernels (None: the halves, widened by their own code)
    ctype: str | None
    #: the mpi4py datatype it travels as (an MPI.* name): bool as uint8 0/1; the halves as
    #: uint16 bits, which MPI moves but never reduces (hetcomm's own kernels do)
    mpi: str
    #: ncclDataType_t (nccl.h; the same in RCCL); None where NCCL has none (int16)
    nccl: int | None
    #: the dtype's code in operation fingerprints (its position in DTYPES)
    code: int

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return self.numpy.itemsize


_ROWS = (
    # name, kind, numpy, bits, ctype, mpi, nccl
    ("bool", "bool", "bool", "bool", "unsigned char", "UINT8_T", 1),
    ("int8", "int", "int8", "int8", "signed char", "INT8_T", 0),
    ("int16", "int", "int16", "int16", "short", "INT16_T", None),
    ("int32", "int", "int32", "int32", "int", "INT32_T", 2),
    ("int64", "int", "int64", "int64", "long long", "INT64_T", 4),
    ("uint8", "uint", "uint8", "uint8", "unsigned char", "UINT8_T", 1),
    ("float16", "float", "float16", "uint16", None, "UINT16_T", 6),
    ("bfloat16", "float", "uint16", "uint16", None, "UINT16_T", 9),
    ("float32", "float", "float32", "float32", "float", "FLOAT", 7),
    ("float64", "float", "float64", "float64", "double", "DOUBLE", 8),
)

#: name -> Dtype, in the order of DTYPES
TABLE: dict[str, Dtype] = {
    row[0]: Dtype(row[0], row[1], np.dtype(row[2]), np.dtype(row[3]), row[4], row[5], row[6], i)
    for i, row in enumerate(_ROWS)
}
DTYPES: tuple[str, ...] = tuple(TABLE)
FLOATS: tuple[str, ...] = tuple(n for n, d in TABLE.items() if d.kind == "float")
HALVES: tuple[str, ...] = ("float16", "bfloat16")
#: fingerprint code of each dtype
CODES: dict[str, int] = {n: d.code for n, d in TABLE.items()}

#: bool travels as uint8 0/1, so its reductions are logical: SUM and MAX are "or", PROD and
#: MIN are "and" (on 0/1, "or" is MAX and "and" is MIN; AVG is refused for bool, ops.py)
BOOL_REDUCTION: dict[str, str] = {"sum": "or", "max": "or", "prod": "and", "min": "and"}
#: the same rule for a library that only has MAX and MIN (MPI, NCCL)
BOOL_AS_MINMAX: dict[str, str] = {"sum": "max", "max": "max", "prod": "min", "min": "min"}


def info(name: str) -> Dtype:
    """The row of logical dtype `name` (KeyError for an unknown name)."""
    return TABLE[name]


def storage_dtype(name: str) -> np.dtype:
    """The numpy dtype of a host view of logical dtype `name` (uint16 for bfloat16)."""
    return TABLE[name].numpy
