"""Transports: one module each, the same shape, and the registry the plan chooses from."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from ..arrays import Buffer
    from ..comm import Communicator
    from ..ops import ReduceOp
    from ..topology import Topology
    from ..work import Work


class Transport:
    """The interface every transport implements; its docstrings are the contract.

    Buffers reaching a transport are validated and contiguous; the Communicator owns packing,
    sequence numbers and the plan. Each method starts the operation and returns its Work without
    waiting for it.
    """

    name: ClassVar[str] = "base"
    #: which memory it can move: "host", "device" (both for most)
    memory: ClassVar[tuple[str, ...]] = ()
    #: whether recv takes src=hetcomm.ANY_SOURCE: the mpi transport only, whose receives MPI
    #: matches; the others set up each transfer with a known peer before the first byte moves
    any_source: ClassVar[bool] = False

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm

    @classmethod
    def unavailable(cls, topology: Topology) -> str | None:
        """None when this transport can serve a group with these members, else the reason."""
        raise NotImplementedError

    def all_reduce(self, x: Buffer, out: Buffer, op: ReduceOp, seq: int) -> Work:
        """Reduce `x` of every rank into `out` of every rank (`out` may be `x`)."""
        raise NotImplementedError

    def reduce(self, x: Buffer, op: ReduceOp, root: int, seq: int) -> Work:
        """Reduce `x` of every rank into `x` of `root`; other ranks' `x` is left unchanged."""
        raise NotImplementedError

    def broadcast(self, x: Buffer, root: int, seq: int) -> Work:
        """Copy `x` of `root` into `x` of every rank."""
        raise NotImplementedError

    def all_gather(self, out: Buffer, x: Buffer, seq: int) -> Work:
        """Block i of `out` (size blocks the size of `x`) gets `x` of rank i."""
        raise NotImplementedError

    def reduce_scatter(self, out: Buffer, x: Buffer, op: ReduceOp, seq: int) -> Work:
        """Rank i's `out` gets the reduction of block i of every rank's `x`."""
        raise NotImplementedError

    def all_to_all(self, out: Buffer, x: Buffer, seq: int) -> Work:
        """Block j of `x` goes to rank j; block i of `out` comes from rank i."""
        raise NotImplementedError

    def send(self, x: Buffer, dst: int, tag: int, seq: int) -> Work:
        """Send `x` to rank `dst` with `tag`."""
        raise NotImplementedError

    def recv(self, x: Buffer, src: int, tag: int, seq: int) -> Work:
        """Receive into `x` from rank `src` (ANY_SOURCE where `any_source`) with `tag`; the
        Work's `source` is the sender's rank once it completes."""
        raise NotImplementedError

    def barrier(self, seq: int) -> Work:
        """Complete once every rank has entered the barrier."""
        raise NotImplementedError

    def drain(self, op: str, seq: int) -> None:
        """Return once every MPI call the transport queued on the communicator's own MPI
        communicator has been made (nothing is queued by default), so that a call the
        communicator makes there itself (`op`: split, dup, a debug fingerprint) comes after
        them on every rank."""

    def close(self) -> None:
        """Release what the transport holds (nothing by default)."""


class Job:
    """A call queued on a transport's own thread; set once it has returned or raised.

    Completion is one lock, held from creation until `set`: a waiter blocks on it directly and
    wakes with one hand-off, where an Event's waiter also waits for the Event's own lock after
    being notified (measurable per call for collectives of a few hundred microseconds).
    """

    __slots__ = ("_done", "_lock", "call", "error")

    def __init__(self, call: Callable[[], Any]) -> None:
        self.call = call
        self.error: BaseException | None = None
        self._done = False
        self._lock = threading.Lock()
        self._lock.acquire()

    def run(self) -> None:
        """Make the call on the calling thread (the transport's), keep its error, then set."""
        self.call_only()
        self.set()

    def call_only(self) -> None:
        """Make the call and keep its error, without setting (the caller sets when ready)."""
        try:
            self.call()
        except BaseException as exc:
            self.error = exc

    def set(self) -> None:
        """Mark the job done and wake its waiters (call once, from the job's thread)."""
        if not self._done:
            self._done = True
            self._lock.release()

    def is_set(self) -> bool:
        return self._done

    def wait(self, timeout: float | None = None) -> bool:
        """Block until done or `timeout` seconds have passed; whether it is done."""
        if self._done:
            return True
        if self._lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            self._lock.release()  # let the next waiter through
        return self._done

    def check(self) -> None:
        """Raise the error the call ended with, if any (on the waiting thread)."""
        if self.error is not None:
            raise self.error


def registry() -> dict[str, type[Transport]]:
    """Transport name -> class, for the transports this installation has."""
    from .direct import DirectTransport
    from .hier import HierTransport
    from .mpi import MpiTransport
    from .nccl import NcclTransport
    from .staged import StagedTransport

    found: list[type[Transport]] = [
        DirectTransport,
        HierTransport,
        MpiTransport,
        NcclTransport,
        StagedTransport,
    ]
    return {cls.name: cls for cls in found}
