"""The staged transport's message: the building block of every staged operation that does not
go eager or as a PULL marker (eager.py, pull.py). A receive registers its array and sends the
sender a clear-to-send naming its op id (cts.py); the sender, once that has come, queues every
chunk of its array on the peer's rails (each rail takes the next chunk when it is free), and
both ends wait for their chunks. A send over shm may copy its first chunks into free shared
slots before the clear-to-send comes (EARLY_CHUNKS in transport.py)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import MismatchError
from .. import tags
from . import inline, links
from .ops import PeerTimeout, _Op, stamp
from .rails import ERROR_MPI, size_mismatch
from .schedule import chunk_spans

if TYPE_CHECKING:
    from ..local import Region
    from .channel import Channel
    from .transport import StagedTransport


class Messages:
    """The messages of one StagedTransport: posting, starting and finishing them."""

    def __init__(self, t: StagedTransport) -> None:
        self.t = t

    def post_recv(
        self,
        peer: int,
        region: Region,
        kind: int,
        k1: int,
        k2: int,
        deadline: float,
        ready: Any = None,
        driven: bool = False,
    ) -> _Op:
        """Register a receive into `region` and tell `peer` it may send. `driven`: this thread
        will wait for it to its end (finish_recv), so it moves the chunks itself where the
        pair's only rail is shm (inline.py)."""
        t = self.t
        ch = t.channel(peer, deadline) if peer != t.rank else None
        spans = chunk_spans(region.nbytes, t.chunk_bytes)
        op = _Op(peer, region, spans, ready=ready, left=len(spans))
        if ch is not None:
            t._count(len(spans))
            if driven and spans:
                inline.start(t, ch, op, False, deadline)
        op.key = op_id = next(t._op_ids)
        t.receives[op_id] = op
        if not spans:
            op.done.set()
        board = op.inline is not None and op.inline.board is not None
        t.cts.send(peer, kind, k1, k2, op_id, region.nbytes, board)
        stamp("cts sent")
        return op

    def start_send(
        self,
        peer: int,
        region: Region,
        kind: int,
        k1: int,
        k2: int,
        deadline: float,
        ready: Any = None,
        driven: bool = False,
    ) -> _Op:
        """Queue every chunk of a message on the peer's rails once `peer`'s clear-to-send is
        here: at once if it is; where it rings the shm doorbell, by the thread that files it
        (this one returns at once); else (over MPI) after waiting for it here. `driven`: this
        thread will wait for it to its end (finish_send), so it moves the chunks itself where
        the pair's only rail is shm (inline.py)."""
        t = self.t
        if peer == t.rank:
            return self._send_to_self(region, kind, k1, k2, deadline, ready)
        ch = t.channel(peer, deadline)
        spans = chunk_spans(region.nbytes, t.chunk_bytes)
        op = _Op(peer, region, spans, ready=ready, left=len(spans))
        t._count(len(spans))
        if driven and spans:
            inline.start(t, ch, op, True, deadline)
        self._stage_early(ch, op)
        entry = t.cts.take_or_register(ch, op, (peer, kind, k1, k2), deadline)
        if entry is not None:
            self.queue_send(ch, op, *entry)
        return op

    def finish_send(self, op: _Op, deadline: float) -> None:
        """Wait until every chunk of `op` has gone; a send that times out waiting for its
        clear-to-send is forgotten, so that a late one cannot start it."""
        t = self.t
        try:
            op.wait(deadline)
        except PeerTimeout:
            t.cts.unwait(op)
            raise
        finally:
            if op.inline is not None:
                op.inline.close()

    def _stage_early(self, ch: Channel, op: _Op) -> None:
        """Copy the first chunks of a send over shm into free shared slots now, without waiting
        for the receiver's clear-to-send: once it comes they are announced as their copies end
        (device data: up to early_chunks, the copy engine busy meanwhile; host data: the first
        chunk, copied here). Only where slots are free at once, and while the channel's sends
        that wait for their clear-to-send hold fewer than half of them."""
        t = self.t
        link = ch.doorbell()
        if link is None or ch.shm_out is None or t.early_chunks <= 0 or not op.spans:
            return
        host = op.region.host
        # host bytes are copied here, one chunk after the other, and none can be announced
        # before all are: more than one would delay the receiver's first chunk
        slots = ch.hold_early(min(t.early_chunks if host is None else 1, len(op.spans)))
        if not slots:
            return
        if host is None:
            ch.shm_out.register_with_gpu(t.gpu.device)
        for idx, slot in enumerate(slots):
            off, n = op.spans[idx]
            target = ch.shm_out.view(slot, n)
            if host is not None:
                np.copyto(target, host[off : off + n])
                event = None
            else:
                stamp("d2h call early", idx)
                event = t.gpu.copy_to_host_async(target, op.region.sub(off, n), op.ready)
            op.early.append((slot, event, (off, n)))
            stamp("d2h queued early", idx)

    def queue_send(
        self, ch: Channel, op: _Op, remote: int, expected: int, board: bool = False
    ) -> None:
        """The receiver's clear-to-send is here: queue every chunk of `op` on its rails (the
        early ones, in their slots already, are announced as their copies end). `board`: the
        receive looks for the chunks on the shm rail's board."""
        t = self.t
        stamp("chunks queued")
        op.remote, op.awaiting_cts, op.board = remote, False, board
        if expected != op.region.nbytes:
            exc = MismatchError(
                f"rank {t.rank} sends {op.region.nbytes} bytes, rank {op.peer} receives {expected}"
            )
            if op.early:
                ch.drop_early(op)
            self._notify_error(ch, remote, op.region.nbytes)
            op.fail(exc)
            return
        if not op.spans:
            op.done.set()
        if op.inline is not None:
            op.inline.clear()  # its thread takes the early chunks and the rest
            return
        early = ch.take_early(op) if op.early else []
        if early:
            link = ch.doorbell()
            assert link is not None  # early chunks are staged only where the shm rail rings
            t.count_bytes(link, sum(n for _, _, (_, n) in early))
            for idx, (slot, event, (off, n)) in enumerate(early):
                ch.announce_soon(event, link, slot, op, idx, off, n)
        for idx in range(len(early), len(op.spans)):
            ch.queue.put((op, idx, op.spans[idx]))

    def _send_to_self(
        self, region: Region, kind: int, k1: int, k2: int, deadline: float, ready: Any
    ) -> _Op:
        """A message to this very rank: one local copy into the matching receive."""
        t = self.t
        remote, expected, _ = t.cts.wait_for(t.rank, kind, k1, k2, deadline)
        op = _Op(t.rank, region, [], ready=ready)
        target = t.receives.get(remote)
        if expected != region.nbytes or target is None:
            exc = size_mismatch(t.rank, region.nbytes, expected)
            if target is not None:
                target.fail(exc)
            op.fail(exc)
            return op
        if region.nbytes:
            if region.host is not None and target.region.host is not None:
                np.copyto(target.region.host, region.host)
            else:
                t.gpu.copy_device(target.region, region, ready)
        for idx in range(len(target.spans)):
            target.count(idx)
        op.done.set()
        return op

    def _notify_error(self, ch: Channel, remote: int, nbytes: int) -> None:
        """Fail the peer's receive too, so that it does not wait for data that cannot come."""
        t = self.t
        for link in ch.links:
            with contextlib.suppress(links.RailError):
                link.send(links.ERROR, -1, remote, 0, 0, nbytes)
                return
        if ch.uses_mpi:
            t.svc.Send(
                np.array([ERROR_MPI, remote, 0, 0, nbytes], np.int64), ch.peer, tags.STAGED_HEAD
            )

    def finish_recv(self, op: _Op, deadline: float) -> None:
        """Wait until `deadline` for the receive `op`, then forget it."""
        try:
            op.wait(deadline)
        finally:
            self.forget(op)

    def forget(self, op: _Op) -> None:
        """Drop a finished receive from the ops that arriving chunks look up (the slots of an
        inline one go back)."""
        t = self.t
        if op.inline is not None:
            op.inline.close()
        # by its key, never a scan: other drivers add theirs meanwhile, and a scan that makes
        # objects (items()) may run the collector, let them in mid-way and raise
        # "dictionary changed size during iteration"
        t.receives.pop(op.key, None)
