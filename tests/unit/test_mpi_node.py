"""The block split of the shared-window all-reduce (hetcomm.transports.mpi.node): pure."""

from __future__ import annotations

import itertools

import pytest

from hetcomm.transports.mpi.node import blocks


@pytest.mark.parametrize("nbytes", [0, 1, 2, 8, 63, 64, 65, 1000, 4096, 800_000, 3 << 20])
@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
@pytest.mark.parametrize("size", [1, 2, 3, 4, 7])
def test_blocks_cover_in_order_on_lines_and_whole_items(nbytes, itemsize, size):
    nbytes -= nbytes % itemsize
    spans = blocks(nbytes, itemsize, size)
    assert len(spans) == size
    assert spans[0][0] == 0 and spans[-1][1] == nbytes
    for (a, b), (c, _) in itertools.pairwise(spans):
        assert a <= b == c
    for a, b in spans:
        assert a % 64 == 0 or a == nbytes  # every block starts on a cache line
        assert (b - a) % itemsize == 0
    # whole lines shared out evenly (one more for the first ones); the last block may end
    # inside its last line
    lengths = [b - a for a, b in spans]
    assert max(lengths) - min(lengths) < 2 * 64
    assert lengths == sorted(lengths, reverse=True)


def test_a_rank_without_room_in_dev_shm_is_named_and_nothing_is_left(monkeypatch):
    """Creating a segment fails (a full /dev/shm): the error names the rank, and the segment
    is not left mapped; on one rank (COMM_SELF), so that no other rank waits."""
    from mpi4py import MPI

    from hetcomm import TransportUnavailable
    from hetcomm.transports import shm
    from hetcomm.transports.mpi import node as mpi_node

    def full(*args, **kwargs):
        raise shm.SegmentError("cannot reserve 1 MiB in /dev/shm for shared slots (No space)")

    node = mpi_node.NodeReduce(MPI.COMM_SELF)
    monkeypatch.setattr(mpi_node, "SharedSlots", full)
    with pytest.raises(TransportUnavailable, match=r"rank\(s\) \[0\] could not reserve"):
        node.segment(4096, lambda request, what: request.Wait())
    assert node.capacity == 0
    monkeypatch.undo()
    seg = node.segment(4096, lambda request, what: request.Wait())  # room again: it works
    assert seg.nbytes == 4096 and node.capacity >= 4096
    node.close()
