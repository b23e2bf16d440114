"""Read-only views of a communicator's and its transports' internal state, for tests and debugging.

Tests need to see which transport served a call, which channels a staged transport opened, how
many of a segment's slots are free. Reading the underscore attributes from a test ties it to
today's internals; these functions are the one place that reads them, kept true by whoever
changes those internals (the tests that use them fail when one goes stale). Nothing here changes
state, except that `transport_of` makes the transport a call would make (as the call would).
Views are read-only mappings or tuples; objects handed out (a channel, a worker) are the live
ones, to be read, not driven.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .comm import Communicator
    from .transports.base import Transport
    from .transports.mpi.node import NodeReduce
    from .transports.shm import SharedSlots
    from .transports.staged.channel import Channel
    from .transports.worker import InOrderWorker
    from .work import Work

__all__ = [
    "transports",
    "transport_of",
    "last_transport",
    "in_flight",
    "finished",
    "unavailable",
    "check_form",
    "channels",
    "driver_submitted",
    "free_slots",
    "persistent_requests",
    "lane",
    "node_reduce",
]


# ---- the communicator ---------------------------------------------------------------------


def transports(comm: Communicator) -> Mapping[str, Transport]:
    """The transports `comm` has made so far, by name (a transport is made on first use)."""
    return MappingProxyType(comm._transports.live)


def transport_of(comm: Communicator, op: str, array: Any = None, name: str = "x") -> Transport:
    """The transport that serves `op` on `array`'s memory and size class, made now if the
    communicator has not made it yet (a call would make it the same way); `array=None` for an
    operation without data (barrier)."""
    from .arrays import as_buffer

    return comm._transport(op, None if array is None else as_buffer(array, name))


def last_transport(comm: Communicator) -> Transport | None:
    """The transport of `comm`'s most recent collective (what the ordering guard compares)."""
    return comm._last


def in_flight(comm: Communicator) -> tuple[Work, ...]:
    """The asynchronous operations of `comm` that the ordering guard still tracks."""
    return tuple(comm._inflight)


def finished(work: Work) -> bool:
    """Whether `work` has completed, without progressing it (unlike `work.test()`)."""
    return bool(work._done)


def unavailable(comm: Communicator) -> Mapping[str, str | None]:
    """Per transport name, why `comm`'s plan may not pick it (None: it may)."""
    return MappingProxyType(comm._transports.unavailable)


def check_form(comm: Communicator) -> str:
    """The form `comm`'s default check takes: "shared memory" (every rank on one host) or
    "MPI all-reduce" (the same on every rank; see hetcomm.agree)."""
    return str(comm._agree.form)


# ---- the staged transport -----------------------------------------------------------------


def channels(transport: Transport) -> Mapping[int, Channel]:
    """A staged transport's open channels, by peer rank (each with its rail `specs`, its
    shared slots `shm_out` and the count of slots held by `early` sends)."""
    return MappingProxyType(_attr(transport, "_channels", "staged"))


def driver_submitted(transport: Transport) -> int:
    """How many operation bodies a staged transport has handed to its driver threads."""
    return int(_attr(transport, "_driver", "staged").submitted)


def free_slots(slots: SharedSlots) -> int:
    """How many slots of a shared segment (a staged channel's `shm_out`) are free now."""
    return slots.free_count()


# ---- the mpi transport --------------------------------------------------------------------


def persistent_requests(transport: Transport) -> tuple[Any, ...]:
    """Every cached persistent-collective slot of an mpi transport (each with its `request`)."""
    requests = _attr(transport, "requests", "mpi")
    return tuple(requests._slots.values())


def lane(transport: Transport) -> InOrderWorker:
    """An mpi transport's in-order worker (the thread that runs its asynchronous calls)."""
    worker: InOrderWorker = _attr(transport, "_lane", "mpi")
    return worker


def node_reduce(transport: Transport) -> NodeReduce | None:
    """An mpi transport's one-node shared-segment reduction, once a call has made it."""
    node: NodeReduce | None = _attr(transport, "_node", "mpi")
    return node


def _attr(transport: Transport, name: str, kind: str) -> Any:
    """`transport.<name>`, or a TypeError saying that only a `kind` transport has it."""
    try:
        return getattr(transport, name)
    except AttributeError:
        raise TypeError(
            f"expected a {kind} transport, got {type(transport).__name__} "
            f"({getattr(transport, 'name', '?')!r})"
        ) from None
