"""`with comm.group():` blocks: point-to-point calls queued where they are made and started
together when the block ends (see Communicator.group)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .argcheck import check_timeout, writable
from .arrays import as_buffer
from .errors import InvalidArgument
from .work import Follow, Work

if TYPE_CHECKING:
    from .comm import Communicator


class Queued:
    """A point-to-point call queued by a group block, and its Work once started."""

    __slots__ = ("blocking", "dropped", "op", "peer", "tag", "timeout", "work", "x")

    def __init__(
        self, op: str, x: Any, peer: int, tag: int, timeout: float | None, blocking: bool
    ) -> None:
        self.op, self.x, self.peer, self.tag, self.timeout = op, x, peer, tag, timeout
        self.blocking = blocking
        self.work: Work | None = None
        self.dropped = False


class Group:
    """The context manager of Communicator.group()."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm

    def __enter__(self) -> Group:
        comm = self.comm
        comm._check_open()
        if comm._group is not None:
            raise InvalidArgument("comm.group() blocks do not nest")
        comm._group = []
        return self

    def __exit__(self, kind: object, exc: object, tb: object) -> None:
        comm = self.comm
        items, comm._group = comm._group or [], None
        if kind is not None:
            for item in items:
                item.dropped = True
            return
        run(comm, items)


def queue(
    comm: Communicator,
    op: str,
    x: Any,
    peer: int,
    tag: int,
    async_op: bool,
    timeout: float | None,
) -> Work | None:
    """A send or recv inside `with comm.group():`, validated now and started at its end."""
    assert comm._group is not None
    if timeout is not None:
        check_timeout(timeout, op)
    xb = as_buffer(x, f"{op}: x")
    if op == "recv":
        writable(xb, "recv: x")
    item = Queued(op, x, peer, tag, timeout, not async_op)
    comm._group.append(item)
    if not async_op:
        return None

    def poll() -> bool:
        if item.work is None:
            if item.dropped:
                raise InvalidArgument(f"{op}: its comm.group() block ended by an exception")
            return False
        return item.work.test()

    follow = Follow(lambda: item.work)
    return Work(comm, op, comm._p2p_seq, poll, waiter=follow.wait, drive=follow.drive)


def run(comm: Communicator, items: list[Queued]) -> None:
    """Start the calls of a group block, receives first, then wait for the blocking ones."""
    order = [i for i in items if i.op == "recv"] + [i for i in items if i.op == "send"]
    for item in order:
        call = comm.recv if item.op == "recv" else comm.send
        item.work = call(item.x, item.peer, item.tag, async_op=True, timeout=item.timeout)
    for item in items:
        if item.blocking:
            assert item.work is not None
            item.work.wait()
