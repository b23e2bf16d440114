"""The mpi transport's path for counts past 2^31: every operation cut into several MPI calls.

The real thing (arrays of more than 2^31 elements) needs gigabytes per rank and runs once, in
tests/reliability/test_large_counts.py. Here the limit per MPI call is lowered to a few bytes,
so that small arrays take the same cut-up path: every operation, every dtype (bfloat16 and
float16 reductions included, whose pieces are reduced by hetcomm's own kernels), every reduce
op, with piece boundaries inside every block, checked against numpy, with sentinels around each
array to see that nothing outside it was written.
"""

from __future__ import annotations

import numpy as np
import pytest
from _data import CASES, REDUCE_OPS, Placed, compare, draw, reference

from hetcomm import ReduceOp
from hetcomm.transports.mpi import schedule as mpi_chunks

# bytes per MPI call: 1 float64, 4 bfloat16, 8 int8 elements (fewer in collectives that move
# a block per rank), so that every dtype is cut, mostly at boundaries inside a block
LIMIT = 8
COUNT = 13  # elements per block: not a multiple of any piece size


@pytest.fixture
def cut(monkeypatch: pytest.MonkeyPatch, hetcomm_transport: str) -> None:
    if hetcomm_transport not in ("auto", "mpi"):
        # these tests ask for the mpi transport themselves: the same run as on 'auto'
        pytest.skip(f"covers the mpi transport: runs on auto and mpi, not {hetcomm_transport}")
    monkeypatch.setattr(mpi_chunks, "MAX_CALL_BYTES", LIMIT)


def ops_for(dtype: str) -> list[ReduceOp]:
    return [op for op in REDUCE_OPS if not (dtype == "bool" and op is ReduceOp.AVG)]


def run(errors, what: str, call, *args, **kwargs) -> bool:
    """Run an async call, wait, and check that it was cut into several MPI calls."""
    work = None

    def go() -> None:
        nonlocal work
        work = call(*args, async_op=True, **kwargs)
        work.wait()

    if not errors.run(what, go):
        return False
    info = work.info or {}
    errors.expect(
        info.get("transport") == "mpi" and info.get("stages", 0) > 1,
        f"{what}: not cut into several MPI calls: {info}",
    )
    return True


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(("lib", "dtype"), CASES)
def test_every_operation_cut_into_pieces(hetcomm_make_comm, rng, errors, cut, lib, dtype):
    # small all-reduces run whole as persistent requests (one MPI call far below any real
    # limit), and calls this small ride in the default check's records (no MPI call at all,
    # hetcomm.carried): both off here, so that they take the cut path too
    comm = hetcomm_make_comm(transport="mpi", name="cut", persistent_max=0, check=False)
    size, me = comm.size, comm.rank
    for op in ops_for(dtype):
        stack = draw(rng, dtype, (COUNT,), size)
        x = Placed(stack[me], dtype, lib, "contiguous")
        if run(errors, f"all_reduce {op}", comm.all_reduce, x.array, op):
            errors += compare(
                x.values(),
                reference(stack, op, dtype),
                f"all_reduce {op}",
                stack=stack,
                op=op,
                dtype=dtype,
            )
            errors.expect(x.intact(), f"all_reduce {op}: wrote outside x")

        x = Placed(stack[me], dtype, lib, "contiguous")
        out = Placed(draw(rng, dtype, (COUNT,), 1)[0], dtype, lib, "contiguous")
        if run(errors, f"all_reduce out= {op}", comm.all_reduce, x.array, op, out=out.array):
            errors += compare(
                out.values(),
                reference(stack, op, dtype),
                f"all_reduce out= {op}",
                stack=stack,
                op=op,
                dtype=dtype,
            )
            errors += compare(x.values(), stack[me], f"all_reduce out= {op}: x changed")
            errors.expect(x.intact() and out.intact(), f"all_reduce out= {op}: wrote outside")

        root = int(rng.integers(size))
        x = Placed(stack[me], dtype, lib, "contiguous")
        if run(errors, f"reduce {op} root {root}", comm.reduce, x.array, root, op):
            want = reference(stack, op, dtype) if me == root else stack[me]
            errors += compare(
                x.values(), want, f"reduce {op} root {root}", stack=stack, op=op, dtype=dtype
            )
            errors.expect(x.intact(), f"reduce {op}: wrote outside x")

        blocks = draw(rng, dtype, (size * COUNT,), size)
        x = Placed(blocks[me], dtype, lib, "contiguous")
        out = Placed(draw(rng, dtype, (COUNT,), 1)[0], dtype, lib, "contiguous")
        if run(errors, f"reduce_scatter {op}", comm.reduce_scatter, out.array, x.array, op):
            mine = blocks[:, me * COUNT : (me + 1) * COUNT]
            errors += compare(
                out.values(),
                reference(mine, op, dtype),
                f"reduce_scatter {op}",
                stack=mine,
                op=op,
                dtype=dtype,
            )
            errors += compare(x.values(), blocks[me], f"reduce_scatter {op}: x changed")
            errors.expect(x.intact() and out.intact(), f"reduce_scatter {op}: wrote outside")

    stack = draw(rng, dtype, (COUNT,), size)
    root = int(rng.integers(size))
    x = Placed(stack[me], dtype, lib, "contiguous")
    if run(errors, f"broadcast root {root}", comm.broadcast, x.array, root):
        errors += compare(x.values(), stack[root], f"broadcast root {root}")
        errors.expect(x.intact(), "broadcast: wrote outside x")

    x = Placed(stack[me], dtype, lib, "contiguous")
    out = Placed(draw(rng, dtype, (size * COUNT,), 1)[0], dtype, lib, "contiguous")
    if run(errors, "all_gather", comm.all_gather, out.array, x.array):
        errors += compare(out.values(), stack.reshape(-1), "all_gather")
        errors += compare(x.values(), stack[me], "all_gather: x changed")
        errors.expect(x.intact() and out.intact(), "all_gather: wrote outside")

    blocks = draw(rng, dtype, (size * COUNT,), size)
    x = Placed(blocks[me], dtype, lib, "contiguous")
    out = Placed(draw(rng, dtype, (size * COUNT,), 1)[0], dtype, lib, "contiguous")
    if run(errors, "all_to_all", comm.all_to_all, out.array, x.array):
        want = blocks.reshape(size, size, COUNT)[:, me].reshape(-1)
        errors += compare(out.values(), want, "all_to_all")
        errors += compare(x.values(), blocks[me], "all_to_all: x changed")
        errors.expect(x.intact() and out.intact(), "all_to_all: wrote outside")

    # a ring: send to the next rank while receiving from the previous one
    x = Placed(stack[me], dtype, lib, "contiguous")
    got = Placed(draw(rng, dtype, (COUNT,), 1)[0], dtype, lib, "contiguous")
    left, right = (me - 1) % size, (me + 1) % size
    sent = None

    def send() -> None:
        nonlocal sent
        sent = comm.send(x.array, right, tag=5, async_op=True)

    if errors.run("send", send) and run(errors, "recv", comm.recv, got.array, left, tag=5):
        errors.run("send wait", sent.wait)
        info = sent.info or {}
        errors.expect(info.get("stages", 0) > 1, f"send: not cut into several messages: {info}")
        errors += compare(got.values(), stack[left], "recv")
        errors += compare(x.values(), stack[me], "send: x changed")
        errors.expect(x.intact() and got.intact(), "send/recv: wrote outside")
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_small_in_place_all_reduce_steps_aside(hetcomm_make_comm, errors, cut):
    """The prepared blocking call of small in-place all_reduces (one MPI call) takes arrays
    within the limit and leaves larger ones to the general path, which cuts them."""
    # the short path's Iallreduce is what this covers: persistent requests off, and the check
    # too (with it, small blocking calls ride in its records: hetcomm.carried)
    comm = hetcomm_make_comm(transport="mpi", name="cut-short", persistent_max=0, check=False)
    total = comm.size * (comm.size + 1) / 2
    for n in (1, 2, 5, 100):
        x = np.full(n, comm.rank + 1.0)
        for _ in range(3):  # once the route is known, the short path is tried
            errors.run(f"all_reduce of {n}", comm.all_reduce, x)
        want = total * comm.size**2
        errors.expect((x == want).all(), f"all_reduce of {n}: got {x[:4]}, want {want}")
        (route,) = [r for r in comm.routes() if r["key"][1][2] == (n,)]
        short = n * 8 <= LIMIT
        errors.expect(
            route["prepared"] == short and route["runs"] == (3 if short else 0),
            f"all_reduce of {n} float64: {route}",
        )
    errors.verify()
