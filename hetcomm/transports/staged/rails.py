"""The staged transport's rail threads: for each channel, the threads that send chunks over
each link, announce staged slots and hand them back, and receive and land chunks; the mpi
rail's receiving thread; a broken link's chunks moving to the other rails. StagedTransport
(staged.py) inherits them."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
from mpi4py import MPI

from ...errors import HetcommError, MismatchError
from .. import tags
from ..local import Region
from ..shm import SegmentError
from . import links
from .cts import _CTS_POLL_MAX_S, _CTS_POLL_S, ClearToSend
from .ops import _STOP, _Op, stamp

if TYPE_CHECKING:
    from .channel import Channel

log = logging.getLogger("hetcomm")

# kinds of the mpi rail's headers
DATA_MPI, ERROR_MPI, BYE_MPI = 1, 4, 5
# a device chunk this small is copied and waited for by the rail thread itself (a few
# microseconds), saving the hand-off to the thread that waits for longer copies
INLINE_COPY_BYTES = 256 << 10


class RailThreads(ClearToSend):
    """The rail threads of StagedTransport, which sets the attributes declared here."""

    rank: int
    svc: MPI.Intracomm
    timeout: float
    stats: dict[str, int]
    _closed: bool
    _gpu: Any
    _lock: threading.Lock
    _ops: dict[int, _Op]
    _stats_lock: threading.Lock
    _mpi_rail: threading.Thread | None

    def _send_loop(self, ch: Channel, link: links.Link | None) -> None:
        window = ch.windows.get(link.spec.index) if link is not None else None
        while True:
            if window is not None:
                assert link is not None
                with link.unacked_lock:
                    while len(link.unacked) >= window and link.alive and not self._closed:
                        link.unacked_lock.wait(0.05)
            item = ch.queue.get()
            if item is _STOP:
                ch.queue.put(_STOP)  # let the channel's other threads see it too
                return
            if link is not None and not link.alive:
                ch.queue.put(item)  # this rail is gone: leave the chunk to the others
                return
            op, idx, (off, n) = item
            if op.done.is_set():
                continue  # failed meanwhile
            try:
                if self._send_chunk(ch, link, op, idx, off, n):
                    op.count(idx)
                self._count_bytes(link, n)
            except (links.RailError, SegmentError) as exc:
                assert link is not None
                with link.unacked_lock:
                    link.unacked.pop((op.remote, idx), None)
                ch.queue.put(item)  # another rail takes it over
                self._rail_down(ch, link, exc)
                return
            except BaseException as exc:
                op.fail(exc)

    def _send_chunk(
        self, ch: Channel, link: links.Link | None, op: _Op, idx: int, off: int, n: int
    ) -> bool:
        """Send one chunk; False when a signaller thread finishes (and counts) it later."""
        src = op.region.sub(off, n)
        if link is None:  # the MPI rail
            head = np.array([DATA_MPI, op.remote, idx, off, n], dtype=np.int64)
            with self._staged(src, op) as payload:
                self.svc.Send(head, ch.peer, tags.STAGED_HEAD)
                self.svc.Send(payload, ch.peer, tags.STAGED_BODY)
            return True
        if link.spec.kind == "shm":
            assert ch.shm_out is not None
            slot = ch.shm_out.acquire(time.monotonic() + self.timeout, lambda: link.alive)
            stamp("slot taken", idx)
            try:
                target = ch.shm_out.view(slot, n)
                if src.host is not None:
                    np.copyto(target, src.host)
                else:
                    # queue the copy and move on: the signaller announces it once it is done,
                    # so the copy engine always has the next chunk waiting
                    ch.shm_out.register_with_gpu(self._gpu.device)
                    stamp("d2h call", idx)
                    event = self._gpu.copy_to_host_async(target, src, op.ready)
                    stamp("d2h queued", idx)
                    self._announce_soon(ch, event, link, slot, op, idx, off, n)
                    return False
                link.send(links.SLOT, slot, op.remote, idx, off, n)
            except BaseException:
                ch.shm_out.release(slot)
                raise
            return True
        with link.unacked_lock:
            link.unacked[(op.remote, idx)] = (op, idx, (off, n))
        with self._staged(src, op) as payload:
            link.send(links.DATA, -1, op.remote, idx, off, n, memoryview(payload))
        return False  # counted when the receiver acknowledges it

    def _count_bytes(self, link: links.Link | None, n: int) -> None:
        """Add `n` bytes sent to the statistics of `link`'s rail (None: the mpi rail)."""
        name = _rail_name(link)
        with self._stats_lock:
            self.stats[name] = self.stats.get(name, 0) + n

    def _serve(self, items: queue.Queue[Any], handle: Callable[..., None]) -> None:
        """The loop of a signaller or completer thread: `handle(*item)` for each item queued,
        until _STOP."""
        while True:
            item = items.get()
            if item is _STOP:
                return
            handle(*item)

    def _announce_soon(
        self,
        ch: Channel,
        event: Any,
        link: links.Link,
        slot: int,
        op: _Op,
        idx: int,
        off: int,
        n: int,
    ) -> None:
        """Announce a chunk staged into a shared slot: from this thread where its copy is done
        (host bytes, `event` None, or a device copy that has ended already) or short, else by
        the signaller thread once it has ended, so that this one goes on to the next chunk.

        An early chunk's copy has often ended by the time the clear-to-send comes: handing it
        to the signaller then only delayed the receiver's first copy by a thread switch (on
        the H200, 60-300 us of a 256 MiB send/recv)."""
        item = (event, link, slot, op, idx, off, n)
        if event is None or _short(n, op) or bool(event.done):
            self._announce(*item)
        else:
            ch.signals().put(item)

    def _announce(
        self, event: Any, link: links.Link, slot: int, op: _Op, idx: int, off: int, n: int
    ) -> None:
        """Once a chunk's copy into its slot has finished, tell the receiver where it is."""
        try:
            if event is not None:  # None: host bytes, copied already
                event.synchronize()
            stamp("d2h done", idx)
            link.send(links.SLOT, slot, op.remote, idx, off, n)
            op.count(idx)
        except BaseException as exc:
            op.fail(exc)

    def _hand_back(
        self, event: Any, link: links.Link, slot: int, op: _Op, op_id: int, idx: int
    ) -> None:
        """Once a chunk's copy out of its slot has finished, count it and give the slot back."""
        try:
            if event is not None:
                event.synchronize()
            stamp("h2d done", idx)
        except BaseException as exc:
            op.fail(exc)
            return
        op.count(idx)
        self._reply(link, links.FREE, slot, op_id, idx)

    def _reply(self, link: links.Link, kind: int, slot: int, op_id: int, idx: int) -> None:
        """Hand a slot back (FREE) or acknowledge a chunk (ACK). A sender that has closed its
        transport (its sends complete once their chunks have gone) needs neither, and its
        socket may be closed while this rank still lands what it sent: that failure is not
        the rail's, whose reads go on to the sender's BYE (a rail that really broke fails
        there)."""
        try:
            link.send(kind, slot, op_id, idx, 0, 0)
        except links.RailError as exc:
            log.debug(
                "rank %d: no reply to rank %d over %s (%s)", self.rank, link.peer, link.spec, exc
            )

    @contextlib.contextmanager
    def _staged(self, src: Region, op: _Op) -> Any:
        """Host bytes of `src`: the caller's memory itself, or a pinned copy of device data."""
        if src.host is not None:
            yield src.host
            return
        with self._gpu.bounce(src.nbytes) as staging:
            self._gpu.copy_to_host(staging, src, op.ready)
            yield staging

    def _recv_loop(self, ch: Channel, link: links.Link) -> None:
        # until the peer's BYE or a failed read: a failed send (a reply to a peer that has
        # closed) leaves the link dead for sending while what the peer sent is still to read
        while True:
            try:
                kind, slot, op_id, idx, off, n = link.recv_header()
                if kind == links.FREE:
                    assert ch.shm_out is not None
                    ch.shm_out.release(slot)
                    continue
                if kind == links.ACK:
                    with link.unacked_lock:
                        acked = link.unacked.pop((op_id, idx), None)
                        link.unacked_lock.notify_all()
                    if acked is not None:
                        acked[0].count(idx)
                    continue
                if kind == links.BYE:
                    link.alive = False
                    self._wake_senders()
                    return
                if kind == links.CTS:  # slot: the kind; chunk, offset: its two keys
                    self._file_cts(ch.peer, slot, idx, off, op_id, n)
                    continue
                op = self._ops.get(op_id)
                if kind == links.ERROR:
                    if op is not None:
                        op.fail(_size_mismatch(ch.peer, n, op.region.nbytes))
                    continue
                if kind == links.DATA:
                    self._land(link, op, idx, off, n)
                    self._reply(link, links.ACK, -1, op_id, idx)
                elif kind == links.SLOT:
                    assert ch.shm_in is not None
                    if op is not None and not op.done.is_set() and op.region.host is None:
                        stamp("slot got", idx)
                        ch.shm_in.register_with_gpu(self._gpu.device)
                        event = self._gpu.copy_from_host_async(
                            op.region.sub(off, n), ch.shm_in.view(slot, n), op.ready
                        )
                        stamp("h2d queued", idx)
                        item = (event, link, slot, op, op_id, idx)
                        if _short(n, op):
                            self._hand_back(*item)  # a short copy: no hand-off
                        else:
                            ch.completions().put(item)
                        continue
                    if op is not None and not op.done.is_set():
                        self._deliver(op, off, ch.shm_in.view(slot, n))
                        op.count(idx)
                    self._reply(link, links.FREE, slot, op_id, idx)
            except (links.RailError, SegmentError) as exc:
                if not self._closed:
                    self._rail_down(ch, link, exc)
                link.alive = False
                return
            except BaseException as exc:
                log.error("rank %d: receiving from rank %d failed: %s", self.rank, ch.peer, exc)
                self._rail_down(ch, link, exc)
                return

    def _rail_down(self, ch: Channel, link: links.Link, exc: BaseException) -> None:
        """A link broke: its unacknowledged chunks go back to the other rails, or, with no
        rail left, every operation with that peer fails naming each rail's error."""
        link.alive = False
        with link.unacked_lock:
            pending = list(link.unacked.values())
            link.unacked.clear()
        with self._stats_lock:
            known = any(str(link.spec) in d for d in ch.dead)
            if not known:
                ch.dead.append(f"{link.spec}: {exc}")
        self._wake_senders()  # a sender waiting on this link's doorbell fails now, naming it
        if known:
            return
        log.warning(
            "rank %d: rail %s to rank %d failed (%s); its chunks move to the other rails",
            self.rank,
            link.spec,
            ch.peer,
            exc,
        )
        for item in pending:
            if not item[0].done.is_set():
                ch.queue.put(item)
        if not ch.alive():
            self._fail_channel(
                ch, HetcommError(f"every rail to rank {ch.peer} failed: " + "; ".join(ch.dead))
            )

    def _land(self, link: links.Link, op: _Op | None, idx: int, off: int, n: int) -> None:
        if op is None or op.done.is_set():
            link.recv_into(memoryview(bytearray(n)))  # drain a chunk nobody waits for
            return
        dest = op.region.sub(off, n)
        if dest.host is not None:
            link.recv_into(memoryview(dest.host))  # type: ignore[arg-type]
        else:
            with self._gpu.bounce(n) as staging:
                link.recv_into(memoryview(staging))
                self._gpu.copy_from_host(dest, staging, op.ready)
        op.count(idx)

    def _deliver(self, op: _Op, off: int, data: np.ndarray) -> None:
        dest = op.region.sub(off, len(data))
        if dest.host is not None:
            np.copyto(dest.host, data)
        else:
            self._gpu.copy_from_host(dest, data, op.ready)

    def _mpi_recv_loop(self) -> None:
        """One thread receives the mpi rail's chunks from every peer (head, then its body)."""
        head = np.zeros(5, dtype=np.int64)
        status = MPI.Status()
        while True:
            # close() ends it with a BYE sent to this very rank, so no thread is left inside
            # MPI when the process finalizes it. Polled, not a blocking receive: that would
            # keep a core spinning for as long as the rail is idle
            request = self.svc.Irecv(head, source=MPI.ANY_SOURCE, tag=tags.STAGED_HEAD)
            pause = _CTS_POLL_S
            while not request.Test(status):
                time.sleep(pause)
                pause = min(2 * pause, _CTS_POLL_MAX_S)
            peer = status.Get_source()
            kind, op_id, idx, off, n = (int(v) for v in head)
            if kind == BYE_MPI:
                if peer == self.rank:
                    return
                continue
            op = self._ops.get(op_id)
            if kind == ERROR_MPI:
                if op is not None:
                    op.fail(_size_mismatch(peer, n, op.region.nbytes))
                continue
            if op is None or op.done.is_set():
                self.svc.Recv(np.empty(n, np.uint8), source=peer, tag=tags.STAGED_BODY)
                continue
            dest = op.region.sub(off, n)
            if dest.host is not None:
                self.svc.Recv(dest.host, source=peer, tag=tags.STAGED_BODY)
            else:
                with self._gpu.bounce(n) as staging:
                    self.svc.Recv(staging, source=peer, tag=tags.STAGED_BODY)
                    self._gpu.copy_from_host(dest, staging, op.ready)
            op.count(idx)

    def _start_mpi_rail(self) -> None:
        with self._lock:
            if self._mpi_rail is None:
                self._mpi_rail = threading.Thread(
                    target=self._mpi_recv_loop, daemon=True, name="hetcomm-mpi-rail"
                )
                self._mpi_rail.start()

    def _fail_channel(self, ch: Channel, exc: BaseException) -> None:
        for op in list(self._ops.values()):
            if op.peer == ch.peer:
                op.fail(exc)
        while True:
            try:
                item = ch.queue.get_nowait()
            except queue.Empty:
                break
            if item is not _STOP:
                item[0].fail(exc)


def _short(n: int, op: _Op) -> bool:
    """Whether a rail thread may wait for a chunk's copy itself: a small one that waits for
    nothing the caller queued before (else it could hold the link for as long as that runs)."""
    return n <= INLINE_COPY_BYTES and (op.ready is None or bool(op.ready.done))


def _size_mismatch(peer: int, sent: int, expected: int) -> MismatchError:
    return MismatchError(
        f"receive from rank {peer}: the sender has {sent} bytes, this receive takes {expected}"
    )


def _rail_name(link: links.Link | None) -> str:
    return "mpi" if link is None else str(link.spec)
