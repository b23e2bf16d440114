"""The staged transport's prepared sends and receives (hetcomm.routes.Route): the blocking
ones of host arrays run on the calling thread with no Work (eager through the pair's ring
where the peer shares this host and the message fits a slot, else p2p's path, still on this
thread), those of device arrays p2p's path on the calling thread after an event on the
caller's stream; the asynchronous ones of host arrays start the general path's message on the
array itself, without its Buffer and checks. Once they run they number their message as the
general path would and run it to its end."""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import numpy as np

from ...errors import PeerLost
from ...work import Work, completed
from ..local import Region, flat_bytes
from . import p2p, starts
from .ops import PeerTimeout

if TYPE_CHECKING:
    from ...arrays import Buffer
    from ...ops import ReduceOp
    from .transport import StagedTransport


def prepare(
    t: StagedTransport,
    op: str,
    x: Buffer | None,
    out: Buffer | None,
    rop: ReduceOp | None,
    root: int,
) -> Callable[..., bool] | None:
    """StagedTransport.prepare: sends, receives and the sendrecv of two host arrays here,
    collectives where segment.py prepares them, None for the rest."""
    if op in ("send", "recv"):
        if x is None:
            return None
        if x.host is None:
            return _device_p2p(t, op, x)
        return partial(run_send if op == "send" else run_recv, t)
    if op == "sendrecv":
        if x is None or out is None or x.host is None or out.host is None:
            return None
        return partial(run_exchange, t)
    if op == "barrier":
        return None
    from . import segment

    return segment.prepare(t, op, x, out, rop, root)


def prepare_async(
    t: StagedTransport,
    op: str,
    x: Buffer | None,
    out: Buffer | None,
    rop: ReduceOp | None,
    root: int,
) -> Callable[..., Work] | None:
    """StagedTransport.prepare_async: the start of a send or receive of a host array here,
    collectives where segment.py prepares them, None for the rest."""
    if op in ("send", "recv"):
        if x is None or x.host is None:
            return None
        return partial(start_send if op == "send" else start_recv, t)
    from . import segment

    return segment.prepare_async(t, op, x, out, rop, root)


def start_send(t: StagedTransport, xh: np.ndarray, dst: int, tag: int, seq: int) -> Work:
    """The asynchronous send of a host array: complete at once where it went into the ring's
    next slot (_eager), else the general path's message (in the same ticket's turn), its
    Work."""
    k = t._p2p_number("send", dst, tag)
    sent, ticket = _eager(t, xh, dst, tag, k)
    if sent:
        work = completed(t.comm, "send", seq)
        work.info = {"transport": "staged", "bytes": xh.nbytes, "stages": 1}
        return work
    return starts.send_start(t, host_region(xh), dst, tag, k, seq, None, [], ticket)


def start_recv(t: StagedTransport, xh: np.ndarray, src: int, tag: int, seq: int) -> Work:
    """The asynchronous receive into a host array: the general path's start (posted on the
    pair's ring where its channel is open), its Work."""
    k = t._p2p_number("recv", src, tag)
    work = starts.recv_start(t, host_region(xh), src, tag, k, seq, None, [])
    work.source = src
    return work


def run_send(t: StagedTransport, xh: np.ndarray, dst: int, tag: int, seq: int) -> bool:
    """The prepared blocking send of a host array: into the ring's next slot where it can go
    there at once (_eager), else p2p.send (in the same ticket's turn)."""
    k = t._p2p_number("send", dst, tag)
    sent, ticket = _eager(t, xh, dst, tag, k)
    if sent:
        return True
    try:
        deadline = time.monotonic() + t.limit()
        p2p.send(t, host_region(xh), dst, tag, k, deadline, None, ticket=ticket)
    except (PeerTimeout, PeerLost) as exc:
        raise t._fatal("send", seq, exc) from None
    return True


def run_exchange(
    t: StagedTransport,
    xh: np.ndarray,
    dst: int,
    tag: int,
    oh: np.ndarray,
    src: int,
    recv_tag: int,
    seq: int,
) -> bool:
    """The prepared sendrecv of two host arrays: the send into the ring at once where it fits
    (_eager), else started (the general path's start, in the same ticket's turn); then the
    receive run on this thread (run_recv); then the send waited for. The send never holds
    this thread, so two ranks exchanging cannot wait on each other."""
    k = t._p2p_number("send", dst, tag)
    sent, ticket = _eager(t, xh, dst, tag, k)
    started = None
    if not sent:
        started = starts.send_start(t, host_region(xh), dst, tag, k, seq, None, [], ticket)
    run_recv(t, oh, src, recv_tag, seq)
    if started is not None:
        started.wait(t.comm.call_timeout)
    return True


def _eager(
    t: StagedTransport, xh: np.ndarray, dst: int, tag: int, k: int
) -> tuple[bool, int | None]:
    """Send message `k` of (`dst`, `tag`) through the pair's ring where it fits a slot and the
    ring's next slot is free now (EagerOut.send). Returns whether it went, and the ticket
    drawn for its place among the sends that take slots (None where it does not fit the
    ring): a send that did not go keeps it."""
    ch = t._channels.get(dst)
    out = ch.eager_out if ch is not None else None
    if out is None or not 0 < xh.nbytes <= out.slot_bytes or t.closed:
        return False, None
    ticket = out.ticket()
    if out.send(xh.data.cast("B"), tag, k, ticket):
        t.paths["send eager"] += 1
        return True, ticket
    return False, ticket


def run_recv(t: StagedTransport, xh: np.ndarray, src: int, tag: int, seq: int) -> bool:
    """The prepared blocking receive into a host array: from the ring on this thread where
    the message fits a slot (p2p.wait_eager), else p2p.recv."""
    k = t._p2p_number("recv", src, tag)
    ch = t._channels.get(src)
    inbox = ch.eager_in if ch is not None else None
    try:
        deadline = time.monotonic() + (t.comm.call_timeout or t.timeout)  # t.limit(), inline
        if (
            ch is not None
            and inbox is not None
            and 0 < xh.nbytes <= inbox.slot_bytes
            and not t.closed
        ):
            p2p.wait_eager(t, ch, inbox, xh.data.cast("B"), tag, k, deadline)
        else:
            p2p.recv(t, host_region(xh), src, tag, k, deadline, None)
    except (PeerTimeout, PeerLost) as exc:
        raise t._fatal("recv", seq, exc) from None
    return True


def _device_p2p(t: StagedTransport, op: str, x: Buffer) -> Callable[..., bool] | None:
    """The prepared blocking send or receive of device memory, `run(ptr, peer, tag, seq)`
    with `ptr` the array's device address (routes.device_view): p2p's message on the calling
    thread, as the general path runs it, with no Buffer or Work per call. None where the
    general path takes every call: empty arrays, array types whose current stream is not
    known here."""
    from ...kernels.device import stream_reader

    if not x.count:
        return None
    stream = stream_reader(x.kind, x.device_index)
    if stream is None:
        return None
    move = p2p.send if op == "send" else p2p.recv
    return partial(run_device, t, op, move, x.nbytes, x.device_index, stream)


def run_device(
    t: StagedTransport,
    op: str,
    move: Callable[..., None],
    nbytes: int,
    index: int | None,
    stream: Callable[[], int],
    ptr: int,
    peer: int,
    tag: int,
    seq: int,
) -> bool:
    """One prepared device send or receive (`move`: p2p.send or p2p.recv) of `nbytes` at
    `ptr`, after the work queued so far on the caller's stream; a receive's copy out has
    ended when this returns. Its copies go on the caller's stream itself where this thread,
    or the one that lands its message while it waits, makes them (StagingDevice.on_stream;
    p2p turns it into an event where the rails' threads take the message). False (nothing
    moved, no message numbered) where the general path must take it: a message to or from
    this rank, an array on another device than the transport's."""
    if peer == t.rank:
        return False
    gpu = t.staging()
    if index != gpu.device:
        return False
    ready = gpu.on_stream(stream())
    k = t._p2p_number(op, peer, tag)
    try:
        deadline = time.monotonic() + t.limit()
        move(t, Region(nbytes, None, ptr), peer, tag, k, deadline, ready)
    except (PeerTimeout, PeerLost) as exc:
        raise t._fatal(op, seq, exc) from None
    return True


def host_region(xh: np.ndarray) -> Region:
    """The bytes of a contiguous host array, as the Region its prepared calls move."""
    return Region(xh.nbytes, flat_bytes(xh))
