"""A staged channel: everything joining this rank to one peer, and the threads that serve it.

A channel owns its rails' links, the shm rail's shared slots (and the ones its sends hold
early), its queue of chunks to send, and its threads:
- one sender per link (two on the shm rail, so that one stages while the other signals) and
  one for the mpi rail: each takes the next chunk from `queue` and sends it (`_send_loop`);
- one reader per link: lands chunks, files clear-to-sends, takes slots and acknowledgements
  back (`_recv_loop`);
- a signaller, started on first use: announces device chunks once their copy into a slot has
  ended (`signals`, `announce`); a completer: hands slots back once their copy out has ended
  (`completions`, `hand_back`).
A message that the thread waiting for it moves itself over a shm-only channel (inline.py) uses
none of them: the reader only files its clear-to-send and its slots for that thread.
Fields set at opening are read by every thread; `early` and the two queues' creation are
guarded by `_lock`, `dead` and `dozers` by `_lock` too; a link's `unacked` by its own lock.
Where the pair has boards (board.py), a receive moved by the thread that waits for it finds
its chunks on the board at the end of the sender's slot segment, not through the reader. The
transport (transport.py) opens, starts, stops and releases channels; the clear-to-send
bookkeeping (cts.py) is shared with it; the mpi rail's one receiving thread is rails.MpiRail.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ...errors import PeerLost
from .. import tags
from ..local import Region
from ..shm import SegmentError, SharedSlots
from . import links
from .board import REAP, BoardIn, BoardOut
from .eager import EagerIn, EagerOut
from .ops import _STOP, _Op, stamp
from .rails import DATA_MPI, short, size_mismatch
from .schedule import rail_key, rail_windows

if TYPE_CHECKING:
    from .cts import ClearToSend
    from .rails import MpiRail

log = logging.getLogger("hetcomm")

SHM_LANES = 2  # threads feeding one shm rail, so that one stages while the other signals


class Owner(Protocol):
    """What a channel uses of the transport that opened it (StagedTransport)."""

    rank: int
    svc: Any
    #: seconds a sender waits for a free shared slot
    timeout: float
    #: the transport has closed: senders stop waiting for rail windows
    closed: bool
    #: the staging device (kernels.device.StagingDevice), made before device chunks move
    gpu: Any
    #: receives in flight by op id, where arriving chunks land
    receives: dict[int, _Op]
    #: tuned rail weights (rail key -> share), for the tcp rails' windows
    rail_weights: dict[str, float]
    mpi_rail: MpiRail

    def count_bytes(self, link: links.Link | None, n: int) -> None:
        """Add `n` bytes sent to the statistics of `link`'s rail (None: the mpi rail)."""
        ...


class Channel:
    """The rails to one peer, their threads and the shm rail's shared slots."""

    def __init__(
        self,
        owner: Owner,
        cts: ClearToSend,
        peer: int,
        specs: list[links.RailSpec],
    ) -> None:
        # set here, read by every thread of the channel
        self.owner, self.cts, self.peer, self.specs = owner, cts, peer, specs
        self.rank, self.svc = owner.rank, owner.svc
        self.uses_mpi = any(s.kind == "mpi" for s in specs)
        # tcp rail index -> chunks it may hold unacknowledged (tuned rail weights), else no limit
        keys = [rail_key(s) for s in specs]
        self.windows = {
            s.index: w
            for s, w in zip(specs, rail_windows(keys, owner.rail_weights))
            if w is not None and s.kind == "tcp"
        }
        # set while the channel opens (transport.py), before its threads start
        self.links: list[links.Link] = []
        self.shm_out: SharedSlots | None = None
        self.shm_in: SharedSlots | None = None
        # the boards at the end of the two slot segments (board.py): None where they have none
        self.board_out: BoardOut | None = None
        self.board_in: BoardIn | None = None
        # the eager rings of the pair (eager.py): None where the pair shares no host
        self.eager_out: EagerOut | None = None
        self.eager_in: EagerIn | None = None
        # chunks to send: put by the transport, taken by the sender threads
        self.queue: queue.Queue[Any] = queue.Queue()
        self.threads: list[threading.Thread] = []
        self._signals: queue.Queue[Any] | None = None
        self._completions: queue.Queue[Any] | None = None
        self._lock = threading.Lock()  # the two queues' creation, `early`, `dead`, `dozers`
        self.early = 0  # shared slots held by sends still waiting for their clear-to-send
        # sends moved by their own thread (inline.Inline), woken when a slot comes back
        self.inline_sends: list[Any] = []
        # the threads (inline.Driver) dozing on a board of the channel, woken by the peer's WAKE
        self.dozers: set[Any] = set()
        self.dead: list[str] = []  # why each rail that failed did

    def boards(self) -> None:
        """Make the boards of the two slot segments where they have words (connect.py); a board
        rings the peer over the shm rail's socket."""
        link = self.doorbell()
        out, into = self.shm_out, self.shm_in
        if link is None or out is None or into is None or out.words is None or into.words is None:
            return
        self.board_out = BoardOut(out.words, out.slots)
        self.board_in = BoardIn(into.words, into.slots)
        out.reaper = self.board_out

        def ring(kind: int, slot: int) -> None:
            self._reply(link, kind, slot, 0, 0)

        self.board_out.ring = self.board_in.ring = ring

    def dozing(self, driver: Any, on: bool) -> None:
        """Count `driver` among the threads dozing on a board of the channel (on), or not."""
        with self._lock:
            if on:
                self.dozers.add(driver)
            else:
                self.dozers.discard(driver)

    def post_slot(self, link: links.Link, op: _Op, slot: int, idx: int, off: int, n: int) -> None:
        """Tell the receiver that chunk `idx` of `op` lies in `slot`: on the board where its
        receive looks there (op.board), else over the socket. A send moved by its waiting
        thread (op.inline) looks for the slot's return on the board itself; the receiver rings
        for any other."""
        board = self.board_out
        if op.board and board is not None:
            if board.publish(slot, op.remote, idx, off, n, op.inline is not None):
                self._reply(link, links.WAKE, 0, 0, 0)
            return
        link.send(links.SLOT, slot, op.remote, idx, off, n)

    def start(self) -> None:
        """Start a sender thread per lane and a receiver per link (and the mpi rail's sender)."""
        for link in self.links:
            lanes = SHM_LANES if link.spec.kind == "shm" else 1
            for _ in range(lanes):
                self._thread(self._send_loop, link)
            self._thread(self._recv_loop, link)
        if self.uses_mpi:
            self._thread(self._send_loop, None)
            self.owner.mpi_rail.start()

    def _thread(self, fn: Callable[..., None], *args: Any) -> None:
        t = threading.Thread(
            target=fn, args=args, daemon=True, name=f"hetcomm-rail-{self.rank}-{self.peer}"
        )
        t.start()
        self.threads.append(t)

    def alive(self) -> bool:
        """Whether any rail to the peer still works."""
        return self.uses_mpi or any(link.alive for link in self.links)

    def doorbell(self) -> links.Link | None:
        """The shm rail's link, which carries clear-to-sends between the two ranks; None."""
        for link in self.links:
            if link.spec.kind == "shm":
                return link
        return None

    def signals(self) -> queue.Queue[Any]:
        """The queue of the signaller thread (device chunks going out over shm: each announced
        once its copy into a slot has finished), started once."""
        with self._lock:
            if self._signals is None:
                self._signals = queue.Queue()
                self._thread(_serve, self._signals, self.announce)
            return self._signals

    def completions(self) -> queue.Queue[Any]:
        """The queue of the completer thread (device chunks coming in over shm: each slot handed
        back once its copy out has finished), started once."""
        with self._lock:
            if self._completions is None:
                self._completions = queue.Queue()
                self._thread(_serve, self._completions, self.hand_back)
            return self._completions

    # ---- early chunks: slots a send fills before its clear-to-send comes ---------------------

    def hold_early(self, wanted: int) -> list[int]:
        """Up to `wanted` free shared slots, taken without waiting, for a send's early chunks;
        none once the sends that wait for their clear-to-send hold half the slots, so the sends
        already cleared always have the other half to go on with."""
        assert self.shm_out is not None
        with self._lock:
            room = min(wanted, self.shm_out.slots // 2 - self.early)
            slots = self.shm_out.try_acquire(room) if room > 0 else []
            self.early += len(slots)
        return slots

    def take_early(self, op: _Op) -> list[tuple[int, Any, tuple[int, int]]]:
        """The early chunks of `op`, taken (by whoever gets them first) and no longer counted
        against the channel's half of the slots."""
        with self._lock:
            early, op.early = op.early, []
            self.early -= len(early)
        return early

    def drop_early(self, op: _Op) -> None:
        """Give back the slots of a send's early chunks that never went (their copies end
        first)."""
        assert self.shm_out is not None
        for slot, event, _ in self.take_early(op):
            if event is not None:
                with contextlib.suppress(Exception):
                    event.synchronize()
            self.shm_out.release(slot)

    # ---- the sender threads ------------------------------------------------------------------

    def _send_loop(self, link: links.Link | None) -> None:
        window = self.windows.get(link.spec.index) if link is not None else None
        while True:
            if window is not None:
                assert link is not None
                with link.unacked_lock:
                    while len(link.unacked) >= window and link.alive and not self.owner.closed:
                        link.unacked_lock.wait(0.05)
            item = self.queue.get()
            if item is _STOP:
                self.queue.put(_STOP)  # let the channel's other threads see it too
                return
            if link is not None and not link.alive:
                self.queue.put(item)  # this rail is gone: leave the chunk to the others
                return
            op, idx, (off, n) = item
            if op.done.is_set():
                continue  # failed meanwhile
            try:
                # counted before the chunk goes: a tcp rail's acknowledgement, read on another
                # thread, may complete the send before this thread runs on, and a caller that
                # reads the statistics when its send returns must find every chunk in them
                self.owner.count_bytes(link, n)
                try:
                    sent = self._send_chunk(link, op, idx, off, n)
                except BaseException:
                    self.owner.count_bytes(link, -n)  # not sent over this rail after all
                    raise
                if sent:
                    op.count(idx)
            except (links.RailError, SegmentError) as exc:
                assert link is not None
                with link.unacked_lock:
                    link.unacked.pop((op.remote, idx), None)
                self.queue.put(item)  # another rail takes it over
                self._rail_down(link, exc)
                return
            except BaseException as exc:
                op.fail(exc)

    def _send_chunk(self, link: links.Link | None, op: _Op, idx: int, off: int, n: int) -> bool:
        """Send one chunk; False when a signaller thread finishes (and counts) it later."""
        src = op.region.sub(off, n)
        gpu = self.owner.gpu
        if link is None:  # the MPI rail
            head = np.array([DATA_MPI, op.remote, idx, off, n], dtype=np.int64)
            with self._staged(src, op) as payload:
                self.svc.Send(head, self.peer, tags.STAGED_HEAD)
                self.svc.Send(payload, self.peer, tags.STAGED_BODY)
            return True
        if link.spec.kind == "shm":
            assert self.shm_out is not None
            slot = self.shm_out.acquire(time.monotonic() + self.owner.timeout, lambda: link.alive)
            stamp("slot taken", idx)
            try:
                target = self.shm_out.view(slot, n)
                if src.host is not None:
                    np.copyto(target, src.host)
                else:
                    # queue the copy and move on: the signaller announces it once it is done,
                    # so the copy engine always has the next chunk waiting
                    self.shm_out.register_with_gpu(gpu.device)
                    stamp("d2h call", idx)
                    event = gpu.copy_to_host_async(target, src, op.ready)
                    stamp("d2h queued", idx)
                    self.announce_soon(event, link, slot, op, idx, off, n)
                    return False
                self.post_slot(link, op, slot, idx, off, n)
            except BaseException:
                self.shm_out.release(slot)
                raise
            return True
        with link.unacked_lock:
            link.unacked[(op.remote, idx)] = (op, idx, (off, n))
        with self._staged(src, op) as payload:
            link.send(links.DATA, -1, op.remote, idx, off, n, memoryview(payload))
        return False  # counted when the receiver acknowledges it

    @contextlib.contextmanager
    def _staged(self, src: Region, op: _Op) -> Any:
        """Host bytes of `src`: the caller's memory itself, or a pinned copy of device data."""
        if src.host is not None:
            yield src.host
            return
        gpu = self.owner.gpu
        with gpu.bounce(src.nbytes) as staging:
            gpu.copy_to_host(staging, src, op.ready)
            yield staging

    def announce_soon(
        self, event: Any, link: links.Link, slot: int, op: _Op, idx: int, off: int, n: int
    ) -> None:
        """Announce a chunk staged into a shared slot: from this thread where its copy is done
        (host bytes, `event` None, or a device copy that has ended already) or short, else by
        the signaller thread once it has ended, so that this one goes on to the next chunk.

        An early chunk's copy has often ended by the time the clear-to-send comes: handing it
        to the signaller then only delayed the receiver's first copy by a thread switch (on
        the H200, 60-300 us of a 256 MiB send/recv)."""
        item = (event, link, slot, op, idx, off, n)
        if event is None or short(n, op) or bool(event.done):
            self.announce(*item)
        else:
            self.signals().put(item)

    def announce(
        self, event: Any, link: links.Link, slot: int, op: _Op, idx: int, off: int, n: int
    ) -> None:
        """Once a chunk's copy into its slot has finished, tell the receiver where it is."""
        try:
            if event is not None:  # None: host bytes, copied already
                event.synchronize()
            stamp("d2h done", idx)
            self.post_slot(link, op, slot, idx, off, n)
            op.count(idx)
        except BaseException as exc:
            op.fail(exc)

    # ---- the reader threads ------------------------------------------------------------------

    def _recv_loop(self, link: links.Link) -> None:
        # until the peer's BYE or a failed read: a failed send (a reply to a peer that has
        # closed) leaves the link dead for sending while what the peer sent is still to read
        receives = self.owner.receives
        while True:
            try:
                kind, slot, op_id, idx, off, n = link.recv_header()
                if kind == links.FREE:
                    assert self.shm_out is not None
                    if slot == REAP:  # slots came back on the board
                        self.shm_out.reap()
                    else:
                        self.shm_out.release(slot)
                    for waiting in list(self.inline_sends):
                        waiting.driver.wake.set()
                    continue
                if kind == links.WAKE:
                    with self._lock:
                        dozing = list(self.dozers)
                    for d in dozing:
                        d.wake.set()
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
                    self.cts.wake_senders()
                    return
                if kind == links.CTS:  # slot: the kind; chunk, offset: its two keys
                    self.cts.file(self.peer, slot, idx, off, op_id, n)
                    continue
                op = receives.get(op_id)
                if kind == links.ERROR:
                    if op is not None:
                        op.fail(size_mismatch(self.peer, n, op.region.nbytes))
                    continue
                if kind == links.DATA:
                    self._land(link, op, idx, off, n)
                    self._reply(link, links.ACK, -1, op_id, idx)
                elif kind == links.SLOT:
                    assert self.shm_in is not None
                    if op is not None and op.inline is not None:
                        # its own thread copies it out; a receive given up hands it back
                        if op.done.is_set() or not op.inline.arrive(slot, idx, off, n):
                            self._reply(link, links.FREE, slot, op_id, idx)
                        continue
                    if op is not None and not op.done.is_set() and op.region.host is None:
                        gpu = self.owner.gpu
                        stamp("slot got", idx)
                        self.shm_in.register_with_gpu(gpu.device)
                        event = gpu.copy_from_host_async(
                            op.region.sub(off, n), self.shm_in.view(slot, n), op.ready
                        )
                        stamp("h2d queued", idx)
                        item = (event, link, slot, op, op_id, idx)
                        if short(n, op):
                            self.hand_back(*item)  # a short copy: no hand-off
                        else:
                            self.completions().put(item)
                        continue
                    if op is not None and not op.done.is_set():
                        self._deliver(op, off, self.shm_in.view(slot, n))
                        op.count(idx)
                    self._reply(link, links.FREE, slot, op_id, idx)
            except (links.RailError, SegmentError) as exc:
                if not self.owner.closed:
                    self._rail_down(link, exc)
                link.alive = False
                return
            except BaseException as exc:
                log.error("rank %d: receiving from rank %d failed: %s", self.rank, self.peer, exc)
                self._rail_down(link, exc)
                return

    def hand_back(
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

    def _land(self, link: links.Link, op: _Op | None, idx: int, off: int, n: int) -> None:
        if op is None or op.done.is_set():
            link.recv_into(memoryview(bytearray(n)))  # drain a chunk nobody waits for
            return
        dest = op.region.sub(off, n)
        if dest.host is not None:
            link.recv_into(memoryview(dest.host))  # type: ignore[arg-type]
        else:
            gpu = self.owner.gpu
            with gpu.bounce(n) as staging:
                link.recv_into(memoryview(staging))
                gpu.copy_from_host(dest, staging, op.ready)
        op.count(idx)

    def _deliver(self, op: _Op, off: int, data: np.ndarray) -> None:
        dest = op.region.sub(off, len(data))
        if dest.host is not None:
            np.copyto(dest.host, data)
        else:
            self.owner.gpu.copy_from_host(dest, data, op.ready)

    # ---- failures and the end ----------------------------------------------------------------

    def _rail_down(self, link: links.Link, exc: BaseException) -> None:
        """A link broke: its unacknowledged chunks go back to the other rails, or, with no
        rail left, every operation with that peer fails naming each rail's error."""
        link.alive = False
        with link.unacked_lock:
            pending = list(link.unacked.values())
            link.unacked.clear()
        with self._lock:
            known = any(str(link.spec) in d for d in self.dead)
            if not known:
                self.dead.append(f"{link.spec}: {exc}")
        self.cts.wake_senders()  # a sender waiting on this link's doorbell fails now, naming it
        if known:
            return
        log.warning(
            "rank %d: rail %s to rank %d failed (%s); its chunks move to the other rails",
            self.rank,
            link.spec,
            self.peer,
            exc,
        )
        for item in pending:
            if not item[0].done.is_set():
                self.queue.put(item)
        if not self.alive():
            lost = f"every rail to rank {self.peer} failed: " + "; ".join(self.dead)
            self.fail(PeerLost(lost, [self.peer]))

    def fail(self, exc: BaseException) -> None:
        """Fail every operation with the peer: its receives and the chunks still queued."""
        for op in list(self.owner.receives.values()):
            if op.peer == self.peer:
                op.fail(exc)
        while True:
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                break
            if item is not _STOP:
                item[0].fail(exc)

    def stop(self) -> None:
        """Tell the channel's threads to end."""
        self.queue.put(_STOP)
        for q in (self._signals, self._completions):
            if q is not None:
                q.put(_STOP)

    def release(self) -> None:
        """Close the links and the shared segments, unlinking their names (once both ranks have
        mapped a segment its name is gone already)."""
        for link in self.links:
            link.close()
        for b in (self.board_out, self.board_in):
            if b is not None:
                b.detach()
        for seg in (self.shm_out, self.shm_in):
            if seg is not None:
                seg.unlink()
                seg.close()
        for ring in (self.eager_out, self.eager_in):
            if ring is not None:
                ring.unlink()
                ring.close()

    def describe(self) -> str:
        """The channel's rails, for logs and errors."""
        return ", ".join(str(s) for s in self.specs)


def _serve(items: queue.Queue[Any], handle: Callable[..., None]) -> None:
    """The loop of a signaller or completer thread: `handle(*item)` for each item queued,
    until _STOP."""
    while True:
        item = items.get()
        if item is _STOP:
            return
        handle(*item)
