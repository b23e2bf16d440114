"""Agreement across a group: each collective's signature compared before its bytes move, and
where every rank has got to, so that a wait that times out can name the ranks it waits for.

The check (on by default, `HETCOMM_CHECK=0` turns it off) compares a few integers per
collective, the signature's fields, across the group before the operation's first byte moves; a
difference raises MismatchError on every rank, naming each field that differs and each rank's
value, and leaves every buffer as it was. It takes one of two forms, the same on every rank:

- Where every rank is on one host (shared memory that orders stores, see transports/flags.py),
  each rank writes its signature into its own record of a shared segment, then its sequence
  number beside it, and reads the others' records once their numbers say they have written: no
  message at all, so the check costs a few reads and writes (about 1 us) rather than an MPI
  all-reduce (2-3 us on 2 ranks of one host, more with more ranks).
- Otherwise one MPI all-reduce (MAX) on a communicator of its own, of the fields and their
  negations, so that the result equals the vector a rank sent exactly when every rank sent the
  same one. Blocking calls use a persistent request; asynchronous ones a non-blocking
  all-reduce whose completion starts the operation (see Communicator).

In both, every rank sees a difference if any rank does, and then every rank gathers the
signatures to name it.

The arrivals table (hetcomm.arrivals) says where every rank has got to; its shared segment
holds the shared form's records.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
from mpi4py import MPI

from .arrivals import LINE, Arrivals
from .dtypes import CODES, DTYPES
from .errors import MismatchError
from .ops import ReduceOp
from .plan import OPS
from .transports import flags

# the plan's operations, and all_reduce_coalesced where a shared GPU's leader reduces the
# arrays one by one (direct): its "root" field holds how many arrays each rank gives, since
# the leader reads that many records of every rank
SIGNED = (*OPS, "all_reduce_coalesced")
_OP_CODES = {name: i + 1 for i, name in enumerate(SIGNED)}
_ARRAYS = _OP_CODES["all_reduce_coalesced"]
_DTYPE_CODES = {name: code + 1 for name, code in CODES.items()}  # 0: no dtype
_REDOP_CODES = {op: i + 1 for i, op in enumerate(ReduceOp)}
_REDOPS = {i + 1: op.name for i, op in enumerate(ReduceOp)}
# the fields of a signature, in the order they travel
FIELDS = ("operation", "dtype", "count", "reduce op", "root", "sequence")
_WIDTH = 8 * len(FIELDS)  # bytes of a signature's fields
_HEAD_BYTES = _WIDTH + 8  # the fields and the flag word of a shared record
_FLAG = len(FIELDS) + 1  # the flag word's index in a record
_CARRIED, _NOT_CARRIED = np.int64(1).tobytes(), np.int64(0).tobytes()


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


def refused(op: str) -> np.ndarray:
    """The signature of collective `op` refused on this rank before it entered (its
    arguments were invalid): it takes the collective's turn in the check, so that ranks that
    made the call validly see a difference instead of waiting for this rank."""
    f = (len(SIGNED) + _OP_CODES[op], 0, 0, 0, -1, 0)
    return np.array([*f, *(-v for v in f)], dtype=np.int64)


def differences(every: np.ndarray) -> list[str]:
    """'count differs: rank 0: 1024, rank 1: 2048' for each field that is not the same on every
    rank of `every` (one signature per row, as `signature` makes them); where ranks refused
    the call, that alone."""
    ops = every[:, 0]
    refusing = [r for r, v in enumerate(ops) if v > len(SIGNED)]
    if refusing:
        op = SIGNED[int(ops[refusing[0]]) - len(SIGNED) - 1]
        return [
            f"ranks {refusing} refused their {op} (invalid arguments: each raised "
            "InvalidArgument saying why)"
        ]
    out = []
    arrays = bool((ops == _ARRAYS).all())
    for col, field in enumerate(FIELDS):
        values = every[:, col]
        if (values == values[0]).all():
            continue
        if field == "root" and arrays:
            field = "arrays"
        shown = [_show(field, int(v)) for v in values]
        out.append(f"{field} differs: " + ", ".join(f"rank {r}: {v}" for r, v in enumerate(shown)))
    return out


def _show(field: str, v: int) -> str:
    if field == "operation":
        return SIGNED[v - 1] if v > 0 else "?"
    if field == "dtype":
        return DTYPES[v - 1] if v > 0 else "none"
    if field == "reduce op":
        return _REDOPS.get(v, "none")
    if field == "root":
        return str(v) if v >= 0 else "none"
    return str(v)


class _Slot:
    """What both kinds of check slot share: `mine` (this rank's signature) and `busy`."""

    __slots__ = ("busy", "mine")
    busy: bool  # started, and its result not yet read
    mine: np.ndarray

    def mismatched(self) -> np.ndarray:
        """After agreed() said no: this rank's signature, copied before the slot is free (the
        issuing thread loads the next collective's signature into a free slot, perhaps while
        another thread, the deferred starts', reports this mismatch)."""
        mine = self.mine.copy()
        self.busy = False
        return mine


class Check(_Slot):
    """One all-reduce (MAX) of a signature vector and its result: a slot of the ring that every
    collective's check takes its turn on (see Agreement). A persistent request where the MPI
    library has them (MPI-4), else a non-blocking all-reduce started afresh at each use."""

    __slots__ = ("_mpi", "held", "request", "result")

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

    def start(self, seq: int) -> MPI.Request:
        """Start the check of collective `seq`; returns its request (to Test)."""
        mpi = self._mpi
        if mpi is None:
            self.request.Start()  # type: ignore[attr-defined]
        else:
            self.request = mpi.Iallreduce(self.mine, self.result, MPI.MAX)
        self.busy = True
        return self.request

    def quick(self, seq: int, carry: None = None) -> bool:
        """start(seq), then one Test: whether the check is already complete (nothing is
        carried in this form)."""
        return bool(self.start(seq).Test())

    def agreed(self) -> bool:
        """After completion: whether every rank sent the vector this rank sent. The slot is
        free again once it has (busy, read by the thread that issues the next collective),
        after a mismatch once `mismatched()` has copied this rank's signature out."""
        same = self.result.tobytes() == self.mine.tobytes()
        self.busy = not same
        return same

    def free(self) -> None:
        """Free a persistent request that is not in flight."""
        if self._mpi is None and not self.busy:
            self.request.Free()


class SharedCheck(_Slot):
    """A check slot through shared memory (see the module's docstring), with Check's interface:
    `start(seq)` writes this rank's record of collective `seq`, and `Test()` is True once every
    rank's record holds collective `seq`, when `agreed()` says whether they all match.

    A record may also carry the data of a small rooted collective (`start(seq, carry=...)`,
    see hetcomm.carried): its flag word says whether this rank takes that path, and its
    payload holds this rank's input where the operation needs it from this rank.

    Collective seq uses record seq % records.ring. A rank writes a record again (for
    collective seq + ring) only once every other rank has read it (each rank's `done` word: the
    latest collective whose records it has read; a carried collective's records are read once
    it has landed), so a record is never overwritten while read; and where it carried data in
    it, only once it has read it itself (its own row is one of those a carried collective
    lands from, and an asynchronous call writes its record before the earlier ones land).
    """

    __slots__ = (
        "_agreed",
        "_block",
        "_block_key",
        "_carried",
        "_carry",
        "_complete",
        "_done",
        "_fields",
        "_flagged",
        "_flags",
        "_headers",
        "_i",
        "_mine_at",
        "_other_fields",
        "_other_tags",
        "_others_done",
        "_payload_at",
        "_plain",
        "_q",
        "_raw",
        "_records",
        "_rows",
        "_segment",
        "_seq",
        "_tag",
        "_written",
        "held",
        "request",
    )

    def __init__(self, records: SharedRecords, i: int) -> None:
        self.mine = np.zeros(2 * len(FIELDS), np.int64)
        self.held: np.ndarray | None = None
        self.busy = False
        self.request = self  # Test() is this slot's own
        self._records = records
        self._raw, self._q, self._segment = records.raw, records.words, records.segment
        rank, at, i = records.rank, records.record, i % records.ring
        self._i = i
        self._tag = at(rank, i)  # this rank's record: its sequence word, then its fields
        self._mine_at = 8 * self._tag + 8
        others = [q for q in range(records.size) if q != rank]
        # each other rank's record: its sequence word, where its fields start in the segment,
        # its flag word
        self._other_tags = tuple(at(q, i) for q in others)
        self._other_fields = tuple(records.start + 8 * at(q, i) + 8 for q in others)
        self._flags = tuple(at(q, i) + _FLAG for q in others)
        # what this rank's record i holds (several slots of the Agreement's ring share it)
        self._headers = records.headers
        # where each rank's payload starts in the segment (rank 0's: the first of rows())
        self._payload_at = [
            records.start + 8 * at(q, i) + records.HEAD for q in range(records.size)
        ]
        self._rows: np.ndarray | None = None
        self._block: np.ndarray | None = None
        self._block_key: tuple[np.dtype, int, int, int] | None = None
        self._done = records.done(rank)
        self._others_done = [records.done(q) for q in others]
        # the fields, and the header written: the fields and the flag word (0 or 1)
        self._fields = self._plain = self._flagged = b""
        self._carry: Any = None  # what this rank's record carries: None, False or an array
        self._seq = 0
        self._written = self._complete = self._agreed = self._carried = False

    def load(self, vec: np.ndarray) -> None:
        """Put `vec` in the signature (skipped when it holds that signature already)."""
        if self.held is not vec:
            self.mine[:] = vec
            fields = vec[: len(FIELDS)].tobytes()
            self._fields = fields
            self._plain, self._flagged = fields + _NOT_CARRIED, fields + _CARRIED
            self.held = vec

    def start(self, seq: int, carry: Any = None) -> SharedCheck:
        """Start the check of collective `seq`; returns itself (to Test). `carry`: None for a
        collective that does not take the carried path here; else False (this rank takes it
        and carries no data) or the contiguous host array whose bytes this rank carries."""
        self._seq, self._carry = seq, carry
        self._carried = carry is not None  # this rank's part, until Test reads the others'
        self._written = self._complete = False
        self.busy = True
        self._write()
        return self

    def quick(self, seq: int, carry: Any = None) -> bool:
        """start(seq, carry), then one Test: whether the check is already complete. The
        common case (nothing carried, the record free) inline: a check costs a few of these
        steps, and each step more is tens of nanoseconds, a method call a tenth of a
        microsecond."""
        records = self._records
        if carry is not None or records.others_done < seq - records.ring:
            return self.start(seq, carry)._written and self.Test()
        self._seq = seq
        self.busy = True
        q = self._q
        plain = self._plain
        headers, i = self._headers, self._i
        if headers[i] is not plain:  # the record holds another signature's header
            at = self._mine_at
            self._raw[at : at + _HEAD_BYTES] = plain
            headers[i] = plain
        q[self._tag] = seq  # after the rest: a reader that sees it sees them
        self._written = True
        for tag in self._other_tags:
            if q[tag] != seq:
                self._carried = self._complete = False
                return False
        self._carried = False
        self._finish(q, seq)
        return True

    def _write(self) -> bool:
        q, records = self._q, self._records
        oldest = self._seq - records.ring  # the collective this record held before
        if records.others_done < oldest:
            # read the others' done words only when the latest reading is not enough (they
            # sit on lines the others write to: reading them at every check would cost a
            # transfer between cores each time)
            records.others_done = min(q[done] for done in self._others_done)
            if records.others_done < oldest:
                self._idle()
                return False  # a rank has not read this record's previous contents yet
        if q[self._done] < oldest:
            before = self._headers[self._i]
            if before is not None and before[-8:] == _CARRIED:
                # the previous collective carried this rank's data, and has not landed here
                self._idle()
                return False
        raw, carry = self._raw, self._carry
        if carry is not None and carry is not False:
            at = self._payload_at[records.rank] - records.start  # in `raw`
            data = memoryview(carry).cast("B")
            raw[at : at + len(data)] = data
        at = self._mine_at
        header = self._plain if carry is None else self._flagged
        raw[at : at + _HEAD_BYTES] = header
        self._headers[self._i] = header
        q[self._tag] = self._seq  # after the rest: a reader that sees it sees them
        self._written = True
        self._carry = None  # not kept past the write
        return True

    def Test(self) -> bool:
        """Whether every rank's record holds this collective (MPI.Request's name, which
        callers use); once it does, agreed() and carried() say what they hold."""
        if self._complete:
            return True
        if not self._written and not self._write():
            return False
        q, seq = self._q, self._seq
        for tag in self._other_tags:
            if q[tag] != seq:
                self._idle()
                return False
        self._finish(q, seq)
        return True

    def _finish(self, q: memoryview, seq: int) -> None:
        """Every record holds collective `seq`: compare them, and note this rank has read
        them. Slices of the mmap are bytes (one compare each, in C); the flag word after the
        fields says whether every rank takes the carried path."""
        segment, mine, width = self._segment, self._fields, _WIDTH
        agreed = True
        for at in self._other_fields:
            if segment[at : at + width] != mine:
                agreed = False
        if self._carried:
            for flag in self._flags:
                if q[flag] != 1:
                    self._carried = False
        self._agreed = agreed
        if not (self._carried and agreed) and q[self._done] < seq:
            q[self._done] = seq  # (a carried collective's: once landed)
        self._complete = True

    def _idle(self) -> None:
        """A Test that found the check not complete: every 64th, a call into MPI (an Iprobe,
        0.5-1 us: often enough for progress, rarely enough not to slow an ordinary wait). MPI
        moves non-blocking operations only inside its calls, and an asynchronous collective
        that this rank started (on the mpi transport, say) may be what another rank waits for
        before it writes its record here; the MPI form of the check made that call itself."""
        records = self._records
        records.idle += 1
        if not records.idle & 63:
            records.progress()

    def agreed(self) -> bool:
        """After completion: whether every rank wrote the signature this rank wrote (the slot
        free again as Check.agreed says)."""
        self.busy = not self._agreed
        return self._agreed

    def carried(self) -> bool:
        """After completion: whether every rank took the carried path."""
        return self._carried

    def landed(self) -> None:
        """A carried collective has landed what it needs from the records (right after its
        completion, on the thread that saw it): the others may write theirs again."""
        q, seq = self._q, self._seq
        if q[self._done] < seq:
            q[self._done] = seq

    def payload(self, rank: int, nbytes: int) -> bytes:
        """After completion: the first `nbytes` bytes `rank` carried (a copy)."""
        at = self._payload_at[rank]
        return self._segment[at : at + nbytes]

    def rows(self, dtype: np.dtype, count: int) -> np.ndarray:
        """After completion: every rank's carried `count` values of `dtype`, one row per rank
        (a view of the segment: records of one slot lie one rank's ring apart), kept for the
        next call of the same shape (the slot goes with the communicator)."""
        kept = self._rows
        if kept is not None and kept.dtype == dtype and kept.shape[1] == count:
            return kept
        records = self._records
        self._rows = rows = np.ndarray(
            (records.size, count),
            dtype,
            buffer=self._segment,
            offset=self._payload_at[0],
            strides=(records.ring * records.RECORD, dtype.itemsize),
        )
        return rows

    def block(self, dtype: np.dtype, count: int, start: int, stop: int) -> np.ndarray:
        """After completion: columns [start, stop) of `rows(dtype, count)` (every rank's block
        of its carried input), kept for the next call alike as rows are."""
        key = (dtype, count, start, stop)
        if self._block_key != key or self._block is None:
            self._block = self.rows(dtype, count)[:, start:stop]
            self._block_key = key
        return self._block

    def free(self) -> None:
        """Nothing to free: the records go with the arrivals table."""


class SharedRecords:
    """The check's part of the arrivals segment: per rank, `ring` records, each a header line
    (the sequence word, the signature's fields, the flag word) and PAYLOAD bytes, then a
    `done` word per rank on a line of its own."""

    LINE = LINE  # bytes: a cache line (the records start on one: arrivals.LINE)
    HEAD = LINE  # a record's header
    PAYLOAD = 256  # bytes a record carries: rooted collectives up to this size ride in it
    RECORD = HEAD + PAYLOAD

    def __init__(self, segment: mmap.mmap, start: int, rank: int, size: int, ring: int) -> None:
        self.segment, self.start = segment, start
        self.raw = memoryview(segment)[start : start + self.nbytes(size, ring)]
        self.words = self.raw.cast("q")
        self.rank, self.size, self.ring = rank, size, ring
        self.others_done = 0  # the least done word of the other ranks, as last read
        # the header bytes this rank last wrote into each of its records (None: not yet): a
        # record that holds the header a check would write is not written again
        self.headers: list[bytes | None] = [None] * ring
        # a call into MPI that lets it progress (set by Agreement), and Tests that found a
        # check not complete
        self.progress: Callable[[], Any] = lambda: None
        self.idle = 0

    @classmethod
    def nbytes(cls, size: int, ring: int) -> int:
        """The bytes of the records and done words of `size` ranks."""
        return size * (ring * cls.RECORD + cls.LINE)

    def record(self, rank: int, i: int) -> int:
        """The index (in words) of `rank`'s record `i`."""
        return (rank * self.ring + i) * (self.RECORD // 8)

    def done(self, rank: int) -> int:
        """The index (in words) of `rank`'s done word."""
        return (self.size * self.ring * self.RECORD + rank * self.LINE) // 8

    def release(self) -> None:
        """Let go of the views of the segment (before it is unmapped)."""
        self.words.release()
        self.raw.release()


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
    # records of the shared form: checks that may be in flight before a rank waits for the
    # others to read its oldest (64 x 320 bytes per rank)
    SHARED_RING = 64

    def __init__(
        self,
        mpi_comm: MPI.Intracomm,
        enabled: bool,
        with_sequence: bool,
        one_host: bool,
        lanes: int = 0,
    ) -> None:
        """`one_host`: whether the topology puts every rank on one host (the same on every
        rank); the check then goes through shared memory where the ranks really share it.
        `lanes`: the bytes of the direct transport's mailbox to keep in the arrivals segment
        (Arrivals.lanes)."""
        from .transports.mpi.persistent import unavailable

        self.enabled = enabled
        # the MPI library is the same on every rank, so is this
        self._persistent = unavailable() is None
        self.with_sequence = with_sequence
        self.mpi: MPI.Intracomm = mpi_comm.Dup()  # its own message space
        self.rank, self.size = self.mpi.Get_rank(), self.mpi.Get_size()
        self.ring: list[Check | SharedCheck | None] = [None] * self.RING
        shared = enabled and one_host and self.size > 1 and flags.unsupported() is None
        ring = self.SHARED_RING if shared else 0
        self.arrivals = arrivals = Arrivals(
            self.mpi, SharedRecords.nbytes(self.size, ring) if ring else 0, lanes
        )
        self.records: SharedRecords | None = None
        if ring and arrivals.segment is not None:
            self.records = SharedRecords(
                arrivals.segment, arrivals.records_at, self.rank, self.size, ring
            )
        if self.records is not None:
            self.records.progress = partial(self.mpi.Iprobe, MPI.ANY_SOURCE, MPI.ANY_TAG)
        # the form the check takes, the same on every rank
        self.form = "shared memory" if self.records is not None else "MPI all-reduce"
        # more of the group's ranks on this host than it has cores: a rank waiting for the
        # others must give up its core between looks, since the rank it waits for may need
        # that very core (Open MPI yields when idle on such a host for the same reason)
        self.crowded = len(self.arrivals.local_ranks) > (os.cpu_count() or 1)

    def slot(self, seq: int) -> Check | SharedCheck:
        """The check slot of collective `seq`, made (collectively, in number order on every
        rank) at its first use."""
        i = seq % self.RING
        check = self.ring[i]
        if check is None:
            records = self.records
            check = self.ring[i] = (
                Check(self.mpi, self._persistent) if records is None else SharedCheck(records, i)
            )
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
        if free:
            for check in self.ring:
                if check is not None:
                    check.free()
            self.mpi.Free()
        self.ring = [None] * self.RING
        if self.records is not None:
            self.records.release()
            self.records = None
        self.arrivals.close()
