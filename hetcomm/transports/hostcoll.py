"""Small collectives among the ranks of one host, through one shared segment, on the calling thread.

The segment (hostseg.Segment) gives each rank a block of two halves and a counter to arrive
by. Every operation has the same shape. Each rank writes its input into its own block's half of
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

The segment is grown at the first operation that needs more (hostseg); where the group
cannot have one that large, run() declines and the transport takes its other path.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import HetcommError
from ..ops import ReduceOp
from . import flags
from .hostseg import LINE, MAX_BYTES, Dead, Late, Segment
from .local import combine_host, divide_host
from .spans import shards

__all__ = ["MAX_BYTES", "REDUNDANT_MAX", "Dead", "HostGroup", "Late", "Posted", "unavailable"]

if TYPE_CHECKING:
    from ..topology import Topology

# halves: their combine rounds to the half after each rank's value, which reduce_rows does not
_STEPWISE = frozenset(("float16", "bfloat16"))

# all-reduces and reduces up to this many bytes are reduced whole by every rank (one barrier);
# larger ones by shards (two barriers, and each rank reduces 1/n of the elements)
REDUNDANT_MAX = 32 << 10


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


class HostGroup(Segment):
    """The shared segment of one group's ranks on one host, and its collectives (see module).

    Operations take the segment in turns: `ticket()` is drawn on the thread that issues them,
    in the group's order of operations, and `run` waits until every earlier ticket's turn has
    ended on this rank, so that an operation running on a transport's thread and one running
    on the caller's never interleave (and all ranks run them in the same order).

    Host arrays here are flat uint8 views; reductions see them as `dtype` values.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Segment's arguments: the group's rank and size, its service communicator and tag,
        and what says the transport has closed."""
        super().__init__(*args, **kwargs)
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

    def holds(self, nbytes: int) -> bool:
        """Whether an operation of `nbytes` issued now runs in the segment as it is: it need
        not grow (the segment only grows), so run() will not decline it."""
        return self._seg is not None and self._broken is None and nbytes <= self.capacity

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
