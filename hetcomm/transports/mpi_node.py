"""Fused all-reduces of host arrays among the ranks of one node, through one shared window.

Tensor fusion packs many small arrays into one buffer per dtype and reduces it (hetcomm.fusion).
Where every rank of the group is on one node and the group's transport is `mpi`, a blocking
call packs straight into this rank's segment of an MPI shared-memory window
(MPI_Win_allocate_shared) and reduces there, on the calling thread:

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

from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

from ..ops import ReduceOp

# a rank's segment holds at most this much; larger fused buffers go through the MPI transport
MAX_BYTES = 16 << 20
_LINE = 64  # blocks start on cache lines
_NAMES = {ReduceOp.SUM: "sum", ReduceOp.AVG: "sum", ReduceOp.PROD: "prod", ReduceOp.MIN: "min",
          ReduceOp.MAX: "max"}  # fmt: skip


def blocks(nbytes: int, itemsize: int, size: int) -> list[tuple[int, int]]:
    """[start, stop) byte ranges of `nbytes`, one per rank, in order, covering them all: starts
    on 64-byte lines, whole items, sizes as even as that allows (trailing ones may be empty)."""
    unit = _LINE if _LINE % itemsize == 0 else itemsize
    units = -(-nbytes // unit)
    base, extra = divmod(units, size)
    spans, start = [], 0
    for r in range(size):
        stop = min(nbytes, start + (base + (r < extra)) * unit)
        spans.append((start, stop))
        start = stop
    return spans


class NodeReduce:
    """The shared window of one communicator's fused all-reduces (see the module)."""

    def __init__(self, comm: MPI.Intracomm) -> None:
        self._parent = comm
        self._comm: MPI.Intracomm | None = None
        self._win: MPI.Win | None = None
        self._segments: list[np.ndarray] = []
        self.capacity = 0
        self.rank, self.size = comm.Get_rank(), comm.Get_size()

    def segment(self, nbytes: int) -> np.ndarray:
        """The first `nbytes` of this rank's segment (uint8). Growing it is collective: every
        rank asks for the same size at the same call, since they fuse the same arrays."""
        if nbytes > self.capacity:
            if self._comm is None:
                self._comm = self._parent.Dup()
            if self._win is not None:
                self._win.Free()
                self._win, self._segments = None, []
            capacity = min(MAX_BYTES, max(nbytes, 2 * self.capacity, 1 << 20))
            capacity = -(-capacity // _LINE) * _LINE
            win = MPI.Win.Allocate_shared(capacity, 1, comm=self._comm)
            segments: list[Any] = [win.Shared_query(r)[0] for r in range(self.size)]
            self._segments = [np.frombuffer(seg, np.uint8, capacity) for seg in segments]
            self._win, self.capacity = win, capacity
        return self._segments[self.rank][:nbytes]

    def all_reduce(self, nbytes: int, dtype: str, op: ReduceOp,
                   wait: Callable[[Any, str], None]) -> None:  # fmt: skip
        """Reduce the `nbytes` every rank packed into its segment (values of `dtype`); the
        result is in every segment after. `wait(request, what)` waits for a barrier within the
        operation's timeout."""
        from ..kernels import reduce as kr

        assert self._comm is not None and nbytes <= self.capacity
        storage = kr.storage_dtype(dtype)
        wait(self._comm.Ibarrier(), "every rank's input in the shared window")
        lo, hi = blocks(nbytes, storage.itemsize, self.size)[self.rank]
        if hi > lo:
            segs = self._segments
            mine = segs[self.rank][lo:hi]
            acc = mine.view(storage)
            name = _NAMES[op]
            for q in range(self.size):
                if q != self.rank:
                    kr.combine(acc, segs[q][lo:hi].view(storage), name, dtype)
            if op is ReduceOp.AVG:
                kr.divide(acc, self.size, dtype)
            for q in range(self.size):
                if q != self.rank:
                    segs[q][lo:hi] = mine
        wait(self._comm.Ibarrier(), "every rank's block of the result")

    def close(self, collective: bool = True) -> None:
        """Free the window and the communicator: collective, as the communicator's close is.
        An aborted communicator's ranks may not all get here: then both are left to
        MPI_Finalize (`collective` False)."""
        self._segments = []
        if collective:
            if self._win is not None:
                self._win.Free()
            if self._comm is not None:
                self._comm.Free()
        self._win, self._comm, self.capacity = None, None, 0
