"""The transport contract: the Transport base class, the narrow context a transport gets from
its communicator, optional capabilities, and the call queued on a transport's thread."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from ..work import Signal

if TYPE_CHECKING:
    from ..arrays import Buffer
    from ..config import Config
    from ..ops import ReduceOp
    from ..topology import Topology
    from ..transport_set import TransportSet
    from ..work import Work


class Context(Protocol):
    """What a transport may use of the communicator it serves, and nothing else.

    The Communicator passes itself (it satisfies this structurally); a transport never reaches
    past these names. Work handles a transport makes take the context as their owner.
    """

    #: the group's name, for errors and logs
    name: str
    rank: int
    size: int
    #: the group's own MPI communicator: the caller's message space (its send/recv tags)
    mpi: Any
    #: hetcomm's control communicator beside it: tags from transports/tags.py only
    service: Any
    config: Config
    #: the timeout of its own (`timeout=`) of the blocking call being issued, while its
    #: prepared call runs on the calling thread; None otherwise (the transport's own applies)
    call_timeout: float | None
    topology: Topology
    #: the group's mailbox (direct/mailbox.py): shared words every rank of the group maps,
    #: where every rank has a device on one host; None otherwise (on every rank alike)
    lanes: memoryview | None
    #: collectives issued so far, the same on every rank
    _seq: int
    #: the error the communicator was aborted with, None while it is usable
    _aborted: BaseException | None
    #: the group's transports, made on first use, and why each one cannot serve it: hier
    #: picks the group's point-to-point transport there
    _transports: TransportSet

    def _abort(self, exc: BaseException) -> None:
        """Abort the communicator with `exc`: later calls raise CommAborted at once."""
        ...

    def late(self, op: str, seq: int) -> tuple[list[int] | None, str]:
        """For a wait on `op` #`seq` that expired: the ranks not yet there (None: unknown),
        and what else there is to say."""
        ...


@runtime_checkable
class NodeReduce(Protocol):
    """Capability: a fused all-reduce of one host through one shared segment (mpi/node.py).

    The communicator uses it for a blocking all_reduce_coalesced of host arrays where
    `fits_node` says the group and size allow, and turns it off for good with `node_off` once
    the segments cannot be had on some rank."""

    def fits_node(self, nbytes: int) -> bool:
        """Whether a fused all-reduce of `nbytes` can go through the shared segments."""
        ...

    def node_reduce(self, op: str, seq: int) -> Any:
        """The shared segments, made (collectively) at their first use."""
        ...

    def node_off(self) -> None:
        """No shared segments for this group any more: fused all-reduces go through MPI."""
        ...


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

    def __init__(self, comm: Context) -> None:
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

    def stages_input(self, op: str, nbytes: int) -> bool:
        """Whether all_gather, reduce_scatter or all_to_all (`op`) with `nbytes` of input per
        rank, issued now, reads all of this rank's `x` before it writes any of `out`: then
        `out` may overlap `x` in any way and the communicator passes both as they are. False
        here: the communicator copies an overlapped `x` first, outside the in-place layouts."""
        return False

    def all_gather(self, out: Buffer, x: Buffer, seq: int) -> Work:
        """Block i of `out` (size blocks the size of `x`) gets `x` of rank i. `x` may be this
        rank's block of `out` (the in-place form, arrays.own_block); no other overlap comes
        unless stages_input says so."""
        raise NotImplementedError

    def reduce_scatter(self, out: Buffer, x: Buffer, op: ReduceOp, seq: int) -> Work:
        """Rank i's `out` gets the reduction of block i of every rank's `x`. `out` may be this
        rank's block of `x` (the in-place form, arrays.own_block); no other overlap comes
        unless stages_input says so."""
        raise NotImplementedError

    def all_to_all(self, out: Buffer, x: Buffer, seq: int) -> Work:
        """Block j of `x` goes to rank j; block i of `out` comes from rank i. `out` does not
        overlap `x` unless stages_input says so."""
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

    @property
    def reduces_arrays(self) -> bool:
        """Whether all_reduce_coalesced hands this transport its device arrays where they are
        (all_reduce_arrays) rather than packed into one buffer for all_reduce: where a pack
        and an unpack kernel in every process cost more than moving each array (ranks
        sharing one GPU, which switches between their contexts for each kernel)."""
        return False

    def ready_events(self, bufs: Sequence[Buffer]) -> list[Any]:
        """On the calling thread: an event (or None, nothing to wait for) per stream that
        `bufs`, device arrays, are used on, where that stream reaches this call."""
        raise NotImplementedError

    def all_reduce_arrays(
        self,
        spans: Sequence[tuple[int, int]],
        dtype: str,
        op: ReduceOp,
        seq: int,
        ready: Sequence[Any],
    ) -> Work:
        """all_reduce_coalesced in place of contiguous device arrays of `dtype` at `spans`
        ((address, bytes) in the call's order, every rank as many, adding up to the same
        total), once the events of `ready` (ready_events') have passed: the result is what
        one all_reduce of their concatenation gives, whatever places the ranks cut it at.
        Only where `reduces_arrays`."""
        raise NotImplementedError

    def drain(self, op: str, seq: int) -> None:
        """Return once every MPI call the transport queued on the communicator's own MPI
        communicator has been made (nothing is queued by default), so that a call the
        communicator makes there itself (`op`: split, dup, a debug fingerprint) comes after
        them on every rank."""

    def close(self) -> None:
        """Release what the transport holds (nothing by default)."""


def _done_already(*args: Any) -> None:
    """A Job's call once made: a Job is run once, and what its call held is not kept."""


class Job(Signal):
    """A call queued on a transport's own thread; set once it has returned or raised (its
    listeners are told then, on the thread that sets it).

    Completion is one lock, held from creation until `set`: a waiter blocks on it directly and
    wakes with one hand-off, where an Event's waiter also waits for the Event's own lock after
    being notified (measurable per call for collectives of a few hundred microseconds).
    """

    __slots__ = ("_done", "_lock", "call", "error")

    def __init__(self, call: Callable[..., Any]) -> None:
        super().__init__()
        self.call = call  # made with run()'s arguments
        self.error: BaseException | None = None
        self._done = False
        self._lock = threading.Lock()
        self._lock.acquire()

    def run(self, *args: Any) -> None:
        """Make the call (with `args`) on the calling thread, keep its error, then set."""
        self.call_only(*args)
        self.set()

    def call_only(self, *args: Any) -> None:
        """Make the call and keep its error, without setting (the caller sets when ready)."""
        call, self.call = self.call, _done_already  # what the call holds goes with it
        try:
            call(*args)
        except BaseException as exc:
            self.error = exc

    def set(self) -> None:
        """Mark the job done and wake its waiters (call once, from the job's thread)."""
        if not self._done:
            self._done = True
            self._lock.release()
            self.fire()

    def is_set(self) -> bool:
        """Whether the call has returned or raised."""
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
