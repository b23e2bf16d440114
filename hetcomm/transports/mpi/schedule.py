"""The mpi transport's pure arithmetic: which MPI calls an operation is cut into (large counts),
and which collectives run blocking on the lane (`laned`).

MPI counts are C ints: a call may name at most 2^31 - 1 elements, and an MPI library without the
MPI-4 large-count functions (`MPI_Allreduce_c`, ...; Open MPI 5.0 has none) refuses more
(mpi4py raises `MPI_ERR_ARG`). The mpi transport therefore cuts an operation into calls that each
move at most `MAX_CALL_BYTES` per buffer argument, counting every block of a collective's larger
buffer (all_gather's `out`, reduce_scatter's and all_to_all's `x`). At 1 GiB both the element
count and the byte count of every call stay below 2^31 whatever the dtype, and a call of 1 GiB
costs the same per byte as a larger one.

Pure arithmetic, tested without MPI; `MAX_CALL_BYTES` is read at each call, so a test may lower
it to run the cut-up path on small arrays. `LANE_MIN` (below) says which collectives run as
blocking MPI calls on the transport's lane thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ...arrays import Buffer

MAX_CALL_BYTES = 1 << 30


def element_spans(count: int, itemsize: int, blocks: int = 1) -> list[tuple[int, int]]:
    """(first element, element count) of each call's share of `count` elements.

    `blocks` is how many such shares one call moves (a collective's `size` blocks), so that
    `blocks * n * itemsize <= MAX_CALL_BYTES` for every share of n elements (n >= 1 even when one
    element is larger than the limit). One span, (0, count), when no cut is needed, including
    count 0.
    """
    if count < 0 or itemsize < 1 or blocks < 1:
        raise ValueError(f"element_spans: count {count}, itemsize {itemsize}, blocks {blocks}")
    step = max(1, MAX_CALL_BYTES // (itemsize * blocks))
    if count <= step:
        return [(0, count)]
    return [(start, min(step, count - start)) for start in range(0, count, step)]


def spans(buf: Buffer, blocks: int = 1, parts: int = 1) -> list[tuple[int, int]]:
    """The calls `buf` (of `parts` equal parts, moved `blocks` at a time) is cut into: one,
    unless an MPI count would pass 2^31 (see element_spans). Device buffers are not cut."""
    if buf.nbytes * blocks // parts <= MAX_CALL_BYTES or buf.host is None:
        return [(0, buf.count // parts)]
    return element_spans(buf.count // parts, buf.itemsize, blocks)


# The collectives that run as blocking MPI calls on the communicator's lane thread: those of an
# op in LANE_MIN of more bytes than its entry. Every other collective is one non-blocking MPI
# call: made and polled by the calling thread where the caller waits for it (no thread
# hand-off, about 40 us a call on a 2-core VM), else as MpiTransport._start says. MPI never matches
# a blocking collective with a non-blocking one (Open MPI 5 waits forever), so which kind a call
# is depends on its op and size, which every rank agrees on, and never on the state of this
# rank's lane. Measured blocking against non-blocking, 64 KiB-16 MiB on 2 and 4 ranks, Open MPI
# 5.0 (2-core VM) and 4.1.6 (16-core host): the non-blocking forms of all_gather and all_to_all
# took 0.65-1.05x the time of the blocking ones (one all_gather outlier of 5x did not repeat);
# reduce_scatter too up to 4 MiB of input, but about 2x at 16 MiB on both libraries (3 runs);
# broadcast up to 1 MiB, and 1.27-1.38x from 4 MiB on 4 ranks of 4.1.6 in one run (not in
# another); all_reduce 1.2-1.8x on 5.0 from 64 KiB (about 1.0 on 4.1.6) and reduce 2.6-4.5x on
# 5.0 from 64 KiB, where a hand-off costs less than the difference from 256 KiB. `hetcomm tune`
# measures both forms of each op on the machine at hand and its values replace these
# (Tuning.lane_min). Reduces past 128 KiB: on 2 ranks, Open MPI 5.0 (VM) and 4.1.6 (H200
# host), the non-blocking reduce took 3.2-4.9x the blocking one from 128 KiB, the blocking one
# on a bare thread 1.7-2.2x (`hetcomm bench --study lane`, docs/BENCHMARKS.md), and `hetcomm
# tune` put the lane past 128 KiB on both.
LANE_BYTES = 256 * 1024
LANE_MIN: dict[str, int | None] = {
    "all_reduce": LANE_BYTES,
    "reduce": 128 * 1024,
    "broadcast": 2 * 1024 * 1024,
    "reduce_scatter": 4 * 1024 * 1024,
}


def laned(lane_min: dict[str, int | None], op: str, nbytes: int) -> bool:
    """Whether a collective `op` of `nbytes` (the byte count _start is given) runs as a
    blocking MPI call on the lane, by `lane_min` (LANE_MIN and what `hetcomm tune` measured)."""
    least = lane_min.get(op)
    return least is not None and nbytes > least
