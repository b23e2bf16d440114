"""Where every rank of a group has got to, in shared memory among the ranks of one host.

Each rank writes the sequence number of the collective it has entered into a small table shared
by the group's ranks of its host, beside its process id; a rank whose wait expires reads the
others' numbers there without their cooperation, and a rank that died inside an operation is
named by its process being gone. Ranks on other hosts cannot be read that way and are reported
as unknown. The same segment holds the check's records (hetcomm.agree) and the direct
transport's mailbox (transports/direct/mailbox.py) where every rank is on one host.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
from itertools import count
from typing import Any

import numpy as np
from mpi4py import MPI

from . import processes

LINE = 64  # bytes: what follows the table starts on a cache line
_SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
_names = count()


class Arrivals:
    """Each rank's latest entered collective, in shared memory among the ranks of one host,
    beside each rank's process id: a rank that died inside an operation had arrived, and is
    named by its process being gone.

    Where every rank is on this host, the segment also holds `records` bytes for the check's
    records (agree.SharedRecords, made by the Agreement at `records_at` of `segment`) and
    `lanes` bytes more (`lanes`: the direct transport's mailbox); where not, or where shared
    memory cannot be had, `segment` and `lanes` are None, alike on every rank."""

    def __init__(self, mpi_comm: MPI.Intracomm, records: int = 0, lanes: int = 0) -> None:
        rank, size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        local: Any = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        try:
            self.local_ranks: list[int] = local.allgather(rank)
            # every rank sees the same local size where it equals the group's
            if local.Get_size() != size:
                records = lanes = 0
            start = -(-16 * size // LINE) * LINE
            self.segment, shared = _shared_table(
                local, rank, size, start + records + lanes if records or lanes else 0
            )
        finally:
            local.Free()
        self.records_at = start
        self.lanes: memoryview | None = None
        if lanes and self.segment is not None:
            self.lanes = memoryview(self.segment)[start + records : start + records + lanes]
        self.rank = rank
        self.table, self._pids = shared[:size], shared[size:]
        self.table[rank] = 0
        # a process id says whether a rank lives only where every local rank's can be seen
        # (ranks of one host may still sit in different pid namespaces)
        self._pids_seen = not any(processes.gone(int(self._pids[r])) for r in self.local_ranks)

    def enter(self, seq: int) -> None:
        """Note that this rank has entered collective `seq`."""
        self.table[self.rank] = seq

    def late(self, seq: int) -> tuple[list[int], list[int]]:
        """(ranks of this host not yet at collective `seq`, ranks that cannot be read here)."""
        table = self.table
        here = set(self.local_ranks)
        late = [r for r in self.local_ranks if table[r] < seq]
        unknown = [r for r in range(len(table)) if r not in here]
        return late, unknown

    def dead(self) -> list[int]:
        """Ranks of this host whose process has ended (killed, crashed, exited)."""
        if not self._pids_seen:
            return []
        return [r for r in self.local_ranks if processes.gone(int(self._pids[r]))]

    def close(self) -> None:
        """Unmap the shared table (a view still alive keeps it mapped until exit: the check's
        records and the direct transport let theirs go first)."""
        if self.lanes is not None:
            self.lanes.release()  # the direct transport let its views go when it closed
            self.lanes = None
        if self.segment is not None:
            self.table = np.zeros(len(self.table), np.int64)
            self._pids = np.zeros(len(self.table), np.int64)
            self._pids_seen = False
            # a view of it still alive somewhere keeps it mapped: the OS frees it at exit
            with contextlib.suppress(BufferError):
                self.segment.close()
            self.segment = None


def _shared_table(
    local: MPI.Intracomm, rank: int, size: int, nbytes: int = 0
) -> tuple[mmap.mmap | None, np.ndarray]:
    """An int64 table of 2 * `size` entries (sequence numbers, then process ids, which each
    rank `rank` writes before the others read) shared by the ranks of `local`, made by its first
    rank and unlinked as soon as every rank has mapped it (nothing is left behind, even after a
    crash); a private table where shared memory cannot be had (every rank learns that alike).
    `nbytes`: the segment's size where more than the table (which it starts with)."""
    nbytes = max(nbytes, 16 * size)
    name = ""
    fd = -1
    if local.Get_rank() == 0:
        try:
            path = os.path.join(_SHM_DIR, f"hetcomm-arrivals-{os.getpid()}-{next(_names)}")
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(fd, nbytes)
            name = path
        except OSError:
            name = ""
    name = local.bcast(name, root=0)
    mapped: mmap.mmap | None = None
    ok = 0
    if name:
        try:
            if fd < 0:
                fd = os.open(name, os.O_RDWR)
            mapped = mmap.mmap(fd, nbytes)
            np.frombuffer(mapped, dtype=np.int64)[size + rank] = os.getpid()
            ok = 1
        except OSError:
            mapped = None
        finally:
            if fd >= 0:
                os.close(fd)
    every = local.allreduce(ok, op=MPI.MIN)
    if name and local.Get_rank() == 0:
        with contextlib.suppress(OSError):
            os.unlink(name)
    if not every or mapped is None:
        if mapped is not None:
            mapped.close()
        private = np.zeros(2 * size, np.int64)
        private[size + rank] = os.getpid()
        return None, private
    return mapped, np.frombuffer(mapped, dtype=np.int64, count=2 * size)
