"""Aligned shards: how a rank's elements are split into one range per rank (pure)."""

from __future__ import annotations

# shard boundaries fall on this many bytes, so that 16-byte vector loads stay aligned
ALIGN_BYTES = 16


def shards(count: int, itemsize: int, size: int, align: int = ALIGN_BYTES) -> list[tuple[int, int]]:
    """[start, stop) element ranges, one per rank, covering `count` elements in order.

    Boundaries are multiples of `align` bytes where the item size allows; the shards differ by
    at most one alignment unit, and trailing shards may be empty when `count` is small.
    """
    if size < 1 or count < 0 or itemsize < 1:
        raise ValueError(f"shards: bad arguments count={count} itemsize={itemsize} size={size}")
    unit = align // itemsize if align % itemsize == 0 else 1
    units = -(-count // unit)
    base, extra = divmod(units, size)
    spans, start = [], 0
    for r in range(size):
        stop = min(count, start + (base + (r < extra)) * unit)
        spans.append((start, stop))
        start = stop
    return spans
