"""Every collective x every dtype x every reduce op, numpy and torch, checked against numpy.

Each test is parametrised over (library, dtype) only and loops over the reduce ops and the shapes
of `_data.SHAPES` (empty, 0-d, one element, odd sizes, 2-D, large, strided and transposed views).
Every array is placed inside sentinels: a test checks the result, that the inputs of out-of-place
operations are unchanged, and that nothing outside the output was written. Calls go through
`errors.run`, so a call failing on some ranks only is recorded and the ranks stay in step.
"""

from __future__ import annotations

import numpy as np
import pytest
from _data import CASES, REDUCE_OPS, SHAPES, Placed, compare, draw, reference

from hetcomm import ReduceOp


def blocks_shape(size: int, shape: tuple[int, ...], layout: str) -> tuple[int, ...]:
    """Logical shape of an array of `size` blocks of `shape` that can take `layout`."""
    if layout == "strided":
        return (size * int(np.prod(shape)),)
    if layout == "transposed":
        return (size * shape[0], *shape[1:])
    return (size, *shape)


def ops_for(dtype: str) -> list[ReduceOp]:
    """AVG has no meaning for bool (test_errors.py::test_avg_on_bool_raises)."""
    return [op for op in REDUCE_OPS if not (dtype == "bool" and op is ReduceOp.AVG)]


def reduced(got: np.ndarray, stack: np.ndarray, op: ReduceOp, dtype: str, what: str) -> list[str]:
    """compare() of `got` with the reduction of `stack` (the inputs of every rank)."""
    return compare(got, reference(stack, op, dtype), what, stack=stack, op=op, dtype=dtype)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(("lib", "dtype"), CASES)
def test_all_reduce(hetcomm_comm, rng, errors, lib, dtype):
    for op in ops_for(dtype):
        for shape, layout in SHAPES:
            stack = draw(rng, dtype, shape, hetcomm_comm.size)
            mine = stack[hetcomm_comm.rank]
            case = f"{op} {layout}{list(shape)}"

            x = Placed(mine, dtype, lib, layout)
            if errors.run(f"in place, {case}", hetcomm_comm.all_reduce, x.array, op):
                errors += reduced(x.values(), stack, op, dtype, f"in place, {case}")
                errors.expect(x.intact(), f"in place, {case}: wrote outside x")

            # out of place, naming the op by its string
            x = Placed(mine, dtype, lib, layout)
            out = Placed(draw(rng, dtype, shape, 1)[0], dtype, lib, layout)
            if errors.run(
                f"out=, {case}", hetcomm_comm.all_reduce, x.array, op.value, out=out.array
            ):
                errors += reduced(out.values(), stack, op, dtype, f"out=, {case}")
                errors += compare(x.values(), mine, f"out=, {case}: x changed")
                errors.expect(x.intact() and out.intact(), f"out=, {case}: wrote outside out")

            # out= the very array x is in place
            x = Placed(mine, dtype, lib, layout)
            if errors.run(f"out=x, {case}", hetcomm_comm.all_reduce, x.array, op, out=x.array):
                errors += reduced(x.values(), stack, op, dtype, f"out=x, {case}")
    errors.verify()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(("lib", "dtype"), CASES)
def test_reduce(hetcomm_comm, rng, errors, lib, dtype):
    for op in ops_for(dtype):
        for root in sorted({0, hetcomm_comm.size - 1}):
            for shape, layout in SHAPES:
                stack = draw(rng, dtype, shape, hetcomm_comm.size)
                mine = stack[hetcomm_comm.rank]
                case = f"{op} root {root} {layout}{list(shape)}"
                x = Placed(mine, dtype, lib, layout)
                if not errors.run(case, hetcomm_comm.reduce, x.array, root, op):
                    continue
                if hetcomm_comm.rank == root:
                    errors += reduced(x.values(), stack, op, dtype, case)
                else:
                    errors += compare(x.values(), mine, f"{case}: non-root x changed")
                errors.expect(x.intact(), f"{case}: wrote outside x")
    errors.verify()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(("lib", "dtype"), CASES)
def test_broadcast(hetcomm_comm, rng, errors, lib, dtype):
    for root in range(hetcomm_comm.size):
        for shape, layout in SHAPES:
            stack = draw(rng, dtype, shape, hetcomm_comm.size)
            case = f"root {root} {layout}{list(shape)}"
            x = Placed(stack[hetcomm_comm.rank], dtype, lib, layout)
            if errors.run(case, hetcomm_comm.broadcast, x.array, root):
                errors += compare(x.values(), stack[root], case)
                errors.expect(x.intact(), f"{case}: wrote outside x")
    errors.verify()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(("lib", "dtype"), CASES)
def test_all_gather(hetcomm_comm, rng, errors, lib, dtype):
    size, rank = hetcomm_comm.size, hetcomm_comm.rank
    for shape, layout in SHAPES:
        stack = draw(rng, dtype, shape, size)
        out_shape = blocks_shape(size, shape, layout)
        case = f"{layout}{list(shape)} into {list(out_shape)}"
        x = Placed(stack[rank], dtype, lib, layout)
        out = Placed(draw(rng, dtype, out_shape, 1)[0], dtype, lib, layout)
        if errors.run(case, hetcomm_comm.all_gather, out.array, x.array):
            errors += compare(out.values(), stack.reshape(out_shape), case)
            errors += compare(x.values(), stack[rank], f"{case}: x changed")
            errors.expect(x.intact() and out.intact(), f"{case}: wrote outside out")

    # in place, as NCCL allows: x is block `rank` of out
    stack = draw(rng, dtype, (5,), size)
    start = draw(rng, dtype, (size, 5), 1)[0]
    start[rank] = stack[rank]
    out = Placed(start, dtype, lib, "contiguous")
    if errors.run("in place", hetcomm_comm.all_gather, out.array, out.array[rank]):
        errors += compare(out.values(), stack, "in place (x = out[rank])")
        errors.expect(out.intact(), "in place: wrote outside out")
    errors.verify()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(("lib", "dtype"), CASES)
def test_reduce_scatter(hetcomm_comm, rng, errors, lib, dtype):
    size, rank = hetcomm_comm.size, hetcomm_comm.rank
    for op in ops_for(dtype):
        for shape, layout in SHAPES:
            x_shape = blocks_shape(size, shape, layout)
            stack = draw(rng, dtype, (size, *shape), size)  # [rank, block, ...]
            mine = stack[rank].reshape(x_shape)
            block = stack[:, rank]  # what every rank contributes to this rank's output
            case = f"{op} {layout}{list(x_shape)} into {list(shape)}"
            x = Placed(mine, dtype, lib, layout)
            out = Placed(draw(rng, dtype, shape, 1)[0], dtype, lib, layout)
            if errors.run(case, hetcomm_comm.reduce_scatter, out.array, x.array, op):
                errors += reduced(out.values(), block, op, dtype, case)
                errors += compare(x.values(), mine, f"{case}: x changed")
                errors.expect(x.intact() and out.intact(), f"{case}: wrote outside out")

        # in place, as NCCL allows: out is block `rank` of x
        stack = draw(rng, dtype, (size, 3), size)
        x = Placed(stack[rank], dtype, lib, "contiguous")
        case = f"{op} in place (out = x[rank])"
        if errors.run(case, hetcomm_comm.reduce_scatter, x.array[rank], x.array, op):
            errors += reduced(x.values()[rank], stack[:, rank], op, dtype, case)
            errors.expect(x.intact(), f"{case}: wrote outside x")
    errors.verify()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(("lib", "dtype"), CASES)
def test_all_to_all(hetcomm_comm, rng, errors, lib, dtype):
    size, rank = hetcomm_comm.size, hetcomm_comm.rank
    for shape, layout in SHAPES:
        x_shape = blocks_shape(size, shape, layout)
        stack = draw(rng, dtype, (size, *shape), size)  # [sender, destination, ...]
        mine = stack[rank].reshape(x_shape)
        want = stack[:, rank].reshape(x_shape)  # block i came from rank i
        case = f"{layout}{list(x_shape)}"
        x = Placed(mine, dtype, lib, layout)
        out = Placed(draw(rng, dtype, x_shape, 1)[0], dtype, lib, layout)
        if errors.run(case, hetcomm_comm.all_to_all, out.array, x.array):
            errors += compare(out.values(), want, case)
            errors += compare(x.values(), mine, f"{case}: x changed")
            errors.expect(x.intact() and out.intact(), f"{case}: wrote outside out")

        # in place: out is x
        x = Placed(mine, dtype, lib, layout)
        if errors.run(f"in place, {case}", hetcomm_comm.all_to_all, x.array, x.array):
            errors += compare(x.values(), want, f"in place, {case}")
            errors.expect(x.intact(), f"in place, {case}: wrote outside x")
    errors.verify()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", ["int8", "int16", "int32", "int64", "uint8"])
def test_integer_sums_and_products_wrap(hetcomm_comm, rng, errors, dtype):
    """Integers wrap around as C's do, for arrays long enough for an MPI library's vectorized
    reductions (Open MPI 5.0's saturate 8- and 16-bit sums: 127 + 1 gave 127)."""
    info = np.iinfo(dtype)
    n = 1000
    # every rank's values, large enough that their sum and product leave the dtype's range
    stack = rng.integers(info.max // 2, info.max, size=(hetcomm_comm.size, n), endpoint=True)
    for op, fold in ((ReduceOp.SUM, np.add), (ReduceOp.PROD, np.multiply)):
        want = stack[0].astype(dtype)
        for row in stack[1:]:
            want = fold(want, row.astype(dtype), dtype=dtype)  # numpy wraps in the dtype
        x = stack[hetcomm_comm.rank].astype(dtype)
        if errors.run(f"all_reduce {op}", hetcomm_comm.all_reduce, x, op):
            errors.expect(
                np.array_equal(x, want), f"all_reduce {op} {dtype}: got {x[:4]}, want {want[:4]}"
            )
        out = np.zeros(n // hetcomm_comm.size, dtype)
        full = np.resize(
            stack[hetcomm_comm.rank], (n // hetcomm_comm.size) * hetcomm_comm.size
        ).astype(dtype)
        if errors.run(f"reduce_scatter {op}", hetcomm_comm.reduce_scatter, out, full, op):
            block = slice(hetcomm_comm.rank * len(out), (hetcomm_comm.rank + 1) * len(out))
            errors.expect(
                np.array_equal(out, want[block]),
                f"reduce_scatter {op} {dtype}: got {out[:4]}, want {want[block][:4]}",
            )
    errors.verify()
