"""Cached MPI-4 persistent collectives: the small collectives of the mpi transport.

Open MPI builds the schedule of a non-blocking collective on every call; a persistent request
builds it once, at its init, and each Start only runs it. A 2-rank all-reduce of 8 bytes on one
host took 2.6-2.9 us as Iallreduce + Test polls and 1.1 us as Start + Test polls (Open MPI 5.0);
a hetcomm broadcast of 8 bytes 2.6-2.9 us with Ibcast, 1.8-2.2 us with a persistent Bcast
(2026-12-04).

MPI's rules shape the cache. Persistent collective inits and starts must come in the same order
on every rank, and a persistent collective matches only the same persistent collective on the
other ranks, never a non-blocking or a blocking one. So whether a collective goes this way
depends only on what every rank must agree on anyway (the op, dtype, element count, reduction,
root, and the byte limit of the configuration: a `Recipe`), never on this rank's buffer
address, layout, in-place or not, or the state of the lane; and each request is bound to
scratch arrays of the cache, not to the caller's arrays (whose addresses change from call to
call): the data is copied in and out. The cache's inits, reuses and evictions follow the
sequence of calls, which is the same on every rank.

Open MPI numbers each persistent request at its init, and each non-blocking collective at its
call, from one counter per communicator; messages of two collectives are told apart by those
numbers. So a request is made where it is first started (on the calling thread, or on the lane
behind the lane's jobs), in issue order among the communicator's non-blocking calls.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import cache, partial
from typing import TYPE_CHECKING

import numpy as np
from mpi4py import MPI

from ...work import Work

if TYPE_CHECKING:
    from ..base import Context, Job

# persistent collectives kept per transport; beyond this the least recently used one is freed
CAPACITY = 64
# Tests of the request per poll of a call's Work (see Slot.poll)
_TESTS_PER_POLL = 8
# requests started and never seen complete (a wait that timed out or was interrupted): MPI may
# still write their scratch arrays, so requests and arrays stay referenced until the process ends
_STRANDED: list[Slot] = []


@cache
def unavailable() -> str | None:
    """None when this MPI library runs persistent all-reduces, else why not.

    Support is a property of the MPI library, the same on every rank, so one local try on
    COMM_SELF answers for every communicator without involving the other ranks.
    """
    if not hasattr(MPI.Intracomm, "Allreduce_init"):
        return f"mpi4py {_mpi4py_version()} has no Allreduce_init (mpi4py 4 or newer has)"
    buf = np.array([1.0, 2.0])
    try:
        request = MPI.COMM_SELF.Allreduce_init(MPI.IN_PLACE, buf, MPI.SUM)
        try:
            request.Start()
            request.Wait()
        finally:
            request.Free()
    except (NotImplementedError, MPI.Exception) as exc:
        why = str(exc) or type(exc).__name__  # mpi4py's NotImplementedError says nothing
        return f"this MPI library has no persistent collectives (MPI-4): {why}"
    if buf.tolist() != [1.0, 2.0]:
        return f"a persistent all-reduce on one rank changed its data: {buf.tolist()}"
    return None


# the persistent form of each collective the mpi transport runs so (mpi4py's names)
INITS = {
    "all_reduce": "Allreduce_init",
    "reduce": "Reduce_init",
    "broadcast": "Bcast_init",
    "all_gather": "Allgather_init",
    "reduce_scatter": "Reduce_scatter_block_init",
    "all_to_all": "Alltoall_init",
    "barrier": "Barrier_init",
}


@cache
def missing() -> frozenset[str]:
    """The collectives of INITS that this MPI library has no persistent form of: every one
    where `unavailable()` says why, else those whose init or start fails on COMM_SELF (a
    property of the library, the same on every rank)."""
    if unavailable() is not None:
        return frozenset(INITS)
    self_comm = MPI.COMM_SELF
    a, b = np.zeros(2), np.zeros(2)
    tries = {
        "all_reduce": lambda: self_comm.Allreduce_init(MPI.IN_PLACE, a, MPI.SUM),
        "reduce": lambda: self_comm.Reduce_init(MPI.IN_PLACE, a, MPI.SUM, 0),
        "broadcast": lambda: self_comm.Bcast_init(a, 0),
        "all_gather": lambda: self_comm.Allgather_init(a, b),
        "reduce_scatter": lambda: self_comm.Reduce_scatter_block_init(a, b, MPI.SUM),
        "all_to_all": lambda: self_comm.Alltoall_init(a, b),
        "barrier": lambda: self_comm.Barrier_init(),
    }
    lacking = set()
    for op, init in tries.items():
        try:
            request = init()
            try:
                request.Start()
                request.Wait()
            finally:
                request.Free()
        except (AttributeError, NotImplementedError, MPI.Exception):
            lacking.add(op)
    return frozenset(lacking)


def _mpi4py_version() -> str:
    import mpi4py

    return str(mpi4py.__version__)


class Kind:
    """What a persistent reduction reduces with: the numpy dtype of its scratch and the MPI
    datatype and operation. Each is made once, at import."""

    __slots__ = ("datatype", "dtype", "op")

    def __init__(self, dtype: np.dtype, datatype: MPI.Datatype, op: MPI.Op) -> None:
        self.dtype, self.datatype, self.op = dtype, datatype, op


Init = Callable[[MPI.Intracomm, np.ndarray, np.ndarray], MPI.Prequest]


class Recipe:
    """One persistent collective of a signature: `key`, what every rank agrees on (op, dtype,
    reduction, element count, root), and what its request is bound to and made by: `count_in`
    elements of `dtype` that the input is copied into, `count_out` more that the result is
    copied out of (None: the result lands in the input's scratch), and `init(mpi, scratch,
    out)`, which makes the request."""

    __slots__ = ("count_in", "count_out", "dtype", "init", "key", "op")

    def __init__(
        self,
        key: tuple,
        dtype: np.dtype,
        count_in: int,
        count_out: int | None,
        init: Init,
    ) -> None:
        self.key, self.op, self.dtype = key, key[0], dtype
        self.count_in, self.count_out, self.init = count_in, count_out, init


class Slot:
    """One persistent collective: its request, the scratch arrays it is bound to, its state.

    A call of the general path is numbered; its Work polls `poll(number)`, which copies the
    result out once the request completes. Another thread may poll an earlier call's Work at
    the same time (torch's progress thread does), so polls and the copy out hold `lock`, and a
    poll of a call already delivered returns at once without touching the request.
    """

    __slots__ = (
        "active",
        "deliver",
        "delivered",
        "job",
        "key",
        "lock",
        "mpi",
        "op",
        "out",
        "oview",
        "recipe",
        "request",
        "scratch",
        "seq",
        "started",
        "used",
        "view",
    )

    def __init__(self, recipe: Recipe, mpi: MPI.Intracomm) -> None:
        self.recipe, self.key, self.op, self.mpi = recipe, recipe.key, recipe.op, mpi
        self.scratch = np.zeros(recipe.count_in, recipe.dtype)
        count_out = recipe.count_out
        self.out = self.scratch if count_out is None else np.zeros(count_out, recipe.dtype)
        # made at the first start (see the module's docstring)
        self.request: MPI.Prequest | None = None
        self.used = 0  # the cache's clock at the latest use: the least recent goes first
        # the scratch and the result in the shapes of the latest caller's arrays: copies
        # between arrays of one shape are numpy's cheapest
        self.view = self.scratch
        self.oview = self.out
        # started (or queued on the lane to start) and its completion not yet seen: such a
        # request may be neither started again nor freed
        self.active = False
        self.lock = threading.Lock()
        # calls of the general path started and delivered (their result copied out); the one
        # in flight, if any, copies out with `deliver`, has sequence number `seq` and runs as
        # `job` on the lane (None: started from the caller's thread)
        self.started = 0
        self.delivered = 0
        self.deliver: Callable[[], None] | None = None
        self.seq = 0
        self.job: Job | None = None

    def make(self) -> MPI.Prequest:
        """The request, made now if not yet: call where it is about to be started."""
        request = self.request
        if request is None:
            request = self.request = self.recipe.init(self.mpi, self.scratch, self.out)
        return request

    def copy_in(self, x: np.ndarray) -> np.ndarray:
        """Copy `x` into the scratch; return the scratch view of x's shape (for the copy out).

        A numpy assignment between two arrays of one element count succeeds only when their
        shapes differ at most by leading 1s, where it is the plain element-by-element copy; any
        other shape gets a view of its own (the short path tries `view[...] = x` inline first).
        """
        view = self.view
        try:
            view[...] = x
        except ValueError:
            view = self.view = self.scratch.reshape(x.shape)
            view[...] = x
        return view

    def copy_out(self, o: np.ndarray) -> None:
        """Copy the result into `o` (of the result's element count), as copy_in does."""
        oview = self.oview
        try:
            o[...] = oview
        except ValueError:
            oview = self.oview = self.out.reshape(o.shape)
            o[...] = oview

    def begin(self, deliver: Callable[[], None] | None, seq: int) -> int:
        """Number a call of the general path that is about to start; the scratch holds its
        input, `deliver` copies its result out."""
        self.started += 1
        self.deliver, self.seq, self.job = deliver, seq, None
        self.active = True
        return self.started

    def poll(self, number: int) -> bool:
        """True once call `number` is complete and its result copied out."""
        if self.delivered >= number:
            return True
        lock = self.lock
        if not lock.acquire(False):
            return False  # another thread is polling this call, and delivers it when complete
        try:
            if self.delivered >= number:
                return True
            job = self.job
            if job is None:
                request = self.request
                assert request is not None, "started from this thread: made then"
                # a few Tests per poll: the schedule takes a few progress calls to complete,
                # each far cheaper than a round of the caller's wait loop
                polls = _TESTS_PER_POLL
                while not request.Test():
                    polls -= 1
                    if not polls:
                        return False
                self.active = False
            elif not job.is_set():
                return False
            else:
                job.check()
            deliver, self.deliver = self.deliver, None
            if deliver is not None:
                deliver()
            self.delivered = number
        finally:
            lock.release()
        return True

    def test(self) -> bool:
        """Test a request started by the short path (which copies its result out itself)."""
        if self.make().Test():
            self.active = False
            return True
        return False

    def run(self) -> None:
        """Start the request and wait for it (on the lane thread, as its blocking calls)."""
        request = self.make()
        request.Start()
        request.Wait()
        self.active = False


class Requests:
    """The persistent collectives of one transport's communicator, found by their recipe's key
    and evicted least recently used first."""

    def __init__(self, comm: Context, mpi: MPI.Intracomm, capacity: int = CAPACITY) -> None:
        self._comm = comm
        self._mpi = mpi
        self._capacity = capacity
        self._slots: dict[tuple, Slot] = {}
        # calls served so far (also the clock of the LRU order), slots made (each makes its
        # request at its first start), requests freed
        self.uses = 0
        self.made = 0
        self.freed = 0

    def __len__(self) -> int:
        return len(self._slots)

    def take(self, recipe: Recipe) -> Slot:
        """The request of `recipe`, free to start: made (evicting the least recently used one
        when full) on first use, after the previous call with it is delivered otherwise."""
        slot = self._slots.get(recipe.key)
        if slot is None or slot.active or slot.delivered < slot.started:
            slot = self._settle(recipe, slot)
        self.uses = slot.used = self.uses + 1
        return slot

    def _settle(self, recipe: Recipe, slot: Slot | None) -> Slot:
        if slot is not None and slot.delivered < slot.started:
            self._deliver(slot)
        if slot is not None and not slot.active:
            return slot
        if slot is not None:
            # started by the short path and given up on (a wait that timed out or was
            # interrupted, which leaves the communicator unusable anyway): never reused
            self._drop(slot)
            _STRANDED.append(slot)
        return self._add(recipe)

    def _deliver(self, slot: Slot) -> None:
        """Wait for the slot's call in flight and copy its result out. That call was issued
        before the present one on every rank, so it completes; the wait is bounded."""
        job = slot.job
        Work(
            self._comm,
            slot.op,
            slot.seq,
            partial(slot.poll, slot.started),
            waiter=None if job is None else job.wait,
        ).wait()

    def _drop(self, slot: Slot) -> None:
        del self._slots[slot.key]

    def _add(self, recipe: Recipe) -> Slot:
        if len(self._slots) >= self._capacity:
            self._evict()
        slot = self._slots[recipe.key] = Slot(recipe, self._mpi)
        self.made += 1
        return slot

    def _evict(self) -> None:
        """Free the least recently used request. Which one that is follows from the sequence
        of calls alone, so every rank evicts the same one."""
        old = min(self._slots.values(), key=_used)
        self._drop(old)
        try:
            if old.delivered < old.started:
                self._deliver(old)
        finally:
            self._free(old)

    def _free(self, slot: Slot) -> None:
        with slot.lock:
            if slot.active:
                _STRANDED.append(slot)
                return
            if slot.request is None:  # never started: nothing to free
                return
            slot.request.Free()
        self.freed += 1

    def close(self) -> None:
        """Free every request (one still active is kept, never freed: see _STRANDED)."""
        slots = list(self._slots.values())
        self._slots.clear()
        for slot in slots:
            self._free(slot)


def _used(slot: Slot) -> int:
    return slot.used
