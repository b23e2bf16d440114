"""The in-place all_gather (x is this rank's block of out) and reduce_scatter (out is this
rank's block of x), NCCL's rules: on every path, blocking, asynchronous and general, the
communicator hands them to the transport as they are (no packed copy of x), the result is
right, and nothing but out is written. Any other overlap of x and out is copied first, except
where the transport reads all of x before it writes out (staged through its shared segment,
which then takes every overlap, the in-place all_to_all too)."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from hetcomm import introspect
from hetcomm import work as work_mod

_PAD, _SENTINEL = 3, -7.5
# one element to past the shared segment's small sizes and the persistent requests' limit
_COUNTS = (1, 9, 4099, 70001)


def _in_place(rng, op, size, rank, count):
    """(backing, out, x, expected backing) of one in-place call: the one array with guard
    elements at both ends, its blocks of `count` drawn fresh."""
    stack = rng.integers(-50, 50, (size, size * count)).astype(np.float64)  # exact sums
    backing = np.full(size * count + 2 * _PAD, _SENTINEL)
    whole = backing[_PAD:-_PAD]
    mine = slice(rank * count, (rank + 1) * count)
    want = backing.copy()
    if op == "all_gather":
        whole[...] = rng.standard_normal(size * count)  # the other blocks' old values
        whole[mine] = stack[rank, :count]
        want[_PAD:-_PAD] = stack[:, :count].reshape(-1)
        return backing, whole, whole[mine], want
    whole[...] = stack[rank]
    want[_PAD:-_PAD] = stack[rank]  # x's other blocks stay as they are
    want[_PAD:-_PAD][mine] = stack[:, mine].sum(0)
    return backing, whole[mine], whole, want


def _started_and_waited(call, out, x):
    call(out, x, async_op=True).wait(timeout=60)


@contextlib.contextmanager
def _on_path(path):
    """Calls on the general path where `path` says so: while an observer is registered,
    every call is a Work of the general path."""
    observer = (lambda w: None) if path == "general" else None
    if observer is not None:
        work_mod.add_observer(observer)
    try:
        yield
    finally:
        if observer is not None:
            work_mod.remove_observer(observer)


def _check_call(errors, path, case, call, backing, out, x, want):
    """`call(out, x)`, blocking or (path "async") started and waited for; then the whole
    backing array, guards included, must be `want`."""
    if path == "async":
        done = errors.run(case, _started_and_waited, call, out, x)
    else:
        done = errors.run(case, call, out, x)
    if done:
        bad = np.flatnonzero(backing != want)
        errors.expect(not bad.size, f"{case}: {bad.size} wrong, first at {bad[:3]}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter"])
@pytest.mark.parametrize("path", ["blocking", "async", "general"])
def test_own_block_is_served_in_place(hetcomm_comm, rng, errors, input_copies, op, path):
    comm = hetcomm_comm
    size, rank = comm.size, comm.rank
    copies = input_copies
    call = getattr(comm, op)
    with _on_path(path):
        for count in _COUNTS:
            backing, out, x, want = _in_place(rng, op, size, rank, count)
            _check_call(errors, path, f"{op} {path} {count}", call, backing, out, x, want)
    errors.expect(not copies, f"{op} {path}: the input was copied ({copies} bytes)")
    if path == "general":
        uses = sum(r["uses"] for r in comm.routes() if r["op"] == op)
        errors.expect(uses == len(_COUNTS), f"general path took {uses} of {len(_COUNTS)} calls")
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_other_overlaps_are_copied_first(hetcomm_comm, rng, errors, input_copies):
    """x as the next rank's block of out, or straddling two blocks (all_gather), and out as
    the next rank's block of x (reduce_scatter): x is copied before any byte of out is
    written, so every rank still gathers or reduces the x it passed."""
    comm = hetcomm_comm
    size, rank = comm.size, comm.rank
    copies = input_copies
    count, right = 5, (rank + 1) % size
    with _on_path("general"):  # where the packing happens
        for shift in (0, 2):  # the next rank's block; straddling two blocks
            stack = rng.standard_normal((size, count))
            out = rng.standard_normal(size * count + count)
            start = right * count + shift
            x = out[start : start + count]
            x[...] = stack[rank]
            if errors.run(f"all_gather shift {shift}", comm.all_gather, out[: size * count], x):
                errors.expect(
                    np.array_equal(out[: size * count], stack.reshape(-1)),
                    f"all_gather shift {shift}: wrong result",
                )
        stack = rng.integers(-50, 50, (size, size * count)).astype(np.float64)
        x = stack[rank].copy()
        if errors.run("reduce_scatter", comm.reduce_scatter, x[right * count :][:count], x):
            got = x[right * count :][:count]
            want = stack[:, rank * count : (rank + 1) * count].sum(0)
            errors.expect(np.array_equal(got, want), f"reduce_scatter: {got} != {want}")
    if not _stages(comm, count * size * 8):
        errors.expect(len(copies) == 3, f"{len(copies)} of 3 overlapping inputs copied")
    errors.verify()


def _stages(comm, nbytes):
    """Whether the transport of the block collectives reads all of x before writing out at
    this size now (each rank decides alone)."""
    t = introspect.transport_of(comm, "all_to_all", np.zeros(1))
    return all(t.stages_input(op, nbytes) for op in ("all_gather", "reduce_scatter", "all_to_all"))


def _overlapping(rng, op, size, rank, count):
    """(backing, out, x, expected backing) of one call whose x and out overlap outside the
    in-place layouts: all_to_all with out = x, all_gather with x as the next rank's block of
    out, reduce_scatter with out as the next rank's block of x; guard elements around."""
    right = (rank + 1) % size
    backing = np.full(size * count + 2 * _PAD, _SENTINEL)
    whole = backing[_PAD:-_PAD]
    want = backing.copy()
    stack = rng.integers(-50, 50, (size, size * count)).astype(np.float64)  # exact sums
    if op == "all_to_all":
        whole[...] = stack[rank]
        want[_PAD:-_PAD] = stack[:, rank * count : (rank + 1) * count].reshape(-1)
        return backing, whole, whole, want
    theirs = slice(right * count, (right + 1) * count)
    if op == "all_gather":
        whole[...] = rng.standard_normal(size * count)
        whole[theirs] = stack[rank, :count]
        want[_PAD:-_PAD] = stack[:, :count].reshape(-1)
        return backing, whole, whole[theirs], want
    whole[...] = stack[rank]
    want[_PAD:-_PAD] = stack[rank]
    want[_PAD:-_PAD][theirs] = stack[:, rank * count : (rank + 1) * count].sum(0)
    return backing, whole[theirs], whole, want


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("path", ["blocking", "async", "general"])
def test_staged_segment_takes_any_overlap(hetcomm_comm, rng, errors, input_copies, path):
    """Where staged's shared segment holds the size, x is staged whole before out is
    written: every overlap goes uncopied and the result is what each rank passed."""
    comm = hetcomm_comm
    size, rank = comm.size, comm.rank
    count = 33
    t = introspect.transport_of(comm, "all_to_all", np.zeros(1))
    if t.name != "staged":
        pytest.skip(f"the block collectives run on {t.name}, which copies overlapped inputs")
    # one call of the size first: the segment grows to it (and that call may copy)
    comm.all_to_all(np.zeros(size * count), np.ones(size * count))
    if not _stages(comm, size * count * 8):
        pytest.skip("staged has no shared segment for this group (one host's ranks only)")
    input_copies.clear()
    with _on_path(path):
        for op in ("all_to_all", "all_gather", "reduce_scatter"):
            backing, out, x, want = _overlapping(rng, op, size, rank, count)
            _check_call(errors, path, f"{op} {path}", getattr(comm, op), backing, out, x, want)
    errors.expect(not input_copies, f"{path}: inputs copied ({input_copies} bytes)")
    errors.verify()
