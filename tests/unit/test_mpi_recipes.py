"""Which persistent collective serves a signature (hetcomm.transports.mpi.recipes): the same
answer from the signature alone, on every rank; none where hetcomm's own kernels reduce, for
dtypes whose numpy storage is their bits, past the byte limit (an all_gather's output)."""

from __future__ import annotations

import numpy as np
import pytest

from hetcomm.ops import ReduceOp
from hetcomm.transports.mpi import recipes
from hetcomm.transports.mpi.datatypes import PERSISTENT


def test_avg_shares_sums_key_and_own_kernels_have_none():
    assert recipes.key("all_reduce", "float32", 4, ReduceOp.AVG, -1) == recipes.key(
        "all_reduce", "float32", 4, ReduceOp.SUM, -1
    )
    assert recipes.key("reduce", "float16", 4, ReduceOp.SUM, 0) is None  # own kernel
    assert recipes.key("reduce", "bool", 4, ReduceOp.AVG, 0) is None
    assert recipes.key("broadcast", "float16", 4, None, 1) == ("broadcast", "float16", None, 4, 1)
    wrong = [pair for pair in (("int8", "sum"), ("int16", "prod")) if pair not in PERSISTENT]
    for dtype, op in wrong:  # the integer ops this MPI library gets wrong: hetcomm's kernels
        assert recipes.key("all_reduce", dtype, 4, ReduceOp(op), -1) is None


@pytest.mark.parametrize(
    ("op", "count", "out"),
    [
        ("all_reduce", 6, None),
        ("reduce", 6, None),
        ("broadcast", 6, None),
        ("all_gather", 6, 24),
        ("reduce_scatter", 8, 2),
        ("all_to_all", 8, 8),
    ],
)
def test_scratch_sizes(op, count, out):
    rop = ReduceOp.MAX if op in ("all_reduce", "reduce", "reduce_scatter") else None
    key = recipes.key(op, "float64", count, rop, 0)
    assert key is not None
    recipe = recipes.make(key, 0, 4, 16384)
    assert recipe is not None and recipe.op == op and recipe.key == key
    assert (recipe.dtype, recipe.count_in, recipe.count_out) == (np.dtype("float64"), count, out)


def test_limits():
    key = recipes.key("all_gather", "float64", 512, None, -1)  # 4 KiB in, 16 KiB out
    assert key is not None
    assert recipes.make(key, 0, 4, 16384) is not None
    assert recipes.make(key, 0, 5, 16384) is None  # 20 KiB out: past the limit
    assert recipes.make(recipes.key("broadcast", "int32", 0, None, 0), 0, 2, 16384) is None
    assert recipes.make(recipes.key("broadcast", "float16", 4, None, 0), 0, 2, 16384) is None
    barrier = recipes.make(recipes.key("barrier", None, 0, None, -1), 1, 3, 16384)
    assert barrier is not None and barrier.count_in == 0
