"""A staged send or receive run to its end: eager through the pair's ring, or over the rails.

Which path a message takes depends on its size and the pair alone, so both ranks agree: a
message of at most the ring's slot bytes between ranks with a ring (one host) goes eager
(eager.py), anything else over the rails behind a clear-to-send (transport.py). The sizes of
a message and its receive may disagree across that line; each way fails with the rails'
size-mismatch error instead of waiting:

- an eager message, a receive above the threshold: the receive finds the message in the ring
  (it looks before posting its clear-to-send, then every 50 ms while it waits);
- a message over the rails, an eager receive: the sender's marker names its size, and the
  receive answers with a clear-to-send of its own size, which fails the sender too.

The functions take the transport (`t`) as collectives.py's do; they run on whichever thread
calls them: the caller's for blocking calls, a driver's for asynchronous ones that must wait.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ...errors import CommTimeout, HetcommError, MismatchError, PeerLost
from ...work import Work
from .. import flags
from ..local import Region
from .cts import CTS_P2P
from .eager import DATA, RAILS, EagerIn, EagerOut, Found, Posted
from .ops import PeerTimeout
from .rails import size_mismatch

if TYPE_CHECKING:
    from .channel import Channel
    from .transport import StagedTransport

# how often a receive over the rails looks into the ring while it waits for its chunks
WATCH_S = 0.05


def channel_to(t: StagedTransport, peer: int, deadline: float) -> Channel | None:
    """The open channel to `peer` (opened now if need be); None for this rank itself."""
    if t.closed:
        raise HetcommError("the staged transport was closed")
    if peer == t.rank:
        return None
    return t._channels.get(peer) or t.channel(peer, deadline)


def check_peer(t: StagedTransport, ch: Channel) -> None:
    """Raise if the transport has closed or `ch`'s peer is gone (its shm rail closed)."""
    if t.closed:
        raise HetcommError("the staged transport was closed")
    link = ch.doorbell()
    if link is not None and not link.alive:
        why = "; ".join(ch.dead) or "the peer closed it"
        raise PeerLost(f"rank {ch.peer}: its shm rail is gone ({why})", [ch.peer])


# ---- sends ------------------------------------------------------------------------------------


def send(
    t: StagedTransport,
    region: Region,
    dst: int,
    tag: int,
    k: int,
    deadline: float,
    ready: Any,
    marked: bool = False,
    ticket: int | None = None,
) -> None:
    """Send message `k` of (`dst`, `tag`) to its end: eagerly where the pair has a ring and it
    fits a slot, else over the rails (a marker in the ring first, unless `marked`). `ticket`:
    its place in the ring's order, drawn where the send was made (else here)."""
    ch = channel_to(t, dst, deadline)
    out = ch.eager_out if ch is not None else None
    if ch is not None and out is not None:
        if ticket is None:
            ticket = out.ticket()
        if region.nbytes <= out.slot_bytes:
            send_eager(t, ch, region, tag, k, deadline, ready, True, ticket)
            return
        if not marked:
            mark(t, ch, tag, k, region.nbytes, deadline, True, ticket)
    t.paths["send rails"] += 1
    t.finish_send(t.start_send(dst, region, CTS_P2P, tag, k, deadline, ready), deadline)


def claim(
    t: StagedTransport, ch: Channel, out: EagerOut, deadline: float, wait: bool, ticket: int
) -> int | None:
    """A free slot of the ring to `ch`'s peer, in `ticket`'s turn; without `wait`, None if
    there is none for it now; with it, waits for one (PeerTimeout when the peer frees none in
    time; the ticket is given up then)."""
    slot = out.claim(ticket)
    if slot is not None or not wait:
        return slot
    got: list[int] = []

    def ready() -> bool:
        s = out.claim(ticket)
        if s is not None:
            got.append(s)
        return s is not None

    try:
        claimed = flags.wait(ready, deadline, lambda: check_peer(t, ch))
    except BaseException:
        out.skip(ticket)
        raise
    if not claimed:
        out.skip(ticket)
        raise PeerTimeout(
            [ch.peer], f"rank {ch.peer} took none of the {out.slots} messages waiting for it"
        )
    return got[0]


def send_eager(
    t: StagedTransport,
    ch: Channel,
    region: Region,
    tag: int,
    k: int,
    deadline: float,
    ready: Any,
    wait: bool,
    ticket: int,
) -> bool:
    """Copy a message into a free slot of the ring and publish it, in `ticket`'s turn; False
    (nothing done) where there is no slot for it now and `wait` is False. Device bytes:
    copied after `ready` into the slot (registered with the GPU), the copy waited for before
    the slot is published."""
    out = ch.eager_out
    assert out is not None
    slot = claim(t, ch, out, deadline, wait, ticket)
    if slot is None:
        return False
    n = region.nbytes
    try:
        if n:
            if region.host is not None:
                out.put(slot, region.host)
            else:
                out.seg.register_with_gpu(t.gpu.device)
                t.gpu.copy_to_host(out.target(slot, n), region, ready)
    except BaseException:
        out.unclaim(slot)
        raise
    out.publish(slot, tag, k, n, DATA)
    t.paths["send eager"] += 1
    return True


def mark(
    t: StagedTransport,
    ch: Channel,
    tag: int,
    k: int,
    nbytes: int,
    deadline: float,
    wait: bool,
    ticket: int,
) -> bool:
    """Publish the marker of a message that goes over the rails, in `ticket`'s turn (False:
    no slot for it now and not `wait`), so that a receive expecting it eager learns that the
    sizes differ."""
    out = ch.eager_out
    assert out is not None
    slot = claim(t, ch, out, deadline, wait, ticket)
    if slot is None:
        return False
    out.publish(slot, tag, k, nbytes, RAILS)
    return True


# ---- receives ---------------------------------------------------------------------------------


def recv(
    t: StagedTransport, region: Region, src: int, tag: int, k: int, deadline: float, ready: Any
) -> None:
    """Receive message `k` of (`src`, `tag`) to its end: from the ring where the pair has one
    and it fits a slot, else over the rails (watching the ring meanwhile)."""
    ch = channel_to(t, src, deadline)
    inbox = ch.eager_in if ch is not None else None
    if ch is None or inbox is None:
        t.paths["recv rails"] += 1
        t.finish_recv(t.post_recv(src, region, CTS_P2P, tag, k, deadline, ready), deadline)
        return
    if region.nbytes <= inbox.slot_bytes:
        rec = Posted(region, tag, k, ready)
        found = inbox.post(rec)
        if found is not None:
            land(t, ch, found, rec)
        else:
            wait_posted(t, ch, inbox, rec, deadline)
        if rec.error is not None:
            raise rec.error
        return
    t.paths["recv rails"] += 1
    marked = rails_watch(t, ch, region, tag, k)
    op = t.post_recv(src, region, CTS_P2P, tag, k, deadline, ready)
    try:
        while not op.done.wait(min(WATCH_S, max(0.0, deadline - time.monotonic()))):
            progress(t, ch, inbox)  # eager receives posted meanwhile may free the ring
            if not marked:
                marked = rails_watch(t, ch, region, tag, k)
            if time.monotonic() >= deadline:
                break
        t.finish_recv(op, deadline)
    except MismatchError:
        rails_last(inbox, marked, tag, k)
        raise
    finally:
        t._forget(op)
    rails_last(inbox, marked, tag, k)


def progress(t: StagedTransport, ch: Channel, inbox: EagerIn) -> None:
    """Land every message in the ring that a posted receive waits for, on this thread."""
    for found, rec in inbox.progress():
        land(t, ch, found, rec)


def wait_posted(
    t: StagedTransport, ch: Channel, inbox: EagerIn, rec: Posted, deadline: float
) -> None:
    """Wait on this thread until the posted receive `rec` has landed (by this thread's
    progress or another's); PeerTimeout naming the sender when `deadline` passes first."""

    def ready() -> bool:
        if not rec.done:
            progress(t, ch, inbox)
        return rec.done

    try:
        if flags.wait(ready, deadline, lambda: check_peer(t, ch)):
            return
    except BaseException:
        inbox.unpost(rec)  # nothing may land in the region once this receive has failed
        raise
    if not inbox.unpost(rec):
        # another thread took the message as the time ran out: it lands it at once
        flags.wait(lambda: rec.done, time.monotonic() + 1.0)
        if rec.done:
            return
    raise PeerTimeout(
        [ch.peer],
        f"rank {ch.peer} never sent the matching message (tag {rec.tag}, its #{rec.number})",
    )


def land(t: StagedTransport, ch: Channel, found: Found, rec: Posted) -> None:
    """Copy a message taken from the ring into its receive's region and free the slot, then
    mark the receive done (its `error` set where it failed). A message of another size fails
    with the rails' size-mismatch error; a marker (the message comes over the rails, so it is
    larger than any slot) fails its sender too, by a clear-to-send of this size."""
    inbox = ch.eager_in
    assert inbox is not None
    region = rec.region
    try:
        if found.kind == RAILS:
            t.cts.send(ch.peer, CTS_P2P, rec.tag, rec.number, 0, region.nbytes)
            raise size_mismatch(ch.peer, found.nbytes, region.nbytes)
        if found.nbytes != region.nbytes:
            raise size_mismatch(ch.peer, found.nbytes, region.nbytes)
        if found.nbytes:
            if region.host is not None:
                inbox.get(found, region.host)
            else:
                inbox.seg.register_with_gpu(t.gpu.device)
                t.gpu.copy_from_host(region, inbox.view(found), rec.ready)
        t.paths["recv eager"] += 1
    except BaseException as exc:
        rec.error = exc
    finally:
        inbox.free(found)
        rec.done = True


def rails_watch(t: StagedTransport, ch: Channel, region: Region, tag: int, k: int) -> bool:
    """A receive over the rails looks into the ring for its number: an eager message there
    fails it (its size cannot be this one's), a marker is freed (True: seen)."""
    inbox = ch.eager_in
    assert inbox is not None
    found = inbox.take(tag, k)
    if found is None:
        return False
    inbox.free(found)
    if found.kind == DATA:
        raise size_mismatch(ch.peer, found.nbytes, region.nbytes)
    return True


def rails_last(inbox: EagerIn, marked: bool, tag: int, k: int) -> None:
    """A receive over the rails has ended: free its marker, published before the sender's
    first chunk or error, if it was not seen yet."""
    if not marked:
        found = inbox.take(tag, k)
        if found is not None:
            inbox.free(found)


# ---- asynchronous receives: their Works ---------------------------------------------------------


def eager_work(
    t: StagedTransport,
    ch: Channel,
    inbox: EagerIn,
    region: Region,
    tag: int,
    k: int,
    seq: int,
    deadline: float,
    ready: Any,
) -> Work:
    """The Work of an asynchronous eager receive, posted on the ring: whoever polls it (or
    any other receive from the peer) lands the message once it is there, with no thread; its
    waiter waits on the ring's words. It fails with CommTimeout naming the sender at
    `deadline`, or when the transport closes."""
    rec = Posted(region, tag, k, ready)
    found = inbox.post(rec)
    if found is not None:
        land(t, ch, found, rec)

    def look() -> bool:
        if not rec.done:
            progress(t, ch, inbox)
        return rec.done

    def poll() -> bool:
        if not look():
            if time.monotonic() < deadline:
                # as the rails' Works do, a peer that has gone shows as the timeout (a
                # closing transport fails its posted receives)
                return False
            if inbox.unpost(rec):
                raise CommTimeout(
                    t.comm.name,
                    "recv",
                    seq,
                    t.timeout,
                    [ch.peer],
                    f"rank {ch.peer} never sent the matching message (tag {tag}, its #{k})",
                )
            return False  # another thread is landing it
        if rec.error is not None:
            raise rec.error
        return True

    work = Work(
        t.comm,
        "recv",
        seq,
        poll,
        waiter=lambda seconds: flags.wait(look, time.monotonic() + seconds),
    )
    work.info = {"transport": "staged", "bytes": region.nbytes, "stages": 1}
    return work


def rails_work(
    t: StagedTransport,
    ch: Channel,
    inbox: EagerIn,
    region: Region,
    tag: int,
    k: int,
    seq: int,
    deadline: float,
    ready: Any,
) -> Work:
    """The Work of an asynchronous receive over the rails from a rank with a ring: posted
    here, completed by the thread that lands its last chunk; its polls watch the ring (an
    eager message of its number fails it, the marker is freed) and land posted eager
    receives."""
    t.paths["recv rails"] += 1
    marked = [rails_watch(t, ch, region, tag, k)]
    op = t.post_recv(ch.peer, region, CTS_P2P, tag, k, deadline, ready)

    def watch() -> None:
        progress(t, ch, inbox)
        if not marked[0]:
            try:
                marked[0] = rails_watch(t, ch, region, tag, k)
            except MismatchError as exc:
                op.fail(exc)
                marked[0] = True

    def cleanup() -> None:
        t._forget(op)
        rails_last(inbox, marked[0], tag, k)

    return t._op_work("recv", seq, region, op, deadline, cleanup, watch)
