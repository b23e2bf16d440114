"""The dtype table (hetcomm.dtypes) against numpy, MPI and the bool reduction rule."""

from __future__ import annotations

import numpy as np
import pytest

from hetcomm import dtypes


def test_every_dtype_of_the_api_has_one_row_in_order() -> None:
    assert dtypes.DTYPES == (
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "float16",
        "bfloat16",
        "float32",
        "float64",
    )
    assert [dtypes.CODES[n] for n in dtypes.DTYPES] == list(range(len(dtypes.DTYPES)))
    assert dtypes.FLOATS == ("float16", "bfloat16", "float32", "float64")


@pytest.mark.parametrize("name", dtypes.DTYPES)
def test_numpy_views_and_kernel_bits_have_the_dtype_size(name: str) -> None:
    d = dtypes.info(name)
    size = 2 if name == "bfloat16" else np.dtype(name).itemsize
    assert d.itemsize == d.numpy.itemsize == d.bits.itemsize == size
    if name != "bfloat16":
        assert d.numpy == np.dtype(name)
    assert d.bits == (np.dtype(np.uint16) if name in dtypes.HALVES else np.dtype(name))
    assert dtypes.storage_dtype(name) == d.numpy
    assert (d.ctype is None) == (name in dtypes.HALVES)


@pytest.mark.parametrize("name", dtypes.DTYPES)
def test_mpi_datatype_has_the_dtype_size(name: str) -> None:
    from mpi4py import MPI

    assert getattr(MPI, dtypes.info(name).mpi).Get_size() == dtypes.info(name).itemsize


@pytest.mark.parametrize("op", ["sum", "prod", "min", "max"])
def test_the_bool_rule_is_logical_and_matches_min_max_on_0_1(op: str) -> None:
    rng = np.random.default_rng()
    a, b = rng.integers(0, 2, 64).astype(bool), rng.integers(0, 2, 64).astype(bool)
    logical = {"or": np.logical_or, "and": np.logical_and}[dtypes.BOOL_REDUCTION[op]]
    minmax = {"max": np.maximum, "min": np.minimum}[dtypes.BOOL_AS_MINMAX[op]]
    # what the op means on truth values: sum/max any, prod/min all
    meant = {"sum": a | b, "max": a | b, "prod": a & b, "min": a & b}[op]
    assert (logical(a, b) == meant).all()
    assert (minmax(a.astype(np.uint8), b.astype(np.uint8)).astype(bool) == meant).all()
