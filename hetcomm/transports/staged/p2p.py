"""A staged send or receive run to its end: eager through the pair's ring, or over the rails.

Which path a message takes depends on its size and the pair alone, so both ranks agree: a
message of at most the ring's slot bytes between ranks with a ring (one host) goes eager
(eager.py). A larger one between such ranks publishes a marker in the ring first, which its
receive waits for before anything else: a PULL marker (a host array, to a receiver that can
read the sender's memory) is read by the receive straight from the sender's array (pull.py),
a RAILS marker tells the receive to post its clear-to-send for the rails (transport.py).
Between other ranks, anything larger goes over the rails. The sizes of a message and its
receive may disagree across that line; each way fails with a size-mismatch error instead of
waiting:

- an eager message, a receive above the threshold: the receive finds the message in the ring
  where it expects the marker;
- a marker, an eager receive: the marker names the size; the receive answers a RAILS marker
  with a clear-to-send of its own size and a PULL marker with its size in the slot, which
  fail the sender too.

The functions take the transport (`t`) as collectives.py's do; they run on whichever thread
calls them: the caller's for blocking calls, a driver's for asynchronous ones that must wait.
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import CommTimeout, HetcommError, PeerLost
from ...work import Work, completed
from .. import flags
from ..local import Region
from . import pull
from .cts import CTS_P2P
from .eager import DATA, GONE, NOT_READ, PULL, RAILS, TOTAL, EagerIn, EagerOut, Found, Posted
from .ops import PeerTimeout
from .rails import size_mismatch

if TYPE_CHECKING:
    from .channel import Channel
    from .transport import StagedTransport

# how often a receive over the rails lands the ring's posted receives while it waits
WATCH_S = 0.05


def channel_to(t: StagedTransport, peer: int, deadline: float) -> Channel | None:
    """The open channel to `peer` (opened now if need be); None for this rank itself."""
    if t.closed:
        raise HetcommError("the staged transport was closed")
    if peer == t.rank:
        return None
    return t._channels.get(peer) or t.channel(peer, deadline)


def never_sent(peer: int, tag: int, k: int) -> str:
    """Why a receive timed out: its message (or marker) never came."""
    return f"rank {peer} never sent the matching message (tag {tag}, its #{k})"


def check_peer(t: StagedTransport, ch: Channel) -> None:
    """Raise if the transport has closed or `ch`'s peer is gone (its shm rail closed)."""
    if t.closed:
        raise HetcommError("the staged transport was closed")
    link = ch.doorbell()
    if link is not None and not link.alive:
        why = "; ".join(ch.dead) or "the peer closed it"
        raise PeerLost(f"rank {ch.peer}: its shm rail is gone ({why})", [ch.peer])


def rails_ready(t: StagedTransport, ready: Any) -> Any:
    """The `ready` of a message that goes over the rails, whose copies other threads and
    streams make: a blocking device call's caller's stream (StagingDevice.on_stream) as an
    event recorded there now; an event, or None for host bytes, as it is."""
    return None if ready is None else t.gpu.as_event(ready)


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
    fits a slot, as a PULL message where the receiver can read this array, else over the rails
    (a marker in the ring first, unless `marked`). `ticket`: its place in the ring's order,
    drawn where the send was made (else here)."""
    ch = channel_to(t, dst, deadline)
    out = ch.eager_out if ch is not None else None
    if ch is not None and out is not None:
        if ticket is None:
            ticket = out.ticket()
        if region.nbytes <= out.slot_bytes:
            send_eager(t, ch, region, tag, k, deadline, ready, True, ticket)
            return
        if not marked and pull.lends(out, region):
            lent = lend(t, ch, region, tag, k, deadline, True, ticket)
            assert lent is not None  # a lend that may wait gets its slot or raises
            check = functools.partial(check_peer, t, ch)
            if not pull.wait_lent(out, *lent, region.nbytes, t.rank, ch.peer, deadline, check):
                raise PeerTimeout([ch.peer], pull.never_received(ch.peer, tag, k))
            return
        if not marked:
            mark(t, ch, tag, k, region.nbytes, deadline, True, ticket)
    t.paths["send rails"] += 1
    ready = rails_ready(t, ready)
    t.messages.finish_send(
        t.messages.start_send(dst, region, CTS_P2P, tag, k, deadline, ready, driven=True), deadline
    )


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
    if region.host is not None and out.send(region.host.data, tag, k, ticket):
        t.paths["send eager"] += 1
        return True
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
                t.gpu.copy_to_address(out.address(slot), region, ready)
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


def lend(
    t: StagedTransport,
    ch: Channel,
    region: Region,
    tag: int,
    k: int,
    deadline: float,
    wait: bool,
    ticket: int,
) -> tuple[int, int] | None:
    """Publish a host array's PULL marker in `ticket`'s turn: its (slot, PUB), or None (no
    slot now and not `wait`)."""
    out = ch.eager_out
    assert out is not None and region.host is not None
    slot = claim(t, ch, out, deadline, wait, ticket)
    if slot is None:
        return None
    t.paths["send pull"] += 1
    return slot, out.lend(slot, tag, k, region.nbytes, region.host.ctypes.data)


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
        ready = rails_ready(t, ready)
        op = t.messages.post_recv(src, region, CTS_P2P, tag, k, deadline, ready, driven=True)
        t.messages.finish_recv(op, deadline)
        return
    if region.nbytes <= inbox.slot_bytes:
        if region.host is not None:
            wait_eager(t, ch, inbox, region.host.data, tag, k, deadline)
            return
        rec = Posted(region, tag, k, ready)
        found = inbox.post(rec)
        if found is not None:
            land(t, ch, found, rec)
        else:
            wait_posted(t, ch, inbox, rec, deadline)
        if rec.error is not None:
            raise rec.error
        return
    found = wait_take(t, ch, inbox, tag, k, deadline)
    assert found is not None
    if not settle(t, ch, found, region, ready):
        return
    t.paths["recv rails"] += 1
    ready = rails_ready(t, ready)
    op = t.messages.post_recv(src, region, CTS_P2P, tag, k, deadline, ready, driven=True)
    try:
        while not op.ended(min(time.monotonic() + WATCH_S, deadline)):
            progress(t, ch, inbox)  # eager receives posted meanwhile may free the ring
            if time.monotonic() >= deadline:
                break
        t.messages.finish_recv(op, deadline)
    finally:
        t.messages.forget(op)


def wait_eager(
    t: StagedTransport,
    ch: Channel,
    inbox: EagerIn,
    dst: memoryview,
    tag: int,
    k: int,
    deadline: float,
) -> None:
    """Receive message `k` of (`ch`'s peer, `tag`) into host bytes `dst` (at most a slot) on
    this thread, no receive posted (so only this thread takes it): the message in the slot
    after the last one taken, eager and of this size (the rule), is copied and freed in one
    step (EagerIn.receive); anything else (a marker, another size, another slot) is landed as
    a posted receive's would be."""
    found = wait_take(t, ch, inbox, tag, k, deadline, dst)
    if found is None:
        t.paths["recv eager"] += 1
        return
    rec = Posted(Region(len(dst), np.frombuffer(dst, np.uint8)), tag, k, None, deadline)
    land(t, ch, found, rec)
    if rec.error is not None:
        raise rec.error


def wait_take(
    t: StagedTransport,
    ch: Channel,
    inbox: EagerIn,
    tag: int,
    k: int,
    deadline: float,
    dst: memoryview | None = None,
) -> Found | None:
    """Take message or marker `k` of (`ch`'s peer, `tag`), waiting on this thread for it and
    landing the ring's posted receives meanwhile; PeerTimeout naming the sender when
    `deadline` passes first. With `dst`, an eager message of its size in the ring's next
    slot is received into it at once instead (None returned)."""
    got: list[Found] = []
    words, seen = inbox.words, -1

    def ready() -> bool:
        # a look only where the sender has published since this wait's last one: a poll of
        # one word, where a look takes the ring's lock three times
        nonlocal seen
        total = words[TOTAL]
        if total == seen:
            return False
        seen = total
        if dst is not None and inbox.receive(dst, tag, k):
            return True
        progress(t, ch, inbox)
        found = inbox.take(tag, k)  # the look for it, last (EagerIn.doze)
        if found is None:
            return False
        got.append(found)
        return True

    if not flags.wait(ready, deadline, lambda: check_peer(t, ch), sleep=inbox.doze):
        raise PeerTimeout([ch.peer], never_sent(ch.peer, tag, k))
    return got[0] if got else None


def settle(t: StagedTransport, ch: Channel, found: Found, region: Region, ready: Any) -> bool:
    """A receive larger than a slot has taken `found` (its number's marker, or an eager
    message) and frees it: a PULL message is read into `region`; True where a RAILS marker
    says the message follows over the rails. Raises where the sizes disagree (the sender of a
    PULL message fails too) or its sender withdrew it."""
    inbox = ch.eager_in
    assert inbox is not None
    if found.kind == RAILS:
        inbox.free(found)
        return True
    status = NOT_READ
    try:
        if found.kind == GONE:
            raise pull.withdrawn(ch.peer, "before this receive took it")
        if found.nbytes != region.nbytes:
            if found.kind == PULL:
                status = region.nbytes
            raise size_mismatch(ch.peer, found.nbytes, region.nbytes)
        status = pull.read_into(t, ch, found, region, ready)
    finally:
        inbox.free(found, status)
    return False


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
        if flags.wait(ready, deadline, lambda: check_peer(t, ch), sleep=inbox.doze):
            return
    except BaseException:
        inbox.unpost(rec)  # nothing may land in the region once this receive has failed
        raise
    if not inbox.unpost(rec):
        # another thread took the message as the time ran out: it lands it at once
        flags.wait(lambda: rec.done, time.monotonic() + 1.0)
        if rec.done:
            return
    raise PeerTimeout([ch.peer], never_sent(ch.peer, rec.tag, rec.number))


def land(t: StagedTransport, ch: Channel, found: Found, rec: Posted) -> None:
    """Land a message or marker taken from the ring for the posted receive `rec`, free the
    slot and mark the receive done (its `error` set where it failed). A receive larger than
    a slot settles its marker (`settle`: a PULL message is read, a RAILS marker starts the
    receive over the rails, `rec.op`). An eager receive copies its message in; one of another
    size fails with the size-mismatch error, and a marker (its message is larger than any
    slot) fails its sender too: a RAILS marker by a clear-to-send of this size, a PULL marker
    by this size in its slot."""
    inbox = ch.eager_in
    assert inbox is not None
    region = rec.region
    if region.nbytes > inbox.slot_bytes:
        try:
            if settle(t, ch, found, region, rec.ready):
                t.paths["recv rails"] += 1
                ready = rails_ready(t, rec.ready)
                rec.op = t.messages.post_recv(
                    ch.peer, region, CTS_P2P, rec.tag, rec.number, rec.deadline, ready
                )
        except BaseException as exc:
            rec.error = exc
        finally:
            rec.done = True
        return
    status = NOT_READ
    try:
        if found.kind == RAILS:
            t.cts.send(ch.peer, CTS_P2P, rec.tag, rec.number, 0, region.nbytes)
            raise size_mismatch(ch.peer, found.nbytes, region.nbytes)
        if found.kind == PULL:
            status = region.nbytes
            raise size_mismatch(ch.peer, found.nbytes, region.nbytes)
        if found.kind == GONE:
            raise pull.withdrawn(ch.peer, "before this receive took it")
        if found.nbytes != region.nbytes:
            raise size_mismatch(ch.peer, found.nbytes, region.nbytes)
        if found.nbytes:
            if region.host is not None:
                inbox.get(found, region.host)
            else:
                inbox.seg.register_with_gpu(t.gpu.device)
                t.gpu.copy_from_address(region, inbox.address(found.slot), rec.ready)
        t.paths["recv eager"] += 1
    except BaseException as exc:
        rec.error = exc
    finally:
        inbox.free(found, status)
        rec.done = True


# ---- asynchronous receives: their Works ---------------------------------------------------------


def posted_work(
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
    """The Work of an asynchronous receive posted on the ring: whoever polls it (or any other
    receive from the peer) lands its message, or its marker if it is larger than a slot, once
    it is there; its waiter waits on the ring's words. A large one is watched by the
    transport's Watcher meanwhile (its sender may wait on it), and where its marker says
    RAILS it then waits for the receive over the rails (`rec.op`), completed by the thread
    that lands the last chunk. It fails with CommTimeout naming the sender at `deadline`, or
    when the transport closes."""
    if (
        region.host is not None
        and region.nbytes <= inbox.slot_bytes
        and inbox.receive(region.host.data, tag, k)
    ):
        t.paths["recv eager"] += 1
        work = completed(t.comm, "recv", seq)
        work.info = {"transport": "staged", "bytes": region.nbytes, "stages": 1}
        return work
    rec = Posted(region, tag, k, ready, deadline)
    found = inbox.post(rec)
    if found is not None:
        land(t, ch, found, rec)
    elif region.nbytes > inbox.slot_bytes:
        t.watcher.watch(ch, rec)
    else:
        t.watcher.start()  # its sweep lands the message where no thread polls this receive

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
                why = never_sent(ch.peer, tag, k)
                raise CommTimeout(t.comm.name, "recv", seq, t.timeout, [ch.peer], why)
            return False  # another thread is landing it
        if rec.error is not None:
            raise rec.error
        op = rec.op
        if op is None:
            return True
        if not op.done.is_set() and time.monotonic() < deadline:
            progress(t, ch, inbox)  # eager receives posted meanwhile may free the ring
            return False
        try:
            op.wait(deadline)  # past the deadline it does not block
        except PeerTimeout as exc:
            raise CommTimeout(t.comm.name, "recv", seq, t.timeout, exc.ranks, str(exc)) from None
        finally:
            t.messages.forget(op)
        return True

    def waiter(seconds: float) -> bool:
        if not rec.done:
            rec.waited = True  # the Watcher leaves it to this thread meanwhile
            try:
                return flags.wait(look, time.monotonic() + seconds, sleep=inbox.doze)
            finally:
                rec.waited = False
                if not rec.done and region.nbytes > inbox.slot_bytes:
                    t.watcher.resume()
        op = rec.op
        if op is None:
            return True
        return op.done.wait(min(seconds, WATCH_S))

    work = Work(t.comm, "recv", seq, poll, waiter=waiter)
    work.info = {"transport": "staged", "bytes": region.nbytes, "stages": 1}
    return work
