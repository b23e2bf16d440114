"""The in-place all_gather (x is this rank's block of out, NCCL's rule) reads x where it lies
on every path, blocking, asynchronous and general: no packed copy of x, the right result, and
nothing outside out written. Any other overlap of x and out is still copied first."""

from __future__ import annotations

import numpy as np
import pytest

from hetcomm import general
from hetcomm import work as work_mod

_PAD, _SENTINEL = 3, -7.5
# one element to past the shared segment's small sizes and the persistent requests' limit
_COUNTS = (1, 9, 4099, 70001)


def _counting_copies(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the inputs the general path copies from now on (it copies an input the
    output overlaps)."""
    copies: list[int] = []
    real = general.contiguous_in

    def counting(b, copy=False):
        if copy:
            copies.append(b.nbytes)
        return real(b, copy)

    monkeypatch.setattr(general, "contiguous_in", counting)
    return copies


def _call(comm, path, out, x):
    if path == "async":
        comm.all_gather(out, x, async_op=True).wait(timeout=60)
    else:
        comm.all_gather(out, x)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("path", ["blocking", "async", "general"])
def test_own_block_is_read_in_place(hetcomm_comm, rng, errors, monkeypatch, path):
    comm = hetcomm_comm
    size, rank = comm.size, comm.rank
    copies = _counting_copies(monkeypatch)
    observer = None
    if path == "general":
        # while an observer is registered, every call is a Work of the general path
        observer = lambda w: None  # noqa: E731
        work_mod.add_observer(observer)
    try:
        for count in _COUNTS:
            stack = rng.standard_normal((size, count))
            backing = np.full(size * count + 2 * _PAD, _SENTINEL)
            out = backing[_PAD:-_PAD]
            out[...] = rng.standard_normal(size * count)  # the other blocks' old values
            x = out[rank * count : (rank + 1) * count]
            x[...] = stack[rank]
            if errors.run(f"{path} {count}", _call, comm, path, out, x):
                errors.expect(
                    np.array_equal(out, stack.reshape(-1)), f"{path} {count}: wrong result"
                )
                errors.expect(
                    bool(
                        (backing[:_PAD] == _SENTINEL).all() and (backing[-_PAD:] == _SENTINEL).all()
                    ),
                    f"{path} {count}: wrote outside out",
                )
    finally:
        if observer is not None:
            work_mod.remove_observer(observer)
    errors.expect(not copies, f"{path}: the input was copied ({copies} bytes)")
    if path == "general":
        uses = sum(r["uses"] for r in comm.routes() if r["op"] == "all_gather")
        errors.expect(uses == len(_COUNTS), f"general path took {uses} of {len(_COUNTS)} calls")
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_other_overlaps_are_copied_first(hetcomm_comm, rng, errors, monkeypatch):
    """x as the next rank's block of out (or straddling two blocks): copied before any byte
    of out is written, so every rank still gathers the x it passed."""
    comm = hetcomm_comm
    size, rank = comm.size, comm.rank
    copies = _counting_copies(monkeypatch)
    observer = lambda w: None  # noqa: E731
    work_mod.add_observer(observer)  # the general path, where the packing happens
    try:
        count = 5
        for shift in (0, 2):  # the next rank's block; straddling two blocks
            stack = rng.standard_normal((size, count))
            out = rng.standard_normal(size * count + count)
            start = ((rank + 1) % size) * count + shift
            x = out[start : start + count]
            x[...] = stack[rank]
            if errors.run(f"shift {shift}", comm.all_gather, out[: size * count], x):
                errors.expect(
                    np.array_equal(out[: size * count], stack.reshape(-1)),
                    f"shift {shift}: wrong result",
                )
    finally:
        work_mod.remove_observer(observer)
    errors.expect(len(copies) == 2, f"{len(copies)} of 2 overlapping inputs copied")
    errors.verify()
