"""The mpi transport's cut of large counts into MPI calls (pure arithmetic, no MPI)."""

from __future__ import annotations

import pytest

from hetcomm.transports.mpi import schedule as mpi_chunks
from hetcomm.transports.mpi.schedule import element_spans

INT_MAX = 2**31 - 1


def covers(spans: list[tuple[int, int]], count: int) -> bool:
    """The spans follow each other from 0 to `count` without gap or overlap."""
    at = 0
    for start, n in spans:
        if start != at or n < 1:
            return False
        at += n
    return at == count


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
@pytest.mark.parametrize("blocks", [1, 2, 3, 8, 1000])
def test_every_call_stays_under_the_int_limit(itemsize: int, blocks: int) -> None:
    count = 2**31 + 5  # elements per block: more than one MPI count can name
    spans = element_spans(count, itemsize, blocks)
    assert covers(spans, count)
    assert len(spans) > 1
    for _, n in spans:
        assert n * blocks <= INT_MAX  # elements named by one call
        assert n * blocks * itemsize <= mpi_chunks.MAX_CALL_BYTES  # bytes one call moves
    # as few calls as the limit allows
    per_call = mpi_chunks.MAX_CALL_BYTES // (itemsize * blocks)
    assert len(spans) == -(-count // per_call)


def test_small_counts_are_one_call() -> None:
    assert element_spans(0, 4) == [(0, 0)]
    assert element_spans(1000, 8, 16) == [(0, 1000)]
    limit = mpi_chunks.MAX_CALL_BYTES
    assert element_spans(limit, 1) == [(0, limit)]
    assert element_spans(limit + 1, 1) == [(0, limit), (limit, 1)]


def test_a_lowered_limit_is_read_at_each_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mpi_chunks, "MAX_CALL_BYTES", 16)
    assert element_spans(10, 2) == [(0, 8), (8, 2)]
    assert element_spans(13, 1, 4) == [(0, 4), (4, 4), (8, 4), (12, 1)]
    # an element larger than the limit still moves, one per call
    assert element_spans(3, 8, 4) == [(0, 1), (1, 1), (2, 1)]


@pytest.mark.parametrize(("count", "itemsize", "blocks"), [(-1, 1, 1), (5, 0, 1), (5, 1, 0)])
def test_nonsense_is_refused(count: int, itemsize: int, blocks: int) -> None:
    with pytest.raises(ValueError, match="element_spans"):
        element_spans(count, itemsize, blocks)
