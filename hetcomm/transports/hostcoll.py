"""Small collectives among the ranks of one host, through one shared segment, on the calling thread.

The segment is one /dev/shm file that every rank of the group maps: a header of one 64-byte
line per rank (its barrier counter, whether it has mapped this segment, its pid and the start
time of its process), then one block per rank, each of two halves of `capacity` bytes that
start on cache lines. A rank writes only its own header line, so a counter has one writer.

Every operation has the same shape. Each rank writes its input into its own block's half of
this operation (operations alternate between the two halves), then *arrives* (bumps its
counter) and waits until every rank has arrived: every input is in place, and every rank has
left the previous operation. Then each rank reads what it needs of the others' halves and
writes its result into its own memory. The two halves make this safe without a second
barrier: a rank writes a half again two operations later, after it has seen every rank
arrive at the operation in between, which each did only once done with this one.

Reductions give every rank the same bits: every element is reduced in rank order (rank 0's
value, then rank 1's, ...). Small ones are reduced whole by every rank (the same computation,
so the same bits, with one barrier); larger ones (`REDUNDANT_MAX`) by shards, each reduced by
one rank and written into that shard of its own half, then a second barrier, after which each
rank copies the other shards out of their reducers' halves.

Waits yield, then nap (`flags.wait`), bounded by the operation's deadline; while
napping they look at the late ranks' processes (/proc), so that a rank that died is named
(`Dead`) long before the deadline, and a wait that runs out names the ranks that did not
arrive (`Late`). Transports turn these into CommTimeout and PeerLost.

The segment is made at the first operation that needs it and grown at the first that needs
more (every rank reaches both at the same operation: they take the segment in one order, and
an operation's size is the same on every rank, which the default check guarantees; ranks that
call with different sizes unchecked time out in the growth, naming the ranks that did not
map). Grown rather than made at its limit at once: halves of MAX_BYTES would reserve
2 x 16 MiB of /dev/shm per rank for every group, most of which only ever reduce a few bytes.
Rank 0 creates the file and sends its name over the group's service communicator; once every
rank has mapped it, each unlinks it, so nothing is left in /dev/shm when a process is killed
afterwards. Where rank 0 cannot reserve the memory, every rank learns so from the same
message, and operations of that size or more take the transport's other path from then on.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import processes
from ..errors import HetcommError
from ..ops import ReduceOp
from . import flags
from .local import combine_host, divide_host
from .shm import SegmentError, SharedSlots
from .spans import shards

if TYPE_CHECKING:
    from ..topology import Topology

# halves: their combine rounds to the half after each rank's value, which reduce_rows does not
_STEPWISE = frozenset(("float16", "bfloat16"))

log = logging.getLogger("hetcomm")

LINE = 64  # halves start on cache lines: no two ranks write one line
_WORDS = LINE // 8  # int64 words per rank's header line
_COUNT, _MAPPED, _PID, _START = 0, 1, 2, 3  # the words of a rank's header line
INITIAL_BYTES = 64 << 10  # the first segment's halves
MAX_BYTES = 16 << 20  # the largest operation the segment takes (its input, per rank)
# all-reduces and reduces up to this many bytes are reduced whole by every rank (one barrier);
# larger ones by shards (two barriers, and each rank reduces 1/n of the elements)
REDUNDANT_MAX = 32 << 10
_MESSAGE = 256  # bytes of the setup message: a segment's name, or "!" and why there is none


class Late(TimeoutError):
    """Ranks did not arrive before the deadline (`ranks`; empty where unknown)."""

    def __init__(self, ranks: list[int], text: str) -> None:
        super().__init__(text)
        self.ranks = ranks


class Dead(ConnectionError):
    """Ranks that the wait was for have no process any more (`ranks`)."""

    def __init__(self, ranks: list[int], text: str) -> None:
        super().__init__(text)
        self.ranks = ranks


def unavailable(topology: Topology) -> str | None:
    """Why a group with these members cannot share one segment, or None."""
    why = flags.unsupported()
    if why is not None:
        return why
    ranks = topology.ranks
    if len(ranks) < 2:
        return "a group of one rank"
    if len({(r.host, r.node) for r in ranks}) != 1:
        return "its ranks are on more than one host"
    return None


class HostGroup:
    """The shared segment of one group's ranks on one host, and its collectives (see module).

    Operations take the segment in turns: `ticket()` is drawn on the thread that issues them,
    in the group's order of operations, and `run` waits until every earlier ticket's turn has
    ended on this rank, so that an operation running on a transport's thread and one running
    on the caller's never interleave (and all ranks run them in the same order).

    Host arrays here are flat uint8 views; reductions see them as `dtype` values.
    """

    def __init__(
        self,
        rank: int,
        size: int,
        service: Any,
        tag: int,
        closed: Callable[[], bool] = lambda: False,
    ) -> None:
        self.rank, self.size = rank, size
        self._svc, self._tag, self._closed = service, tag, closed
        self._seg: SharedSlots | None = None
        self._hdr: memoryview | None = None  # int64 words of the header
        self._rows: tuple[np.ndarray, ...] = ()  # per parity: every rank's half, (size, capacity)
        self._pids: list[tuple[int, int]] = []  # (pid, start time) of every rank
        self._registered = -1  # the device the segment is registered with (-1: none)
        self.capacity = 0  # bytes of one half
        self.limit = MAX_BYTES  # the largest operation the segment may grow to take
        self._generation = 0
        self._count = 0  # arrivals so far (the same on every rank at the same point)
        self._ops = 0  # operations run in this segment: their parity picks the half
        self._me = rank * _WORDS
        self._others = [q * _WORDS for q in range(size) if q != rank]
        self._turns = threading.Condition()
        self._drawn = itertools.count(1)  # the tickets, from 1 (the first turn's)
        self._ended = 0  # the last ticket whose turn has ended
        self._waiting = 0  # threads waiting for their turn
        self._broken: BaseException | None = None
        self._posted: Posted | None = None  # an operation begun by start(), not ended yet
        self._spare = np.empty(0, np.uint8)  # _scratch's buffer
        # _reducer's work by (dtype, op value)
        self._reducers: dict[tuple[str, str], Callable[[np.ndarray, int, int], None]] = {}

    # ---- turns ----------------------------------------------------------------------------

    def ticket(self) -> int:
        """The next turn at the segment (draw it where the operation is issued, in order)."""
        return next(self._drawn)  # one C call: atomic under the interpreter lock

    def run(
        self, ticket: int, deadline: float, nbytes: int, fn: Callable[..., None], *args: Any
    ) -> bool:
        """In `ticket`'s turn: `fn(*args)` where the segment takes an operation of `nbytes`
        (grown first where needed); False, with nothing moved, where it does not (every rank
        says the same at the same turn)."""
        posted = self._posted
        if posted is not None and posted.ticket < ticket:
            posted.complete(deadline, raises=False)  # begun by start(): ended here, in turn
        if self._ended != ticket - 1:  # read unlocked: only this turn's end moves it on
            with self._turns:
                while self._ended != ticket - 1:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise Late([], "an earlier operation on the shared segment did not end")
                    self._waiting += 1
                    try:
                        self._turns.wait(left)
                    finally:
                        self._waiting -= 1
        try:
            if self._broken is not None:
                raise HetcommError(f"the shared segment failed earlier: {self._broken}")
            try:
                if (nbytes > self.capacity or self._seg is None) and not self._grow(
                    nbytes, deadline
                ):
                    return False
                fn(*args)
            except BaseException as exc:
                # the ranks are out of step in the segment now: later turns fail at once
                self._broken = exc
                raise
            return True
        finally:
            self._end_turn(ticket)

    def _end_turn(self, ticket: int) -> None:
        with self._turns:
            self._ended = ticket
            if self._waiting:
                self._turns.notify_all()

    def start(
        self,
        ticket: int,
        op: str,
        x: np.ndarray | None,
        out: np.ndarray | None,
        nbytes: int,
        dtype: str = "",
        rop: ReduceOp | None = None,
        root: int = -1,
    ) -> Posted | None:
        """Begin operation `ticket` (one of the collectives below, their arguments) on this
        thread without waiting, where it can: its turn has come (every earlier one has ended
        here), the segment takes it as it is, and it synchronises once (a reduction of at most
        REDUNDANT_MAX bytes, or any other). Its input is staged and this rank's arrival
        published here; the returned Posted ends it once every rank has arrived (its poll
        never blocks). None where it cannot: the caller then runs it through run(), which
        meets the other ranks in the segment alike. An operation begun so before it ends
        here first where every rank has arrived at it (a poll)."""
        posted = self._posted
        if posted is not None:
            try:
                if not posted.poll():
                    return None
            except BaseException:  # its own Work raises it; this one takes run()'s path
                return None
        if (
            self._ended != ticket - 1
            or self._broken is not None
            or self._seg is None
            or nbytes > self.capacity
        ):
            return None
        rest: Callable[[], None]
        if op in ("all_reduce", "reduce"):
            if nbytes > REDUNDANT_MAX:
                return None
            assert rop is not None
            if op == "reduce" and self.rank != root:
                rest = self._next
            else:
                assert out is not None
                rest = partial(self._reduced, out, nbytes, dtype, rop)
        elif op == "broadcast":
            x = x if self.rank == root else None
            rest = partial(self._broadcast_rest, out, nbytes, root)
        elif op == "all_gather":
            assert out is not None
            rest = partial(self._gathered, out, nbytes)
        elif op == "all_to_all":
            assert out is not None
            rest = partial(self._exchanged, out, nbytes)
        elif op == "reduce_scatter":
            assert out is not None and rop is not None
            rest = partial(self._scattered, out, nbytes, dtype, rop)
        else:
            return None
        self._stage(x)
        posted = self._posted = Posted(self, ticket, self._arrive(), rest)
        return posted

    def _arrived(self, k: int) -> bool:
        """Whether every other rank has arrived `k` times (one look)."""
        hdr = self._hdr
        if hdr is None:
            raise HetcommError("the shared segment was closed during a collective")
        # a loop, not all() over a generator: this runs at every poll of a spinning wait
        for i in self._others:  # noqa: SIM110
            if hdr[i] < k:
                return False
        return True

    # ---- the segment --------------------------------------------------------------------

    def _grow(self, nbytes: int, deadline: float) -> bool:
        """Replace the segment by one whose halves hold `nbytes` (collective); False where the
        group cannot have one that large (rank 0 could not reserve it), on every rank."""
        if nbytes > self.limit:
            return False
        capacity = min(self.limit, max(nbytes, 2 * self.capacity, INITIAL_BYTES))
        capacity = -(-capacity // LINE) * LINE
        header = self.size * LINE
        total = header + self.size * 2 * capacity
        self._generation += 1
        seg: SharedSlots | None = None
        try:
            seg, why = self._share(total, deadline)
            if seg is None:
                # every rank got the same message: larger operations go the other way
                self.limit = self.capacity
                log.warning(
                    "hostcoll: no shared segment of %d bytes (%s); operations over %d bytes "
                    "take the transport's other path",
                    total,
                    why,
                    self.limit,
                )
                return False
            hdr = seg.array[:header].data.cast("q")
            me = self._me
            hdr[me + _PID] = os.getpid()
            hdr[me + _START] = processes.start_time(os.getpid()) or 0
            hdr[me + _MAPPED] = 1
            mapped = [q * _WORDS + _MAPPED for q in range(self.size)]

            def ready() -> bool:
                return all(hdr[i] for i in mapped)

            if not flags.wait(ready, deadline, self._check_closed):
                late = [q for q in range(self.size) if not hdr[q * _WORDS + _MAPPED]]
                raise Late(late, f"ranks {late} did not map the shared segment")
        except BaseException:
            if seg is not None:
                seg.unlink()
                seg.close()
            raise
        seg.unlink()  # every rank has mapped it (or its name is gone already)
        self._close_segment()
        self._seg, self._hdr, self.capacity = seg, hdr, capacity
        # per parity, every rank's half as a row of one array (one reduction call reads them all)
        self._rows = tuple(
            np.lib.stride_tricks.as_strided(
                seg.array[header + h * capacity :], (self.size, capacity), (2 * capacity, 1)
            )
            for h in (0, 1)
        )
        self._pids = [
            (int(hdr[q * _WORDS + _PID]), int(hdr[q * _WORDS + _START])) for q in range(self.size)
        ]
        self._count = self._ops = 0
        return True

    def _share(self, total: int, deadline: float) -> tuple[SharedSlots | None, str]:
        """Rank 0 makes a segment of `total` bytes and sends its name to the others, who map
        it: (the segment, "") or (None, why rank 0 could not make it)."""
        svc, tag = self._svc, self._tag
        if self.rank == 0:
            name = f"hetcomm-hc-{os.getpid()}-{id(self) & 0xFFFFFF:x}-{self._generation}"
            seg: SharedSlots | None
            try:
                seg, message = SharedSlots(name, 1, total, create=True), name
            except SegmentError as exc:
                seg, message = None, "!" + str(exc)
            try:
                payload = np.frombuffer(
                    message.encode()[:_MESSAGE].ljust(_MESSAGE, b"\0"), np.uint8
                )
                sends = [svc.Isend(payload, dest=q, tag=tag) for q in range(1, self.size)]
                self._requests(
                    sends, list(range(1, self.size)), deadline, "take the segment's name"
                )
            except BaseException:
                if seg is not None:
                    seg.unlink()
                    seg.close()
                raise
            return seg, "" if seg is not None else message[1:]
        got = np.zeros(_MESSAGE, np.uint8)
        self._requests(
            [svc.Irecv(got, source=0, tag=tag)], [0], deadline, "send the segment's name"
        )
        message = bytes(got).rstrip(b"\0").decode()
        if message.startswith("!"):
            return None, message[1:]
        return SharedSlots(message, 1, total, create=False), ""

    def _requests(self, requests: list[Any], ranks: list[int], deadline: float, what: str) -> None:
        """Wait for MPI requests (one per rank of `ranks`) until `deadline`."""
        pause = 20e-6
        while True:
            done = [r.Test() for r in requests]
            if all(done):
                return
            self._check_closed()
            if time.monotonic() > deadline:
                if self.rank != 0:  # a receive left posted could take a later message
                    for r, ok in zip(requests, done, strict=True):
                        if not ok:
                            with contextlib.suppress(Exception):
                                r.Cancel()
                late = [q for q, ok in zip(ranks, done, strict=True) if not ok]
                raise Late(late, f"ranks {late} did not {what}")
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)

    def register_with_gpu(self, device: int) -> None:
        """Pin and map the segment for `device`'s copies (once per segment)."""
        assert self._seg is not None
        if self._registered != device:
            self._seg.register_with_gpu(device)
            self._registered = device

    def _close_segment(self) -> None:
        if self._seg is not None:
            self._rows = ()
            self._hdr = None
            self._seg.close()
            self._seg = None
        self._registered = -1

    def close(self) -> None:
        """Unmap the segment (local: a rank whose peers are gone still closes)."""
        self._close_segment()
        self.capacity = 0

    # ---- arrivals -----------------------------------------------------------------------

    def _check_closed(self) -> None:
        if self._closed():
            raise HetcommError("the transport was closed during a collective in shared memory")

    def _arrive(self) -> int:
        """Bump this rank's counter (after its writes): the arrival's number."""
        assert self._hdr is not None
        self._count = k = self._count + 1
        self._hdr[self._me] = k
        return k

    def _wait(self, k: int, deadline: float) -> None:
        """Until every rank has arrived `k` times."""
        if self._arrived(k):
            return
        hdr = self._hdr
        assert hdr is not None
        words = self._others
        ready = partial(self._arrived, k)

        def check() -> None:
            self._check_closed()
            late = [i // _WORDS for i in words if hdr[i] < k]
            dead = [q for q in late if processes.gone(*self._pids[q])]
            if dead:
                raise Dead(dead, f"ranks {dead} died (their processes are gone)")

        if not flags.wait(ready, deadline, check):
            late = [i // _WORDS for i in words if hdr[i] < k]
            raise Late(late, f"ranks {late} did not arrive in shared memory")

    def _barrier(self, deadline: float) -> None:
        self._wait(self._arrive(), deadline)

    def _half(self, q: int) -> np.ndarray:
        return self._rows[self._ops & 1][q]

    def holds(self, nbytes: int) -> bool:
        """Whether an operation of `nbytes` issued now runs in the segment as it is: it need
        not grow (the segment only grows), so run() will not decline it."""
        return self._seg is not None and self._broken is None and nbytes <= self.capacity

    def mine(self, nbytes: int) -> np.ndarray:
        """The first `nbytes` of this rank's half for the operation about to run: where a caller
        that stages its own input (a device copy) puts it before calling with x=None."""
        return self._half(self.rank)[:nbytes]

    def _stage(self, x: np.ndarray | None) -> None:
        if x is not None and x.nbytes:
            self._half(self.rank)[: x.nbytes] = x

    # ---- collectives (host memory; x=None: the input is in `mine()` already) ---------------

    def barrier(self, deadline: float) -> None:
        """Return once every rank has entered the barrier."""
        self._barrier(deadline)

    def all_reduce(
        self,
        x: np.ndarray | None,
        out: np.ndarray,
        nbytes: int,
        dtype: str,
        op: ReduceOp,
        deadline: float,
    ) -> None:
        """`out` = every rank's input reduced, in rank order (the same bits on every rank)."""
        self._stage(x)
        self._barrier(deadline)
        if nbytes <= REDUNDANT_MAX:
            self._reduced(out, nbytes, dtype, op)
            return
        # this rank's shard, reduced into its own output and published in its own half
        # (nobody else reads that shard of it); the others' shards read from their halves
        spans = self._shards(nbytes, dtype)
        lo, hi = spans[self.rank]
        if hi > lo:
            self._reduce_into(out[lo:hi], lo, hi, dtype, op)
            self._half(self.rank)[lo:hi] = out[lo:hi]
        self._barrier(deadline)
        self._collect(out, spans)
        self._ops += 1

    def reduce(
        self,
        x: np.ndarray | None,
        out: np.ndarray | None,
        nbytes: int,
        dtype: str,
        op: ReduceOp,
        root: int,
        deadline: float,
    ) -> None:
        """At `root`, `out` = every rank's input reduced in rank order; elsewhere nothing."""
        self._stage(x)
        self._barrier(deadline)
        at_root = self.rank == root
        if nbytes <= REDUNDANT_MAX:
            if at_root:
                assert out is not None
                self._reduced(out, nbytes, dtype, op)
            else:
                self._next()
            return
        spans = self._shards(nbytes, dtype)
        lo, hi = spans[self.rank]
        if hi > lo:
            if at_root:
                assert out is not None
                self._reduce_into(out[lo:hi], lo, hi, dtype, op)
            else:
                acc = self._scratch(hi - lo)
                self._reduce_into(acc, lo, hi, dtype, op)
                self._half(self.rank)[lo:hi] = acc
        k = self._arrive()
        if at_root:
            # only the root reads the others' shards: they go on without waiting
            self._wait(k, deadline)
            assert out is not None
            self._collect(out, spans)
        self._ops += 1

    def broadcast(
        self, x: np.ndarray | None, out: np.ndarray | None, nbytes: int, root: int, deadline: float
    ) -> None:
        """Every rank's `out` = the root's input (the root's `out` is not written)."""
        if self.rank == root:
            self._stage(x)
        self._barrier(deadline)
        self._broadcast_rest(out, nbytes, root)

    def all_gather(
        self, x: np.ndarray | None, out: np.ndarray, nbytes: int, deadline: float
    ) -> None:
        """Block q of `out` (blocks of `nbytes`) = rank q's input."""
        self._stage(x)
        self._barrier(deadline)
        self._gathered(out, nbytes)

    def all_to_all(
        self, x: np.ndarray | None, out: np.ndarray, nbytes: int, deadline: float
    ) -> None:
        """Block q of `out` = block `rank` of rank q's input (`size` blocks, `nbytes` in all)."""
        self._stage(x)
        self._barrier(deadline)
        self._exchanged(out, nbytes)

    def reduce_scatter(
        self,
        x: np.ndarray | None,
        out: np.ndarray,
        nbytes: int,
        dtype: str,
        op: ReduceOp,
        deadline: float,
    ) -> None:
        """`out` = block `rank` (of `size`, `nbytes` in all) of every input, reduced in rank
        order."""
        self._stage(x)
        self._barrier(deadline)
        self._scattered(out, nbytes, dtype, op)

    # ---- what each collective does once every rank has arrived (reads only, no waits) ----

    def _next(self) -> None:
        self._ops += 1

    def _reduced(self, out: np.ndarray, nbytes: int, dtype: str, op: ReduceOp) -> None:
        self._reduce_into(out, 0, nbytes, dtype, op)
        self._ops += 1

    def _broadcast_rest(self, out: np.ndarray | None, nbytes: int, root: int) -> None:
        if self.rank != root:
            assert out is not None
            np.copyto(out[:nbytes], self._half(root)[:nbytes])
        self._ops += 1

    def _gathered(self, out: np.ndarray, nbytes: int) -> None:
        for q in range(self.size):
            np.copyto(out[q * nbytes : (q + 1) * nbytes], self._half(q)[:nbytes])
        self._ops += 1

    def _exchanged(self, out: np.ndarray, nbytes: int) -> None:
        part, r = nbytes // self.size, self.rank
        for q in range(self.size):
            np.copyto(out[q * part : (q + 1) * part], self._half(q)[r * part : (r + 1) * part])
        self._ops += 1

    def _scattered(self, out: np.ndarray, nbytes: int, dtype: str, op: ReduceOp) -> None:
        part = nbytes // self.size
        self._reduce_into(out[:part], self.rank * part, (self.rank + 1) * part, dtype, op)
        self._ops += 1

    # ---- pieces -----------------------------------------------------------------------

    def _shards(self, nbytes: int, dtype: str) -> list[tuple[int, int]]:
        """Every rank's [lo, hi) bytes of an operation's `nbytes`: whole items, on lines."""
        from ..dtypes import TABLE

        itemsize = TABLE[dtype].itemsize
        spans = shards(nbytes // itemsize, itemsize, self.size, align=LINE)
        return [(a * itemsize, b * itemsize) for a, b in spans]

    def _collect(self, out: np.ndarray, spans: list[tuple[int, int]]) -> None:
        """The other ranks' reduced shards, from their halves into `out`."""
        for q, (lo, hi) in enumerate(spans):
            if q != self.rank and hi > lo:
                np.copyto(out[lo:hi], self._half(q)[lo:hi])

    def _scratch(self, nbytes: int) -> np.ndarray:
        """A private buffer of `nbytes`, kept for the next operation (no page faults each time)."""
        if self._spare.nbytes < nbytes:
            self._spare = np.empty(nbytes, np.uint8)
        return self._spare[:nbytes]

    def _reduce_into(self, dst: np.ndarray, lo: int, hi: int, dtype: str, op: ReduceOp) -> None:
        """dst = bytes [lo, hi) of every rank's half reduced in rank order (AVG divided)."""
        if hi > lo:
            (self._reducers.get((dtype, op._value_)) or self._reducer(dtype, op))(dst, lo, hi)

    def _reducer(self, dtype: str, op: ReduceOp) -> Callable[[np.ndarray, int, int], None]:
        """_reduce_into's work for (dtype, op), resolved at its first use: the storage dtype,
        the kernel and the steps, looked up once instead of at every small reduction."""
        from ..kernels import reduce

        storage = reduce.storage_dtype(dtype)
        average = op is ReduceOp.AVG
        size = self.size

        def stepwise(dst: np.ndarray, lo: int, hi: int) -> None:
            values = dst[: hi - lo].view(storage)
            np.copyto(values, self._half(0)[lo:hi].view(storage))
            for q in range(1, size):
                combine_host(values, self._half(q)[lo:hi].view(storage), dtype, op)
            if average:
                divide_host(values, size, dtype)

        reduce_rows, kind = reduce.reduce_rows, "sum" if average else op.value

        def rows(dst: np.ndarray, lo: int, hi: int) -> None:
            # one kernel call over the rows, where a combine per rank costs numpy's dispatch
            # and error-state switch each time (microseconds at small sizes)
            values = dst[: hi - lo].view(storage)
            reduce_rows(self._rows[self._ops & 1][:, lo:hi].view(storage), values, kind)
            if average:
                divide_host(values, size, dtype)

        run = stepwise if dtype in _STEPWISE else rows
        self._reducers[(dtype, op._value_)] = run
        return run


class Posted:
    """An operation HostGroup.start began on the issuing thread: its input staged and this
    rank's arrival published. It ends, once every rank has arrived, with its reads (`rest`)
    and the end of its turn, made by whichever thread gets there first: a poll (never
    blocks), a thread that waits for it (`complete`), or the next operation's turn."""

    __slots__ = ("_group", "_lock", "done", "error", "k", "rest", "ticket")

    def __init__(self, group: HostGroup, ticket: int, k: int, rest: Callable[[], None]) -> None:
        self._group, self.ticket, self.k, self.rest = group, ticket, k, rest
        self.done = False
        self.error: BaseException | None = None  # what its end failed with, raised to all
        self._lock = threading.Lock()

    def poll(self) -> bool:
        """True once ended (ending it here where every rank has arrived)."""
        if not self.done and self._group._arrived(self.k):
            self._end()
        if self.error is not None:
            raise self.error
        return self.done

    def complete(self, deadline: float, raises: bool = True) -> None:
        """End it on this thread, waiting (bounded) for the others to arrive (Late, Dead);
        raise what its end failed with where `raises` (its own Work's waiter does; the next
        operation's turn does not: that one fails as the segment is broken)."""
        if not self.done:
            self._group._wait(self.k, deadline)
            self._end()
        if raises and self.error is not None:
            raise self.error

    def _end(self) -> None:
        with self._lock:
            if self.done:
                return
            group = self._group
            try:
                if group._seg is None:
                    raise HetcommError("the shared segment was closed during a collective")
                self.rest()
            except BaseException as exc:
                self.error = group._broken = exc  # out of step, as run() says
            finally:
                self.done = True
                group._posted = None
                group._end_turn(self.ticket)
