"""`with comm.group():` blocks: point-to-point calls queued where they are made and started
together when the block ends (see Communicator.group)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import InvalidArgument

if TYPE_CHECKING:
    from .comm import Communicator
    from .work import Work


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
        comm._run_group(items)
