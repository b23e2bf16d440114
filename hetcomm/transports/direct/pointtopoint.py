"""The direct transport's sends and receives (a mixin of DirectTransport): one rank of each
pair makes the peer copy (schedule.copier), the other lends its buffer (see transport.py's
docstring for the protocol; direct/prepared.py runs the same messages on the calling thread).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
from mpi4py import MPI

from ...errors import InvalidArgument
from .. import tags
from . import schedule
from .peer import RECORD, Described, PeerMap
from .proxy import Proxy, Step, stamp

if TYPE_CHECKING:
    from ...arrays import Buffer
    from ...work import Work


class PointToPoint:
    """send and recv on DirectTransport's state."""

    rank: int
    svc: MPI.Intracomm
    peers: PeerMap
    described: Described
    _devices: list[Any]
    _lead_tag: int
    _lent: dict[tuple[int, int], deque[Lent]]
    _proxy: Proxy
    _check: Callable[[str, tuple[Buffer, ...]], None]
    _ready: Callable[[Buffer], Any]
    _queue: Callable[..., Work]
    _copy: Callable[[int, int, int], None]
    _sync: Callable[[], Step]

    def _tags(self, tag: int, op: str, pushed: bool) -> tuple[int, int]:
        """The tags of a message's record and its "done"."""
        top = self._lead_tag - 1
        if tags.DIRECT_P2P + 4 * tag + 3 > top:
            most = (top - tags.DIRECT_P2P - 3) // 4
            raise InvalidArgument(f"{op}: the direct transport takes tags up to {most}, got {tag}")
        base = tags.DIRECT_P2P + 4 * tag + (2 if pushed else 0)
        return base, base + 1

    def send(self, x: Buffer, dst: int, tag: int, seq: int) -> Work:
        """A peer copy made by whichever of the pair the schedule names the copier."""
        stamp("transport")
        self._self_check(dst, "send")
        if schedule.copier(self.rank, dst, self._devices) == self.rank:
            return self._copier("send", seq, x, dst, self._tags(tag, "send", True))
        return self._lender("send", seq, x, dst, self._tags(tag, "send", False))

    def recv(self, x: Buffer, src: int, tag: int, seq: int) -> Work:
        """A peer copy made by whichever of the pair the schedule names the copier."""
        stamp("transport")
        self._self_check(src, "recv")
        if schedule.copier(src, self.rank, self._devices) == self.rank:
            return self._copier("recv", seq, x, src, self._tags(tag, "recv", False))
        return self._lender("recv", seq, x, src, self._tags(tag, "recv", True))

    def _lender(self, op: str, seq: int, x: Buffer, peer: int, tags: tuple[int, int]) -> Work:
        """The side of a message that lends its buffer to the peer's copy: once its stream has
        the buffer ready it sends the buffer's record, after the records of the same peer and
        tag issued before (_post_in_order), and it ends when the copier says done."""
        self._check(op, (x,))
        rec = self.described.one(x.ptr, x.nbytes)
        stamp("described")
        entry = Lent(self._ready(x), rec)
        stamp("ready")
        queue = self._lent.setdefault((peer, tags[0]), deque())
        queue.append(entry)

        def body() -> Step:
            while not entry.reqs:
                blocker = self._post_in_order(queue, peer, tags)
                if not entry.reqs:
                    yield blocker  # an earlier record's stream, or ours, is not there yet
            yield entry.reqs
            if entry.done[0] != x.nbytes:
                raise self._mismatch(op, peer, int(entry.done[0]), x.nbytes, x.describe())

        return self._queue(op, seq, (x,), x.nbytes, body, collective=False, ready=())

    def _post_in_order(self, queue: deque[Lent], peer: int, tags: tuple[int, int]) -> Any:
        """Send the records at the head of `queue` whose buffers are ready and post the
        receives of their "done", in order; the ready event of the first one whose buffer is
        not ready (None if all went)."""
        while queue:
            head = queue[0]
            if head.ready is not None and not head.ready.done:
                return head.ready
            head.reqs = [
                self.svc.Isend(head.rec.view(np.uint8), peer, tags[0]),
                self.svc.Irecv(head.done, peer, tags[1]),
            ]
            queue.popleft()
        return None

    def _copier(self, op: str, seq: int, x: Buffer, peer: int, tags: tuple[int, int]) -> Work:
        """The side that copies: once the peer's record arrives, the proxy's stream waits on
        the GPU for the caller's stream, copies (into the peer's buffer for a send, out of it
        for a receive), and once the copy is done it says so with its size."""
        self._check(op, (x,))
        ready = self._ready(x)
        stamp("ready")
        got = np.empty(1, RECORD)
        req = self.svc.Irecv(got.view(np.uint8), peer, tags[0])  # posted in issue order

        def body() -> Step:
            yield req
            theirs = int(got.view(np.uint64)[2])  # the record's nbytes
            ok = theirs == x.nbytes
            if ok:
                if ready is not None:  # the caller's stream, on the GPU (one process's streams)
                    self._proxy.stream.wait_event(ready)
                mapped, _ = self.peers.address(peer, got)
                stamp("resolved")
                dst, src = (mapped, x.ptr) if op == "send" else (x.ptr, mapped)
                self._copy(dst, src, x.nbytes)
                stamp("copy queued")
                yield from self._sync()
            else:
                self.peers.learn(peer, got[0])  # its handle may come only this once
            yield self.svc.Isend(np.array([x.nbytes], np.int64), peer, tags[1])
            if not ok:
                raise self._mismatch(op, peer, theirs, x.nbytes, x.describe())

        return self._queue(op, seq, (x,), x.nbytes, body, collective=False, ready=())

    @staticmethod
    def _mismatch(op: str, peer: int, theirs: int, nbytes: int, what: str) -> InvalidArgument:
        """A message whose two ends differ in size (`what`: this end's array, described)."""
        if op == "send":
            return InvalidArgument(
                f"send: rank {peer} posted a receive of {theirs} bytes for "
                f"this {nbytes}-byte message"
            )
        return InvalidArgument(
            f"recv: rank {peer} sent {theirs} bytes, this buffer holds {nbytes} ({what})"
        )

    def _self_check(self, peer: int, op: str) -> None:
        if peer == self.rank:
            raise InvalidArgument(
                f"{op}: rank {peer} is this rank; the direct transport moves data between ranks"
            )


class Lent:
    """A lent buffer's record waiting to be sent: its stream's ready event (None: nothing
    pending), the copier's "done" (its size), and once sent the two requests."""

    __slots__ = ("done", "ready", "rec", "reqs")

    def __init__(self, ready: Any, rec: np.ndarray) -> None:
        self.ready, self.rec = ready, rec
        self.done = np.zeros(1, np.int64)
        self.reqs: list[MPI.Request] = []
