"""Agreement across a group: each collective's signature compared before its bytes move, and
where every rank has got to, so that a wait that times out can name the ranks it waits for.

The check (on by default, `HETCOMM_CHECK=0` turns it off) is one MPI all-reduce (MAX) of a few
integers per collective on a communicator of its own: the signature's fields and their
negations, so that the result equals the vector a rank sent exactly when every rank sent the
same one. It runs before the operation's first byte moves; a difference raises MismatchError on
every rank, naming each field that differs and each rank's value, and leaves every buffer as it
was. Blocking calls use one persistent request; asynchronous ones a non-blocking all-reduce
whose completion starts the operation (see Communicator).

The arrivals table is a small shared-memory segment per communicator and host: each rank writes
the sequence number of the collective it has entered, and a rank whose wait expires reads the
others' numbers there, without their cooperation. Ranks on other hosts cannot be read that way
and are reported as unknown.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
from collections.abc import Callable, Sequence
from itertools import count
from typing import Any

import numpy as np
from mpi4py import MPI

from .dtypes import CODES, DTYPES
from .errors import MismatchError
from .ops import ReduceOp
from .plan import OPS

_OP_CODES = {name: i + 1 for i, name in enumerate(OPS)}
_DTYPE_CODES = {name: code + 1 for name, code in CODES.items()}  # 0: no dtype
_REDOP_CODES = {op: i + 1 for i, op in enumerate(ReduceOp)}
_REDOPS = {i + 1: op.name for i, op in enumerate(ReduceOp)}
# the fields of a signature, in the order they travel
FIELDS = ("operation", "dtype", "count", "reduce op", "root", "sequence")
_SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
_names = count()


def signature(
    op: str, dtype: str | None, n: int, redop: ReduceOp | None, root: int, seq: int = 0
) -> np.ndarray:
    """The vector a rank contributes for one collective: its fields, then their negations."""
    f = (
        _OP_CODES[op],
        _DTYPE_CODES[dtype] if dtype is not None else 0,
        n,
        _REDOP_CODES[redop] if redop is not None else 0,
        root,
        seq,
    )
    return np.array([*f, *(-v for v in f)], dtype=np.int64)


def differences(every: np.ndarray) -> list[str]:
    """'count differs: rank 0: 1024, rank 1: 2048' for each field that is not the same on every
    rank of `every` (one signature per row, as `signature` makes them)."""
    out = []
    for col, field in enumerate(FIELDS):
        values = every[:, col]
        if (values == values[0]).all():
            continue
        shown = [_show(field, int(v)) for v in values]
        out.append(f"{field} differs: " + ", ".join(f"rank {r}: {v}" for r, v in enumerate(shown)))
    return out


def _show(field: str, v: int) -> str:
    if field == "operation":
        return OPS[v - 1] if v > 0 else "?"
    if field == "dtype":
        return DTYPES[v - 1] if v > 0 else "none"
    if field == "reduce op":
        return _REDOPS.get(v, "none")
    if field == "root":
        return str(v) if v >= 0 else "none"
    return str(v)


class Check:
    """One all-reduce (MAX) of a signature vector and its result: a slot of the ring that every
    collective's check takes its turn on (see Agreement). A persistent request where the MPI
    library has them (MPI-4), else a non-blocking all-reduce started afresh at each use."""

    __slots__ = ("_mpi", "busy", "held", "mine", "request", "result")

    def __init__(self, mpi: MPI.Intracomm, persistent: bool) -> None:
        width = 2 * len(FIELDS)
        self.mine = np.zeros(width, np.int64)
        self.result = np.zeros(width, np.int64)
        self._mpi = None if persistent else mpi
        self.request: MPI.Request = (
            mpi.Allreduce_init(self.mine, self.result, MPI.MAX) if persistent else MPI.REQUEST_NULL
        )
        self.held: np.ndarray | None = None  # the signature `mine` holds a copy of
        self.busy = False  # started, and its result not yet read

    def load(self, vec: np.ndarray) -> None:
        """Put `vec` in the send vector (skipped when it holds that signature already)."""
        if self.held is not vec:
            self.mine[:] = vec
            self.held = vec

    def start(self) -> MPI.Request:
        """Start the check; returns its request (to Test)."""
        mpi = self._mpi
        if mpi is None:
            self.request.Start()  # type: ignore[attr-defined]
        else:
            self.request = mpi.Iallreduce(self.mine, self.result, MPI.MAX)
        self.busy = True
        return self.request

    def agreed(self) -> bool:
        """After completion: whether every rank sent the vector this rank sent."""
        self.busy = False
        return bool(self.result.tobytes() == self.mine.tobytes())

    def free(self) -> None:
        """Free a persistent request that is not in flight."""
        if self._mpi is None and not self.busy:
            self.request.Free()


class Agreement:
    """The check and the arrivals table of one communicator (see the module's docstring).

    Collective number n is checked on slot n % RING of a ring of persistent requests, whether
    the call is blocking or asynchronous: a persistent collective matches only the same request
    on the other ranks, and ranks may call one collective in different forms (one blocking,
    another asynchronous), so the request a check uses depends on its number alone. A slot is
    free again once its previous check's result has been read; an asynchronous caller more
    than RING collectives ahead of its reads waits for that first.
    """

    RING = 256

    def __init__(self, mpi_comm: MPI.Intracomm, enabled: bool, with_sequence: bool) -> None:
        from .transports.mpi.persistent import unavailable

        self.enabled = enabled
        # the MPI library is the same on every rank, so is this
        self._persistent = unavailable() is None
        self.with_sequence = with_sequence
        self.mpi: MPI.Intracomm = mpi_comm.Dup()  # its own message space
        self.rank, self.size = self.mpi.Get_rank(), self.mpi.Get_size()
        self._ring: list[Check | None] = [None] * self.RING
        self.arrivals = Arrivals(self.mpi)

    def slot(self, seq: int) -> Check:
        """The check slot of collective `seq`, made (collectively, in number order on every
        rank) at its first use."""
        i = seq % self.RING
        check = self._ring[i]
        if check is None:
            check = self._ring[i] = Check(self.mpi, self._persistent)
        return check

    def mismatch(
        self, group: str, seq: int, mine: np.ndarray, wait: Callable[[MPI.Request], None]
    ) -> MismatchError:
        """The error every rank raises after a check that disagreed: gathers each rank's
        signature (every rank takes this path, since every rank saw the same result), waiting
        with `wait` (bounded)."""
        every = np.empty((self.size, len(mine)), np.int64)
        wait(self.mpi.Iallgather(mine, every))
        diffs = differences(every)
        return MismatchError(
            f"group '{group}' collective #{seq}: the ranks called different operations or the "
            "same one with different arguments, so nothing was moved; " + "; ".join(diffs)
        )

    def close(self, free: bool) -> None:
        """Unmap the arrivals table; with `free`, also free the check's request and communicator."""
        self.arrivals.close()
        if free:
            for check in self._ring:
                if check is not None:
                    check.free()
            self.mpi.Free()
        self._ring = [None] * self.RING


class Arrivals:
    """Each rank's latest entered collective, in shared memory among the ranks of one host,
    beside each rank's process id: a rank that died inside an operation had arrived, and is
    named by its process being gone."""

    def __init__(self, mpi_comm: MPI.Intracomm) -> None:
        rank, size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        local: Any = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        try:
            self.local_ranks: list[int] = local.allgather(rank)
            self._map, shared = _shared_table(local, rank, size)
        finally:
            local.Free()
        self.rank = rank
        self.table, self._pids = shared[:size], shared[size:]
        self.table[rank] = 0
        # a process id says whether a rank lives only where every local rank's can be seen
        # (ranks of one host may still sit in different pid namespaces)
        self._pids_seen = all(_alive(int(self._pids[r])) for r in self.local_ranks)

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
        return [r for r in self.local_ranks if not _alive(int(self._pids[r]))]

    def close(self) -> None:
        """Unmap the shared table (a view still alive keeps it mapped until exit)."""
        if self._map is not None:
            self.table = np.zeros(len(self.table), np.int64)
            self._pids = np.zeros(len(self.table), np.int64)
            self._pids_seen = False
            # a view of it still alive somewhere keeps it mapped: the OS frees it at exit
            with contextlib.suppress(BufferError):
                self._map.close()
            self._map = None


def _alive(pid: int) -> bool:
    """Whether process `pid` exists (signal 0 checks without sending anything)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by someone else
        return True
    return True


def _shared_table(
    local: MPI.Intracomm, rank: int, size: int
) -> tuple[mmap.mmap | None, np.ndarray]:
    """An int64 table of 2 * `size` entries (sequence numbers, then process ids, which each
    rank `rank` writes before the others read) shared by the ranks of `local`, made by its first
    rank and unlinked as soon as every rank has mapped it (nothing is left behind, even after a
    crash); a private table where shared memory cannot be had (every rank learns that alike)."""
    nbytes = 16 * size
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


def describe_late(late: Sequence[int], unknown: Sequence[int]) -> str:
    """'ranks not arrived: [2]' (+ the ranks that could not be read)."""
    text = f"ranks not arrived: {list(late)}"
    if unknown:
        text += f" (ranks {list(unknown)} are on other hosts and could not be read)"
    return text
