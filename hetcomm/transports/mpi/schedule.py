"""The mpi transport's large-count arithmetic: which MPI calls an operation is cut into.

MPI counts are C ints: a call may name at most 2^31 - 1 elements, and an MPI library without the
MPI-4 large-count functions (`MPI_Allreduce_c`, ...; Open MPI 5.0 has none) refuses more
(mpi4py raises `MPI_ERR_ARG`). The mpi transport therefore cuts an operation into calls that each
move at most `MAX_CALL_BYTES` per buffer argument, counting every block of a collective's larger
buffer (all_gather's `out`, reduce_scatter's and all_to_all's `x`). At 1 GiB both the element
count and the byte count of every call stay below 2^31 whatever the dtype, and a call of 1 GiB
costs the same per byte as a larger one.

Pure arithmetic, tested without MPI; `MAX_CALL_BYTES` is read at each call, so a test may lower
it to run the cut-up path on small arrays.
"""

from __future__ import annotations

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
