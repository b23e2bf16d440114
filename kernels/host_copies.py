"""Small copies between host and device memory that do not wait for other processes.

Several processes share one GPU when the ranks of a job outnumber its GPUs. There, whenever
two processes make one-dimensional cudaMemcpyAsync copies between host and device of fewer
than 24-28 KiB at the same time, each copy waits for a switch between the processes'
contexts, about 140 us for every other process copying (H100, driver 580: a copy each way in
each of 2 / 4 processes at once took 290 / 565 us at 8 B to 24 KiB, 25 / 32 us from 28 KiB up,
as copies that the copy engines take). The same bytes queued as a two-dimensional copy of two
rows or more do not wait, at any size: 22 / 27 us for 2 B to 24 KiB, and no slower when one
process copies alone (H200 alike; docs/BENCHMARKS.md, "Small copies between host and
device"). Device-to-device copies wait for the switch however they are shaped, so they stay
one-dimensional.

So a copy between host and device of 2 B to SMALL_BYTES is queued as one or two 2D copies
whose rows cover its bytes exactly, in order; a 1-byte copy, a larger one and a copy between
two device buffers as the one call it was.
"""

from __future__ import annotations

import functools
from typing import Any

# below this many bytes a host<->device copy goes as rows (1D copies stalled up to 24 KiB and
# ran on the copy engines from 28 KiB up)
SMALL_BYTES = 32 << 10
# the widest row: rows of 64 B to 4 KiB ran alike; rows of 1 B cost more as they multiply
# (1 KiB of 1-byte rows, 2 processes at once: 33 us; 20 KB of them: 166 us)
MAX_WIDTH = 4096
# a tail copied as 1-byte-wide rows is at most 2 * TAIL_ALIGN - 1 rows
TAIL_ALIGN = 64

_DEVICE_TO_DEVICE = 3  # cudaMemcpyDeviceToDevice


def _widest(nbytes: int) -> int:
    """The widest power-of-two row, at most MAX_WIDTH, that divides `nbytes` into two rows or
    more."""
    width = MAX_WIDTH
    while width > 1 and (nbytes % width or nbytes // width < 2):
        width //= 2
    return width


@functools.cache
def rows(nbytes: int) -> tuple[tuple[int, int, int], ...]:
    """The 2D copies (offset, width, height) that cover `nbytes` bytes from offset 0 in
    order, each of two rows or more; () where the copy goes as one 1D copy (fewer than 2
    bytes, or SMALL_BYTES and more). A size with a power-of-two factor under TAIL_ALIGN is
    split in two: rows of TAIL_ALIGN bytes or wider, then a tail of TAIL_ALIGN to
    2 * TAIL_ALIGN - 1 bytes in narrow rows, so no copy is thousands of 1-byte rows."""
    if nbytes < 2 or nbytes >= SMALL_BYTES:
        return ()
    width = _widest(nbytes)
    if width >= TAIL_ALIGN or nbytes < 3 * TAIL_ALIGN:
        return ((0, width, nbytes // width),)
    tail = TAIL_ALIGN + nbytes % TAIL_ALIGN
    bulk = nbytes - tail
    wide, narrow = _widest(bulk), _widest(tail)
    return ((0, wide, bulk // wide), (bulk, narrow, tail // narrow))


def memcpy_async(rt: Any, dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
    """Queue a copy of `nbytes` from address `src` to `dst` on `stream` (a raw handle), as
    cudaMemcpyAsync would (`kind`: the cudaMemcpyKind, `rt`: CuPy's runtime module), on the
    copy engines where it is between host and device (see the module's note)."""
    shape = rows(nbytes) if kind != _DEVICE_TO_DEVICE else ()
    copy_2d = getattr(rt, "memcpy2DAsync", None)  # a runtime without it copies as it can
    if not shape or copy_2d is None:
        rt.memcpyAsync(dst, src, nbytes, kind, stream)
        return
    for offset, width, height in shape:
        copy_2d(dst + offset, width, src + offset, width, width, height, kind, stream)
