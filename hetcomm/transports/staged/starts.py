"""How the staged transport starts a send or receive that does not run to its end on the
calling thread (an asynchronous call, the general path's): the message in the pair's eager
ring at once where it fits, lent to the receiver to read (pull.py), its chunks queued on the
rails from this thread where the pair's channel rings the shm doorbell, else on a driver; and
the Work that completes each."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ...errors import CommTimeout
from ...work import Work, completed
from ..local import Region
from . import p2p, pull
from .cts import CTS_P2P
from .ops import PeerTimeout, _Op

if TYPE_CHECKING:
    from ...arrays import Buffer
    from .channel import Channel
    from .transport import StagedTransport


def on_calling_thread(t: StagedTransport, peer: int) -> bool:
    """Whether a send to or receive from `peer` can start on the calling thread: their
    channel is open and rings the shm doorbell, so nothing there blocks (else a driver
    runs it; the first message opens the channel, which both ranks do together)."""
    if peer not in t._channels or t.closed:
        return False
    doorbell = t._channels[peer].doorbell()
    return doorbell is not None and doorbell.alive


def _op_work(
    t: StagedTransport,
    name: str,
    seq: int,
    x: Buffer | Region,
    op: _Op,
    deadline: float,
    cleanup: Callable[[], None],
) -> Work:
    """The Work of a message started on the calling thread: done when `op` is, failing
    with CommTimeout (naming the peer and why) when `deadline` passes first; `cleanup`
    runs once it ends either way."""

    def poll() -> bool:
        if not op.done.is_set() and time.monotonic() < deadline:
            return False
        try:
            op.wait(deadline)  # past the deadline it does not block
        except PeerTimeout as exc:
            raise CommTimeout(t.comm.name, name, seq, t.timeout, exc.ranks, str(exc)) from None
        finally:
            cleanup()
        return True

    work = Work(
        t.comm,
        name,
        seq,
        poll,
        waiter=lambda seconds: op.done.wait(min(seconds, deadline - time.monotonic())),
    )
    work.info = {"transport": "staged", "bytes": x.nbytes, "stages": len(op.spans)}
    return work


def send_start(
    t: StagedTransport,
    region: Region,
    dst: int,
    tag: int,
    k: int,
    seq: int,
    ready: Any,
    bufs: list[Buffer],
    ticket: int | None = None,
) -> Work:
    """The Work of asynchronous send `k` of (`dst`, `tag`): done at once where the message
    went into the ring, else started here or on a driver (`bufs`: the caller's buffers, for
    the driver's ready event; none for host memory). `ticket`: its place among the sends
    that take the ring's slots, where the caller drew it already."""
    deadline = time.monotonic() + t.timeout
    ch = t._channels.get(dst) if dst != t.rank and not t.closed else None
    if ticket is None and dst != t.rank:
        # its place among the sends that take the ring's slots, kept if it waits; drawn
        # here also where the channel is not open yet, so that a later send, made once it
        # is, cannot fill the ring ahead of this one while the receiver waits for this one
        ticket = next(t.tickets(dst))
    marked = False
    out = ch.eager_out if ch is not None else None
    if ch is not None and out is not None:
        assert ticket is not None  # a peer's channel: drawn above
        if region.nbytes <= out.slot_bytes:
            if p2p.send_eager(t, ch, region, tag, k, deadline, ready, False, ticket):
                work = completed(t.comm, "send", seq)
                work.info = {"transport": "staged", "bytes": region.nbytes, "stages": 1}
                return work
        elif pull.lends(out, region):
            lent = p2p.lend(t, ch, region, tag, k, deadline, False, ticket)
            if lent is not None:
                return pull.send_work(t, ch, *lent, region, tag, k, seq, deadline)
        else:
            marked = p2p.mark(t, ch, tag, k, region.nbytes, deadline, False, ticket)
    if (out is None or marked) and on_calling_thread(t, dst):
        # no driver: the chunks are queued here if the receive is posted already, else by
        # the thread that files its clear-to-send
        t.paths["send rails"] += 1
        op = t.messages.start_send(dst, region, CTS_P2P, tag, k, deadline, ready)
        return _op_work(t, "send", seq, region, op, deadline, lambda: t.cts.unwait(op))

    def body(deadline: float, ready: Any) -> None:
        p2p.send(t, region, dst, tag, k, deadline, ready, marked, ticket)

    return t._run("send", seq, bufs, body, nbytes=region.nbytes)


def recv_start(
    t: StagedTransport,
    region: Region,
    src: int,
    tag: int,
    k: int,
    seq: int,
    ready: Any,
    bufs: list[Buffer],
) -> Work:
    """The Work of asynchronous receive `k` of (`src`, `tag`) into `region`: polled on
    the ring or the rails with no thread where it can be, else run on a driver (`bufs`
    as send_start's)."""
    deadline = time.monotonic() + t.timeout
    peer = src != t.rank and not t.closed
    ch = t._channels.get(src) if peer else None
    if ch is not None:  # the common case first: nothing of the driver's path made for it
        work = _recv_async(t, ch, region, tag, k, seq, deadline, ready)
        if work is not None:
            return work
    n = region.nbytes

    def body(deadline: float, ready: Any) -> None:
        p2p.recv(t, region, src, tag, k, deadline, ready)

    if peer and ch is None:
        return _when_open(
            t,
            src,
            seq,
            deadline,
            lambda ch: (
                _recv_async(t, ch, region, tag, k, seq, deadline, ready)
                or t._run("recv", seq, bufs, body, nbytes=n)
            ),
        )
    return t._run("recv", seq, bufs, body, nbytes=n)


def _recv_async(
    t: StagedTransport,
    ch: Channel,
    region: Region,
    tag: int,
    k: int,
    seq: int,
    deadline: float,
    ready: Any,
) -> Work | None:
    """The Work of an asynchronous receive over an open channel, polled by its waiter
    with no thread where it can be; None where a driver must run it."""
    inbox = ch.eager_in
    if inbox is not None:
        return p2p.posted_work(t, ch, inbox, region, tag, k, seq, deadline, ready)
    if on_calling_thread(t, ch.peer):
        # no driver: the clear-to-send goes out from here, and the Work completes when
        # the thread that lands the last chunk says so
        t.paths["recv rails"] += 1
        op = t.messages.post_recv(ch.peer, region, CTS_P2P, tag, k, deadline, ready)
        return _op_work(t, "recv", seq, region, op, deadline, lambda: t.messages.forget(op))
    return None


def _when_open(
    t: StagedTransport, peer: int, seq: int, deadline: float, then: Callable[[Channel], Work]
) -> Work:
    """The Work of an asynchronous receive whose channel is not open yet: `then(channel)`
    makes the receive's own Work, which this one polls, on the thread that opens the channel
    (`StagedTransport.when_open`): whichever operation opens it, a driver's job made for this
    receive if none does first (both ranks open it together). The receive is so posted as
    soon as the channel is open: a ring of messages for receives that nobody polls yet
    drains all the same, and receives that wait do not hold the drivers. A receive posted
    only by its own job, queued behind sends that wait on the drivers for their receivers to
    read them, stalled ranks whose first messages were all asynchronous (2026-12-06)."""

    inner: list[Work] = []
    failed: list[BaseException] = []

    def post(ch: Channel) -> None:
        # on the thread that opened the channel, which may be another operation's: an
        # error here is this receive's
        try:
            inner.append(then(ch))
        except BaseException as exc:
            failed.append(exc)

    t.when_open(peer, post)

    def open_it(by: float) -> None:
        t.channel(peer, by)

    opened = t._driver.submit(open_it, deadline)

    def poll() -> bool:
        if inner:
            return inner[0].test()
        if failed:
            raise failed[0]
        if opened.is_set():  # the channel open (its receive posted by the opener) or failed
            try:
                opened.check()
            except PeerTimeout as exc:
                raise CommTimeout(
                    t.comm.name, "recv", seq, t.timeout, exc.ranks, str(exc)
                ) from None
        return False

    def waiter(seconds: float) -> bool:
        if not inner and not opened.is_set():
            return opened.wait(min(seconds, 50e-6)) or bool(inner)
        time.sleep(min(seconds, 50e-6))  # the receive's own Work is polled meanwhile
        return False

    work = Work(t.comm, "recv", seq, poll, waiter=waiter)
    return work
