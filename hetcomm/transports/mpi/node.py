"""Fused all-reduces of host arrays among the ranks of one node, through shared memory.

Tensor fusion packs many small arrays into one buffer per dtype and reduces it (hetcomm.fusion).
Where every rank of the group is on one node and the group's transport is `mpi`, a blocking
call packs straight into this rank's shared segment (a /dev/shm file that every rank of the
node maps) and reduces there, on the calling thread:

1. every rank packs its arrays into its own segment;
2. a barrier: every input is in place;
3. rank r reduces block r of the elements over every segment, in place in its own segment (its
   own input is the accumulator, the others are combined in rank order), and copies the result
   into block r of every other segment;
4. a barrier: every segment holds the whole result, which each rank unpacks from its own.

Each block is reduced by one rank only, so every rank gets the same bits. Between the two
barriers each rank touches only its own block of the segments (blocks start on 64-byte lines,
so no two ranks write one cache line), and a rank packs its next input only after the second
barrier, when nobody writes its segment any more. Against the fused MPI all-reduce it replaces,
this saves the copies into and out of MPI's own buffers and the hand-off to the lane thread
(docs/BENCHMARKS.md, tensor fusion). The barriers are non-blocking barriers of a communicator
of its own, waited for within the operation's timeout.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

from ...errors import TransportUnavailable
from ...ops import ReduceOp
from ..shm import SegmentError, SharedSlots
from ..spans import shards

# a rank's segment holds at most this much; larger fused buffers go through the MPI transport
MAX_BYTES = 16 << 20
_LINE = 64  # blocks start on cache lines
_NAME_BYTES = 64  # a segment's name, as it travels
_NAMES = {
    ReduceOp.SUM: "sum",
    ReduceOp.AVG: "sum",
    ReduceOp.PROD: "prod",
    ReduceOp.MIN: "min",
    ReduceOp.MAX: "max",
}


def blocks(nbytes: int, itemsize: int, size: int) -> list[tuple[int, int]]:
    """[start, stop) byte ranges of `nbytes`, one per rank, in order, covering them all: starts
    on 64-byte lines, whole items, sizes as even as that allows (trailing ones may be empty)."""
    return [
        (a * itemsize, b * itemsize)
        for a, b in shards(nbytes // itemsize, itemsize, size, align=_LINE)
    ]


class NodeReduce:
    """The shared segments of one communicator's fused all-reduces (see the module).

    Each rank's segment is a /dev/shm file that it creates and the others map by name (names
    travel over MPI); once every rank has mapped every segment, each unlinks its own file, so
    nothing is left behind if a process dies. Growing them is collective (every rank fuses the
    same arrays, so all grow at the same call); closing is not, so a rank whose peers aborted
    still closes.
    """

    def __init__(self, comm: MPI.Intracomm) -> None:
        self._parent = comm
        self._comm: MPI.Intracomm | None = None
        self._slots: list[SharedSlots] = []
        self._segments: list[np.ndarray] = []
        self._generation = 0
        self.capacity = 0
        self.rank, self.size = comm.Get_rank(), comm.Get_size()

    def segment(self, nbytes: int, wait: Callable[[Any, str], None]) -> np.ndarray:
        """The first `nbytes` of this rank's segment (uint8), grown first where needed.
        `wait(request, what)` waits for an MPI request within the operation's timeout."""
        if nbytes > self.capacity:
            if self._comm is None:
                self._comm = self._parent.Dup()
            self._unmap()
            capacity = min(MAX_BYTES, max(nbytes, 2 * self.capacity, 1 << 20))
            capacity = -(-capacity // _LINE) * _LINE
            self._generation += 1
            name = f"hetcomm-node-{os.getpid()}-{id(self):x}-{self._generation}"
            try:
                mine: SharedSlots | None = SharedSlots(name, 1, capacity, create=True)
            except SegmentError as exc:  # /dev/shm full: every rank hears of it below
                mine, name, why = None, "", str(exc)
            names = np.zeros((self.size, _NAME_BYTES), np.uint8)
            own = np.frombuffer(name.encode().ljust(_NAME_BYTES, b"\0"), np.uint8)
            wait(self._comm.Iallgather(own, names), "the names of the shared segments")
            failed = [r for r in range(self.size) if not names[r].any()]
            if failed:
                if mine is not None:
                    mine.unlink()
                    mine.close()
                raise TransportUnavailable(
                    f"all_reduce_coalesced: rank(s) {failed} could not reserve {capacity} bytes "
                    f"in /dev/shm for the shared segments of fused all-reduces"
                    + (f" ({why})" if mine is None else "")
                )
            assert mine is not None
            self._slots = [mine]  # closed (and unlinked) by _unmap even if a peer's fails to map
            slots = [
                mine
                if r == self.rank
                else SharedSlots(bytes(names[r]).rstrip(b"\0").decode(), 1, capacity, False)
                for r in range(self.size)
            ]
            self._slots = slots
            wait(self._comm.Ibarrier(), "every rank mapping the shared segments")
            mine.unlink()
            self._segments = [s.array for s in slots]
            self.capacity = capacity
        return self._segments[self.rank][:nbytes]

    def all_reduce(
        self, nbytes: int, dtype: str, op: ReduceOp, wait: Callable[[Any, str], None]
    ) -> None:
        """Reduce the `nbytes` every rank packed into its segment (values of `dtype`); the
        result is in every segment after. `wait(request, what)` waits for a barrier within the
        operation's timeout."""
        from ...kernels import reduce

        assert self._comm is not None and nbytes <= self.capacity
        storage = reduce.storage_dtype(dtype)
        wait(self._comm.Ibarrier(), "every rank's input in its shared segment")
        lo, hi = blocks(nbytes, storage.itemsize, self.size)[self.rank]
        if hi > lo:
            segs = self._segments
            mine = segs[self.rank][lo:hi]
            acc = mine.view(storage)
            name = _NAMES[op]
            for q in range(self.size):
                if q != self.rank:
                    reduce.combine(acc, segs[q][lo:hi].view(storage), name, dtype)
            if op is ReduceOp.AVG:
                reduce.divide(acc, self.size, dtype)
            for q in range(self.size):
                if q != self.rank:
                    segs[q][lo:hi] = mine
        wait(self._comm.Ibarrier(), "every rank's block of the result")

    def _unmap(self) -> None:
        self._segments = []
        for s in self._slots:
            s.unlink()  # our own, if it was not unlinked yet (the others' are gone already)
            s.close()
        self._slots, self.capacity = [], 0

    def close(self, free_comm: bool = True) -> None:
        """Unmap the segments (local) and free the communicator, as the communicator's close
        frees its own (not where it was aborted: operations may still be in flight on it)."""
        self._unmap()
        if free_comm and self._comm is not None:
            self._comm.Free()
        self._comm = None
