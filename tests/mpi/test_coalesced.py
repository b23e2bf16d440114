"""all_reduce_coalesced: many arrays of mixed dtypes, shapes, layouts and libraries in one call.

Every array is placed inside sentinels (`_data.Placed`) and checked against a float64 numpy
reference of every rank's inputs, drawn fresh from the shared seed; arrays outside the call must
keep their values. Bad calls are made by every rank alike, so each raises before anything moves.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from _data import (
    DTYPES,
    REDUCE_OPS,
    SHAPES,
    Placed,
    compare,
    draw,
    expect_raises,
    logical,
    reference,
)

from hetcomm import DtypeError, InvalidArgument, MismatchError, ReduceOp, Work, introspect
from hetcomm.coalesced import NODE_MIN

pytestmark = pytest.mark.mpi(min_size=2)


class Case:
    """One array of a call: its inputs on every rank, the placed array, what it must become."""

    def __init__(
        self,
        rng: np.random.Generator,
        size: int,
        rank: int,
        dtype: str,
        lib: str,
        shape: tuple[int, ...],
        layout: str,
    ) -> None:
        self.dtype, self.what = dtype, f"{lib} {dtype} {layout}{list(shape)}"
        self.stack = draw(rng, dtype, shape, size)
        self.placed = Placed(self.stack[rank], dtype, lib, layout)

    def check(self, op: ReduceOp, what: str) -> list[str]:
        problems = compare(
            self.placed.values(),
            reference(self.stack, op, self.dtype),
            f"{what}: {self.what}",
            stack=self.stack,
            op=op,
            dtype=self.dtype,
        )
        if not self.placed.intact():
            problems.append(f"{what}: {self.what}: wrote outside the array")
        return problems


def mixed_cases(rng: np.random.Generator, comm: Any, op: ReduceOp) -> list[Case]:
    """Every dtype x every shape and layout of _data.SHAPES, numpy and torch alternating (torch
    for bfloat16), in a shuffled order the same on every rank."""
    cases = []
    for k, dtype in enumerate(DTYPES):
        if op is ReduceOp.AVG and dtype == "bool":
            continue
        for j, (shape, layout) in enumerate(SHAPES):
            lib = "torch" if dtype == "bfloat16" or (j + k) % 2 else "numpy"
            cases.append(Case(rng, comm.size, comm.rank, dtype, lib, shape, layout))
    order = rng.permutation(len(cases))
    return [cases[i] for i in order]


def test_every_op_on_mixed_arrays(hetcomm_comm, rng, errors):
    """One call per op over ~80 arrays of every dtype, shape and layout; an array outside the
    call keeps its values."""
    for op in REDUCE_OPS:
        cases = mixed_cases(rng, hetcomm_comm, op)
        outsider = Case(
            rng, hetcomm_comm.size, hetcomm_comm.rank, "float32", "numpy", (6,), "contiguous"
        )
        before = outsider.placed.values()
        if errors.run(
            f"{op}", hetcomm_comm.all_reduce_coalesced, [c.placed.array for c in cases], op
        ):
            for c in cases:
                errors += c.check(op, str(op))
        errors += compare(outsider.placed.values(), before, f"{op}: an array outside the call")
    errors.verify()


def test_op_by_name_and_tuple(hetcomm_comm, rng, errors):
    cases = [
        Case(rng, hetcomm_comm.size, hetcomm_comm.rank, "float64", "numpy", (5, 4), "contiguous"),
        Case(rng, hetcomm_comm.size, hetcomm_comm.rank, "int32", "torch", (9,), "strided"),
    ]
    if errors.run(
        "max by name",
        hetcomm_comm.all_reduce_coalesced,
        tuple(c.placed.array for c in cases),
        "max",
    ):
        for c in cases:
            errors += c.check(ReduceOp.MAX, "max by name")
    errors.verify()


def test_many_small_arrays(hetcomm_comm, rng, errors):
    """Hundreds of arrays of one dtype (one fused collective), 1-element and empty among them."""
    sizes = [int(n) for n in rng.integers(0, 40, size=300)] + [1, 0, 1]
    cases = [
        Case(rng, hetcomm_comm.size, hetcomm_comm.rank, "float32", "numpy", (n,), "contiguous")
        for n in sizes
    ]
    if errors.run("300 arrays", hetcomm_comm.all_reduce_coalesced, [c.placed.array for c in cases]):
        for c in cases:
            errors += c.check(ReduceOp.SUM, "300 arrays")
    errors.verify()


def test_views_of_one_buffer(hetcomm_comm, rng, errors):
    """Disjoint views of one allocation, interleaved ones included (x[::2] and x[1::2]), are
    accepted; the gaps between them keep their values."""
    size, me = hetcomm_comm.size, hetcomm_comm.rank
    stack = draw(rng, "float64", (64,), size)
    base = stack[me].copy()
    views = [base[0:10], base[10:11], base[12:30:2], base[13:30:2], base[40:64].reshape(4, 6).T]
    index = np.arange(64)
    used = np.concatenate([index[0:10], index[10:11], index[12:30:2], index[13:30:2], index[40:64]])
    want = stack[me].copy()
    want[used] = stack[:, used].sum(axis=0)
    if errors.run("views", hetcomm_comm.all_reduce_coalesced, views):
        errors += compare(
            base, want, "views of one buffer", stack=stack, op=ReduceOp.SUM, dtype="float64"
        )
    errors.verify()


def test_async(hetcomm_comm, rng, errors):
    """async_op: a Work whose completion unpacks; two calls in flight at once, a synchronous
    one of the same dtype in between (the fused buffers are never shared)."""
    first = [
        Case(rng, hetcomm_comm.size, hetcomm_comm.rank, d, lib, (33,), "strided")
        for d, lib in (("float32", "torch"), ("bfloat16", "torch"), ("int64", "numpy"))
    ]
    second = [
        Case(rng, hetcomm_comm.size, hetcomm_comm.rank, "float32", "numpy", (300, 7), "transposed")
        for _ in range(3)
    ]
    middle = [
        Case(rng, hetcomm_comm.size, hetcomm_comm.rank, "float32", "numpy", (500,), "contiguous")
    ]
    work1 = hetcomm_comm.all_reduce_coalesced([c.placed.array for c in first], async_op=True)
    work2 = hetcomm_comm.all_reduce_coalesced(
        [c.placed.array for c in second], ReduceOp.MIN, async_op=True, timeout=60
    )
    errors.expect(isinstance(work1, Work) and isinstance(work2, Work), "async_op returns Works")
    hetcomm_comm.all_reduce_coalesced([c.placed.array for c in middle])
    errors += middle[0].check(ReduceOp.SUM, "synchronous, between two in flight")
    work2.wait()
    work1.wait()
    errors.expect(work1.test() and work2.test() and work1.exception() is None, "works done")
    for c in first:
        errors += c.check(ReduceOp.SUM, "async 1")
    for c in second:
        errors += c.check(ReduceOp.MIN, "async 2")
    errors.verify()


def test_sizes_grow_and_shrink(hetcomm_comm, rng, errors):
    """Reused fused buffers: a small call, a large one, a small one again."""
    for n in (10, 50_000, 3):
        cases = [
            Case(rng, hetcomm_comm.size, hetcomm_comm.rank, "float16", "numpy", (n,), "contiguous"),
            Case(rng, hetcomm_comm.size, hetcomm_comm.rank, "float16", "torch", (n,), "strided"),
        ]
        if errors.run(
            f"n={n}",
            hetcomm_comm.all_reduce_coalesced,
            [c.placed.array for c in cases],
            ReduceOp.PROD,
        ):
            for c in cases:
                errors += c.check(ReduceOp.PROD, f"n={n}")
    errors.verify()


def test_requires_grad_tensor(hetcomm_comm, rng, errors):
    stack = draw(rng, "float32", (7,), hetcomm_comm.size)
    t = torch.tensor(stack[hetcomm_comm.rank], dtype=torch.float32, requires_grad=True)
    if errors.run("requires_grad", hetcomm_comm.all_reduce_coalesced, [t]):
        errors += compare(
            logical(t),
            stack.sum(axis=0),
            "requires_grad",
            stack=stack,
            op=ReduceOp.SUM,
            dtype="float32",
        )
    errors.verify()


def test_empty_list(hetcomm_comm, errors):
    errors.expect(hetcomm_comm.all_reduce_coalesced([]) is None, "[] returns None")
    work = hetcomm_comm.all_reduce_coalesced((), async_op=True)
    errors.expect(isinstance(work, Work) and work.test(), "async [] is a completed Work")
    x = np.full(3, float(hetcomm_comm.rank))
    hetcomm_comm.all_reduce(x)  # the ranks are still in step
    errors.expect((x == sum(range(hetcomm_comm.size))).all(), f"all_reduce after [] gave {x}")
    errors.verify()


# ---- bad calls ----------------------------------------------------------------------------------


def test_bad_calls_move_nothing(hetcomm_comm, errors):
    f = np.arange(6, dtype=np.float32) + hetcomm_comm.rank
    g = np.arange(4, dtype=np.float64) - hetcomm_comm.rank
    t = torch.arange(5, dtype=torch.bfloat16)
    flags = np.array([True, False])
    ro = np.ones(3)
    ro.setflags(write=False)
    base = np.arange(20, dtype=np.int32)
    keep = [f, g, t, flags, base]
    ar = hetcomm_comm.all_reduce_coalesced
    cases: list[tuple[str, type[Exception], Callable[[], Any], list[str]]] = [
        ("an array, not a list", InvalidArgument, lambda: ar(f), ["list or tuple", "numpy"]),
        ("a generator", InvalidArgument, lambda: ar(x for x in (f, g)), ["list or tuple"]),
        ("not an array", InvalidArgument, lambda: ar([f, "g", g]), ["arrays[1]", "str"]),
        ("None inside", InvalidArgument, lambda: ar([f, g, None]), ["arrays[2]"]),
        ("read-only", InvalidArgument, lambda: ar([f, ro]), ["arrays[1]", "read-only"]),
        ("twice", InvalidArgument, lambda: ar([f, g, f]), ["arrays[0]", "arrays[2]", "same"]),
        (
            "overlap",
            InvalidArgument,
            lambda: ar([g, base[0:10], base[5:15]]),
            ["arrays[1]", "arrays[2]", "overlap"],
        ),
        (
            "strided overlap",
            InvalidArgument,
            lambda: ar([base[::2], base[4:8]]),
            ["arrays[0]", "arrays[1]", "overlap"],
        ),
        (
            "torch view of numpy",
            InvalidArgument,
            lambda: ar([f, torch.from_numpy(f)]),
            ["arrays[0]", "arrays[1]"],
        ),
        ("AVG on bool", DtypeError, lambda: ar([f, flags], ReduceOp.AVG), ["arrays[1]", "bool"]),
        ("unknown op", InvalidArgument, lambda: ar([f], "xor"), ["op", "xor"]),
        ("bad timeout", InvalidArgument, lambda: ar([f], timeout=-1), ["timeout"]),
        ("complex", DtypeError, lambda: ar([f, np.zeros(2, complex)]), ["arrays[1]", "complex"]),
    ]
    for what, exc_type, call, words in cases:
        expect_raises(errors, exc_type, {what: (call, words)}, keep)
    # the ranks are still in step, and the arrays reduce normally afterwards
    want = np.arange(6, dtype=np.float32) * hetcomm_comm.size + sum(range(hetcomm_comm.size))
    hetcomm_comm.all_reduce_coalesced([f, t])
    errors.expect(np.array_equal(f, want), f"after the bad calls: {f}")
    errors.verify()


def test_debug_mode_catches_another_order(hetcomm_make_comm, errors):
    """Groups are issued in order of first appearance: ranks listing dtypes in another order
    get MismatchError on every rank (debug mode) instead of reducing mismatched buffers."""
    comm = hetcomm_make_comm(debug=True, timeout=30)
    a, b = np.ones(4, dtype=np.float32), np.ones(4, dtype=np.int32)
    arrays = [a, b] if comm.rank == 0 else [b, a]
    expect_raises(
        errors,
        MismatchError,
        {"different order": (lambda: comm.all_reduce_coalesced(arrays), ["dtype"])},
        [a, b],
    )
    errors.verify()


def test_one_node_reduces_in_shared_segments(hetcomm_comm, rng, errors):
    """Where the group is one node's ranks on the mpi transport, a blocking call packs into a
    shared segment and reduces there (hetcomm.transports.mpi.node); the segments grow for a larger
    call; an async call (the fused MPI all-reduce) gives the same values."""
    t = introspect.transport_of(hetcomm_comm, "all_reduce", np.zeros(4, np.float32))
    if t.name != "mpi" or not t.fits_node(16):
        pytest.skip(f"host all-reduces go through {t.name} here, or the ranks span nodes")
    # groups of NODE_MIN bytes and more take the segments; 300_000 float64 (2.4 MB) go past
    # the first segments (1 MiB)
    for n in (NODE_MIN // 4, 300_000):
        cases = [
            Case(rng, hetcomm_comm.size, hetcomm_comm.rank, d, lib, (n,), layout)
            for d, lib, layout in (
                ("float32", "numpy", "contiguous"),
                ("float64", "numpy", "strided"),
                ("int32", "torch", "contiguous"),
                ("float32", "numpy", "contiguous"),
            )
        ]
        if errors.run(
            f"n={n}",
            hetcomm_comm.all_reduce_coalesced,
            [c.placed.array for c in cases],
            ReduceOp.AVG,
        ):
            for c in cases:
                errors += c.check(ReduceOp.AVG, f"n={n}")
        node = introspect.node_reduce(t)
        errors.expect(
            node is not None and node.capacity >= n * 8,
            f"n={n}: the shared segments hold the largest group",
        )
        again = [
            Case(rng, hetcomm_comm.size, hetcomm_comm.rank, "float32", "numpy", (n,), "contiguous")
            for _ in range(3)
        ]
        work = hetcomm_comm.all_reduce_coalesced([c.placed.array for c in again], async_op=True)
        work.wait()
        for c in again:
            errors += c.check(ReduceOp.SUM, f"n={n}, async")
    left = glob.glob(f"/dev/shm/hetcomm-node-{os.getpid()}-*")
    errors.expect(not left, f"segment files left behind once mapped: {left}")
    errors.verify()


def test_without_shared_segments_the_fused_all_reduce_goes_through_mpi(
    hetcomm_make_comm, rng, errors, monkeypatch
):
    """Rank 1 cannot have its shared segment (a full /dev/shm): every rank learns it in the
    same call, the others drop theirs, and the call reduces through the fused MPI all-reduce
    with the right results; later calls go there at once."""
    from hetcomm.transports import shm
    from hetcomm.transports.mpi import node as mpi_node

    c = hetcomm_make_comm(name="no-shm")
    t = introspect.transport_of(c, "all_reduce", np.zeros(4, np.float32))
    if t.name != "mpi" or not t.fits_node(16):
        pytest.skip(f"host all-reduces go through {t.name} here, or the ranks span nodes")
    if c.rank == 1:

        def full(*args: Any, **kwargs: Any) -> Any:
            raise shm.SegmentError("cannot reserve 1 MiB in /dev/shm (test: no space)")

        monkeypatch.setattr(mpi_node, "SharedSlots", full)
    for k in range(2):
        cases = [
            Case(rng, c.size, c.rank, d, "numpy", (n,), "contiguous")
            for d, n in (("float32", NODE_MIN // 4), ("int64", 50))
        ]
        if errors.run(
            f"call {k}", c.all_reduce_coalesced, [x.placed.array for x in cases], ReduceOp.MAX
        ):
            for x in cases:
                errors += x.check(ReduceOp.MAX, f"call {k}")
    errors.expect(t.fits_node(16) is False, "the group's fused all-reduces went back to MPI")
    left = glob.glob(f"/dev/shm/hetcomm-node-{os.getpid()}-*")
    errors.expect(not left, f"segment files left behind: {left}")
    errors.verify()


def test_repeated_small_calls_take_the_prepared_route(hetcomm_comm, rng, errors):
    """A blocking call whose groups are below NODE_MIN runs each group's fused all_reduce
    through the transport's prepared call, a route kept per (dtype, count, memory, op) and
    counted; results stay right when the signature changes between calls."""
    comm = hetcomm_comm
    signatures = (
        [("float32", (5,)), ("float32", (3, 2)), ("int64", (4,))],
        [("float32", (5,)), ("float32", (3, 2)), ("int64", (4,))],
        [("float64", (7,)), ("float32", (2,))],
        [("float32", (5,)), ("float32", (3, 2)), ("int64", (4,))],
    )
    for k, signature in enumerate(signatures):
        cases = [
            Case(rng, comm.size, comm.rank, d, "numpy", shape, "contiguous")
            for d, shape in signature
        ]
        if errors.run(f"call {k}", comm.all_reduce_coalesced, [c.placed.array for c in cases]):
            for c in cases:
                errors += c.check(ReduceOp.SUM, f"call {k}")
    fused = {r["key"][1:3]: r for r in comm.routes() if r["key"][0] == "all_reduce_coalesced"}
    errors.expect(
        set(fused) >= {("float32", 11), ("int64", 4), ("float64", 7), ("float32", 2)},
        f"fused routes {sorted(fused)}",
    )
    for key, r in fused.items():
        if r["prepared"]:
            want = 3 if key in (("float32", 11), ("int64", 4)) else 1
            errors.expect(r["runs"] >= want, f"{key}: the prepared call ran {r['runs']}x")
    errors.verify()


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_repeated_calls_of_plain_arrays_resolve_once(hetcomm_comm, rng, errors, lib):
    """Plain numpy arrays of one dtype, each owning its memory (or CPU tensors, each on a
    storage of its own): a repeated blocking call takes the route resolved at its first call
    (counted), and stays right when the shapes, dtype or op change between calls, when one
    rank passes views (the general path there, with the same MPI calls), and after an array
    given twice is refused."""
    comm = hetcomm_comm
    as_lib = torch.from_numpy if lib == "torch" else (lambda a: a)
    plain = [(5,), (3, 2), (1,)]
    calls = [
        ("float32", plain, ReduceOp.SUM, False),
        ("float32", plain, ReduceOp.SUM, False),
        ("float32", plain, ReduceOp.SUM, True),  # views on rank 1
        ("float64", [(7,)], ReduceOp.MAX, False),
        ("float32", plain, ReduceOp.AVG, False),
        ("int32", [(4,), (4,)], ReduceOp.SUM, False),
        ("float32", plain, ReduceOp.SUM, False),
    ]
    for k, (dtype, shapes, op, views) in enumerate(calls):
        stacks = [draw(rng, dtype, shape, comm.size) for shape in shapes]
        if views and comm.rank == 1:
            # views of one buffer: neither plain arrays nor tensors of storages of their own
            flat = np.concatenate([s[comm.rank].reshape(-1) for s in stacks]).astype(dtype)
            cuts = np.cumsum([0] + [int(np.prod(shape)) for shape in shapes])
            whole = as_lib(flat)
            arrays = [whole[a:b].reshape(shape) for a, b, shape in zip(cuts, cuts[1:], shapes)]
        else:
            arrays = [as_lib(np.array(s[comm.rank], dtype=dtype)) for s in stacks]
        bystander = rng.standard_normal(6)
        before = bystander.copy()
        if errors.run(f"call {k}", comm.all_reduce_coalesced, arrays, op):
            for i, (a, s) in enumerate(zip(arrays, stacks)):
                want = reference(s, op, dtype)
                got = a.numpy() if lib == "torch" else a
                errors += compare(got, want, f"call {k} array {i}", stack=s, op=op, dtype=dtype)
        errors.expect(np.array_equal(bystander, before), f"call {k}: another array changed")
    twice = as_lib(np.zeros(3, np.float32))
    expect_raises(
        errors,
        InvalidArgument,
        {"an array given twice": (lambda: comm.all_reduce_coalesced([twice, twice]), [])},
    )
    name = "all_reduce_coalesced(tensors)" if lib == "torch" else "all_reduce_coalesced(arrays)"
    resolved = {r["key"][1:3]: r["runs"] for r in comm.routes() if r["key"][0] == name}
    f32 = torch.float32 if lib == "torch" else np.dtype("float32")
    # only where the fused all_reduce (float32, 12 elements, SUM) has a prepared call
    fused = [
        r
        for r in comm.routes()
        if r["key"][:3] == ("all_reduce_coalesced", "float32", 12) and r["key"][-1] is ReduceOp.SUM
    ]
    if fused and fused[0]["prepared"]:
        # float32 SUM: resolved at call 0, taken at calls 1, 2 (not on rank 1: views) and 6
        want = 2 if comm.rank == 1 else 3
        got = resolved.get((ReduceOp.SUM, f32), 0)
        errors.expect(got == want, f"float32 SUM took its resolved route {got}x, expected {want}")
        errors.expect((ReduceOp.AVG, f32) in resolved, f"resolved routes {list(resolved)}")
    else:
        errors.expect(not resolved, f"resolved routes {list(resolved)} without a prepared call")
    errors.verify()
