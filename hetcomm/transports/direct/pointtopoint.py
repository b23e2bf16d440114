"""The direct transport's sends and receives (a mixin of DirectTransport): one rank of each
pair makes the peer copy (schedule.copier), the other lends its buffer (see transport.py's
docstring for the protocol; the record and "done" travel through the mailbox, mailbox.py;
direct/prepared.py runs the same messages on the calling thread).
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
from .mailbox import Post
from .peer import Described, PeerMap
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
    post: Post
    _proxy: Proxy
    _check: Callable[[str, tuple[Buffer, ...]], None]
    _ready: Callable[[Buffer], Any]
    _queue: Callable[..., Work]
    _copy: Callable[[int, int, int], None]
    _sync: Callable[[], Step]

    def _key(self, tag: int, op: str, pushed: bool) -> int:
        """The key of a message's record in the mailbox (its "done" takes key + 1 where the
        post is MPI's: tags.DIRECT_P2P + 4 x tag + 0..3)."""
        top = self._lead_tag - 1
        if tags.DIRECT_P2P + 4 * tag + 3 > top:
            most = (top - tags.DIRECT_P2P - 3) // 4
            raise InvalidArgument(f"{op}: the direct transport takes tags up to {most}, got {tag}")
        return tags.DIRECT_P2P + 4 * tag + (2 if pushed else 0)

    def send(self, x: Buffer, dst: int, tag: int, seq: int) -> Work:
        """A peer copy made by whichever of the pair the schedule names the copier."""
        stamp("transport")
        self._self_check(dst, "send")
        if schedule.copier(self.rank, dst, self._devices) == self.rank:
            return self._copier("send", seq, x, dst, self._key(tag, "send", True))
        return self._lender("send", seq, x, dst, self._key(tag, "send", False))

    def recv(self, x: Buffer, src: int, tag: int, seq: int) -> Work:
        """A peer copy made by whichever of the pair the schedule names the copier."""
        stamp("transport")
        self._self_check(src, "recv")
        if schedule.copier(src, self.rank, self._devices) == self.rank:
            return self._copier("recv", seq, x, src, self._key(tag, "recv", False))
        return self._lender("recv", seq, x, src, self._key(tag, "recv", True))

    def _lender(self, op: str, seq: int, x: Buffer, peer: int, key: int) -> Work:
        """The side of a message that lends its buffer to the peer's copy: once its stream has
        the buffer ready it lends the buffer's record, after the records of the same peer and
        key issued before (_post_in_order), and it ends when the copier says done."""
        self._check(op, (x,))
        rec = self.described.one(x.ptr, x.nbytes)
        stamp("described")
        entry = Lent(self._ready(x), rec)
        stamp("ready")
        queue = self._lent.setdefault((peer, key), deque())
        queue.append(entry)

        def body() -> Step:
            while entry.lend is None:
                blocker = self._post_in_order(queue, peer, key)
                if entry.lend is None:
                    yield blocker  # an earlier record's stream, or ours, or the mailbox's room
            yield entry.lend.wait
            if entry.lend.copied != x.nbytes:
                raise self._mismatch(op, peer, int(entry.lend.copied), x.nbytes, x.describe())

        return self._queue(op, seq, (x,), x.nbytes, body, collective=False, ready=())

    def _post_in_order(self, queue: deque[Lent], peer: int, key: int) -> Any:
        """Lend the records at the head of `queue` whose buffers are ready, in order; what the
        first one not lent waits for (its ready event, or room in the mailbox), None if all
        went."""
        while queue:
            head = queue[0]
            if head.ready is not None and not head.ready.done:
                return head.ready
            lend = self.post.lend(peer, key, head.rec)
            if lend is None:
                return self.post.room(peer)
            head.lend = lend
            queue.popleft()
        return None

    def _copier(self, op: str, seq: int, x: Buffer, peer: int, key: int) -> Work:
        """The side that copies: once the peer's record arrives, the proxy's stream waits on
        the GPU for the caller's stream, copies (into the peer's buffer for a send, out of it
        for a receive), and once the copy is done it says so with its size."""
        self._check(op, (x,))
        ready = self._ready(x)
        stamp("ready")
        got = self.post.expect(peer, key)  # posted in issue order

        def body() -> Step:
            yield got.wait
            rec = got.got
            theirs = int(rec.view(np.uint64)[2])  # the record's nbytes
            ok = theirs == x.nbytes
            if ok:
                if ready is not None:  # the caller's stream, on the GPU (one process's streams)
                    self._proxy.stream.wait_event(ready)
                mapped, _ = self.peers.address(peer, rec)
                stamp("resolved")
                dst, src = (mapped, x.ptr) if op == "send" else (x.ptr, mapped)
                self._copy(dst, src, x.nbytes)
                stamp("copy queued")
                yield from self._sync()
            else:
                self.peers.learn(peer, rec[0])  # its handle may come only this once
            yield self.post.done(peer, got, x.nbytes)
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
    """A lent buffer's record waiting to be lent: its stream's ready event (None: nothing
    pending), and once lent, the lend (its "done" to wait for)."""

    __slots__ = ("lend", "ready", "rec")

    def __init__(self, ready: Any, rec: np.ndarray) -> None:
        self.ready, self.rec = ready, rec
        self.lend: Any = None
