"""Messages over the shm rail moved by the thread that waits for them.

A message between two ranks of one host whose only rail is shm, started by a thread that will
itself wait for it to the end (a blocking send or receive, a collective's steps on the thread
that runs the collective), of device bytes or of more than one chunk, is moved by that thread
alone: it takes the shared slots, queues every copy into or out of them, looks at each copy
between its other steps, and announces a slot or hands it back as soon as the copy has ended.
Where the pair's slot segments have boards (board.py) a receive says so in its clear-to-send,
and the chunks' slots are announced and handed back there: the waiting thread of each end
looks at the board between its other steps, and nothing of the message crosses the socket
after the clear-to-send (but a WAKE where the other end dozes). Without boards they go over
the socket (SLOT, FREE), and the channel's reader thread files them for the message
(`Inline.arrive`; a slot handed back wakes the sends). The reader files the clear-to-send too
(with the early chunks whose copies have ended: `Inline.clear`), but queues no copy and waits
for none; neither the rail's sender threads nor the signaller and completer take part.

Why: every other thread that runs while a copy is queued slows the CUDA calls that queue it
(on an H100, 5 us alone against 16-45 us while another thread of the process waited on an
event), and each chunk of a message crossed three of them and their hand-offs (docs/staged.md,
"Who moves a message's chunks"). Asynchronous messages, whose Work any thread may wait for,
channels with rails besides shm (whose chunks the rails share by speed) and host messages of
one chunk (see `start`) keep the threads.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import PeerLost
from .. import flags
from . import links
from .board import Row
from .ops import stamp

if TYPE_CHECKING:
    from .channel import Channel
    from .ops import _Op
    from .transport import StagedTransport

# the longest sleep between two looks at a thread's messages while none of their copies is on
# the GPU: the reader thread's word ends it sooner (a dead link is seen at the next look)
NAP_S = 1e-3


def sole_shm(ch: Channel) -> links.Link | None:
    """The shm rail's link where it is the channel's only rail (and both slot segments are
    mapped), else None: a message may be driven inline only then."""
    if ch.uses_mpi or len(ch.links) != 1 or ch.shm_out is None or ch.shm_in is None:
        return None
    link = ch.links[0]
    return link if link.spec.kind == "shm" else None


class Inline:
    """What the driving thread keeps of one message it moves itself."""

    __slots__ = (
        "arrived",
        "board",
        "ch",
        "cleared",
        "closed",
        "copies",
        "deadline",
        "driver",
        "link",
        "lock",
        "looked",
        "next",
        "op",
        "send",
        "taken",
    )

    def __init__(self, ch: Channel, link: links.Link, op: _Op, send: bool, deadline: float) -> None:
        self.ch, self.link, self.op, self.send = ch, link, op, send
        self.driver = driver()
        self.deadline = deadline  # monotonic: past it the message fails (Driver.step)
        self.cleared = False  # a send's clear-to-send has come (op.remote is set)
        self.next = 0  # a send's next chunk to copy into a slot
        # the board the chunks' slots go through (a receive's: set by `start`; a send's: by
        # `clear`, where its receive asked for it), else None: the socket
        self.board: Any = None
        self.looked = -1  # a receive's: the board's TOTAL at its last look
        self.taken: set[int] = set()  # a receive's: the board's slots it holds
        # a receive's chunks that have come (slot, chunk, offset, bytes, its board row or
        # None), filed by the reader or taken from the board
        self.arrived: collections.deque[tuple[int, int, int, int, Row | None]] = collections.deque()
        # copies queued and not yet seen to end, in the order queued: (slot, chunk, offset,
        # bytes, event, a receive's board row); event None for host bytes, copied already
        self.copies: collections.deque[tuple[int, int, int, int, Any, Row | None]] = (
            collections.deque()
        )
        self.lock = threading.Lock()  # `arrived` and `closed`, between the reader and driver
        self.closed = False  # the receive was given up: the reader hands slots back itself

    # ---- filed by the reader thread ----------------------------------------------------------

    def clear(self) -> None:
        """The send's clear-to-send has come (op.remote set), on the thread that filed it: the
        early chunks (copied into slots before it came) whose copies have ended are announced
        here at once, as the channel does for a message of its threads, so that a message of
        one chunk ends without waking the waiting thread first; that thread takes the rest."""
        op = self.op
        if op.board:
            self.board = self.ch.board_out
        if op.early:
            early = self.ch.take_early(op)
            for idx, (slot, event, (off, n)) in enumerate(early):
                self.copies.append((slot, idx, off, n, event, None))
            self.next = len(early)
            self._announce()
        self.cleared = True  # last: the waiting thread touches nothing above before it
        self.driver.wake.set()

    def arrive(self, slot: int, idx: int, off: int, n: int) -> bool:
        """Chunk `idx` of the receive lies in slot `slot`; False where the receive was given
        up (the caller hands the slot back)."""
        with self.lock:
            if self.closed:
                return False
            self.arrived.append((slot, idx, off, n, None))
        self.driver.wake.set()
        return True

    # ---- the driving thread ------------------------------------------------------------------

    def step(self) -> bool:
        """Move what can move now without waiting; whether anything did."""
        return self._send_step() if self.send else self._recv_step()

    def _send_step(self) -> bool:
        op, ch, gpu = self.op, self.ch, self.ch.owner.gpu
        if not self.cleared or op.done.is_set():
            return False
        if not self.link.alive:
            self._lost("its shm rail is gone")
            return True
        moved = False
        out = ch.shm_out
        assert out is not None
        while self.next < len(op.spans):
            got = out.try_acquire(1)
            if not got:
                break
            slot = got[0]
            off, n = op.spans[self.next]
            target = out.view(slot, n)
            src = op.region.sub(off, n)
            if src.host is not None:
                np.copyto(target, src.host)
                event = None
            else:
                out.register_with_gpu(gpu.device)
                event = gpu.copy_to_host_async(target, src, op.ready)
            stamp("d2h queued", self.next)
            self.copies.append((slot, self.next, off, n, event, None))
            self.next += 1
            moved = True
        return self._announce() or moved

    def _announce(self) -> bool:
        """Announce the slots whose copies have ended, in order; whether any was."""
        op, moved = self.op, False
        while self.copies and _ended(self.copies[0][4]):
            slot, idx, off, n, _, _ = self.copies.popleft()
            self.ch.owner.count_bytes(self.link, n)
            try:
                self.ch.post_slot(self.link, op, slot, idx, off, n)
            except links.RailError as exc:
                self.ch._rail_down(self.link, exc)
                self._lost(f"its shm rail failed: {exc}")
                return True
            stamp("d2h done", idx)
            op.count(idx)
            moved = True
        return moved

    def _lost(self, why: str) -> None:
        peer = self.op.peer
        self.op.fail(PeerLost(f"send to rank {peer}: {'; '.join(self.ch.dead) or why}", [peer]))

    def _recv_step(self) -> bool:
        op, ch, gpu = self.op, self.ch, self.ch.owner.gpu
        shm_in = ch.shm_in
        assert shm_in is not None
        moved = False
        if self.board is not None:
            self._look()
        while self.arrived:
            with self.lock:
                slot, idx, off, n, row = self.arrived.popleft()
            src = shm_in.view(slot, n)
            if op.region.host is not None:
                ch._deliver(op, off, src)  # as the reader thread lands host bytes
                event = None
            else:
                shm_in.register_with_gpu(gpu.device)
                event = gpu.copy_from_host_async(op.region.sub(off, n), src, op.ready)
                stamp("h2d queued", idx)
            self.copies.append((slot, idx, off, n, event, row))
            moved = True
        while self.copies and _ended(self.copies[0][4]):
            slot, idx, _, _, _, row = self.copies.popleft()
            stamp("h2d done", idx)
            op.count(idx)
            self._hand_back(slot, row)
            moved = True
        return moved

    def _look(self) -> None:
        """File the receive's chunks published on the board since its last look."""
        live = self.ch.owner.receives.__contains__
        self.looked, rows = self.board.take(self.op.key, self.looked, self.taken, live)
        if not rows:
            return
        with self.lock:
            if self.closed:
                return
            for row in sorted(rows, key=lambda r: r.idx):
                self.taken.add(row.slot)
                self.arrived.append((row.slot, row.idx, row.off, row.n, row))
                stamp("slot got", row.idx)

    def _hand_back(self, slot: int, row: Row | None) -> None:
        """Give a receive's slot back to the sender, on the board where it came from there."""
        if row is None:
            self.ch._reply(self.link, links.FREE, slot, 0, 0)
            return
        self.taken.discard(slot)
        self.board.free(row)

    def polls(self) -> bool:
        """Whether the message waits for something only the board tells (no one rings)."""
        if self.board is None:
            return False
        return not self.send or (self.cleared and self.next < len(self.op.spans))

    def copying(self) -> bool:
        """Whether a copy of this message is on the GPU (it ends without the reader's word)."""
        return bool(self.copies)

    def close(self) -> None:
        """Give the message up (it ended, failed or timed out): every slot it holds goes back
        once the copies through it have ended, so that neither rank loses a slot to it."""
        with self.lock:
            self.closed = True
            arrived, self.arrived = list(self.arrived), collections.deque()
        self.driver.drop(self)
        held = [(c[0], c[4], c[5]) for c in self.copies]
        self.copies.clear()
        if self.send:
            with contextlib.suppress(ValueError):
                self.ch.inline_sends.remove(self)
            out = self.ch.shm_out
            assert out is not None
            for slot, event, _ in held:
                _settle(event)
                out.release(slot)
            return
        for slot, event, row in held:
            _settle(event)
            self._hand_back(slot, row)
        for slot, *_, row in arrived:
            self._hand_back(slot, row)
        if self.board is not None:
            self.board.sweep(self.op.key, self.taken)  # published and not looked at yet


def _ended(event: Any) -> bool:
    return event is None or bool(event.done)


def _settle(event: Any) -> None:
    """Wait for a copy that is given up (a failure is the operation's, already raised)."""
    if event is not None:
        with contextlib.suppress(Exception):
            event.synchronize()


class Driver:
    """The messages one thread moves itself (one per thread, made on first use)."""

    def __init__(self) -> None:
        self.messages: list[Inline] = []
        # set by the reader thread when it files something for one of them, or by a failure
        self.wake = threading.Event()

    def add(self, inline: Inline) -> None:
        """Move `inline` from now on."""
        self.messages.append(inline)

    def drop(self, inline: Inline) -> None:
        """Stop moving `inline` (it ended or was given up)."""
        if inline in self.messages:
            self.messages.remove(inline)

    def step(self) -> bool:
        """One look at every message of the thread; whether anything moved. Messages that
        have ended are dropped, and one past its deadline fails (a call that raised between
        starting it and waiting for it left it here)."""
        moved = False
        now = time.monotonic()
        for inline in list(self.messages):
            op = inline.op
            if not op.done.is_set() and now > inline.deadline:
                op.fail(op.late())
            if op.done.is_set():
                inline.close()
                continue
            if inline.step():
                moved = True
        return moved

    def wait(self, op: _Op, until: float) -> bool:
        """Move this thread's messages until `op` is done (True) or `until` (monotonic) passes
        (False). Between looks it yields the core while a copy is on the GPU (its end is seen
        by looking) and, for flags.YIELD_SECONDS after it last moved anything, while a message
        waits for the board (which rings no one); else it sleeps until the reader thread files
        something for one of them (a clear-to-send, a slot, a slot handed back, a WAKE from
        the board's other end) or a failure wakes it."""
        moved_at = time.monotonic()
        while True:
            self.wake.clear()
            moved = self.step()
            if op.done.is_set():
                return True
            now = time.monotonic()
            if now >= until:
                return False
            if moved:
                moved_at = now
                continue
            if any(m.copying() for m in self.messages):
                os.sched_yield()
                continue
            polling = [m for m in self.messages if m.polls()]
            if polling and now - moved_at < flags.YIELD_SECONDS:
                os.sched_yield()
            elif polling:
                self._doze(polling, min(NAP_S, until - now))
            else:
                self.wake.wait(min(NAP_S, until - now))

    def _doze(self, polling: list[Inline], seconds: float) -> None:
        """Sleep up to `seconds` on the wake event, counted on the boards of `polling` so that
        their other ends ring WAKE once they write there; a last look after counting in
        catches a write that came before."""
        marked = {id(m.board): m for m in polling}.values()
        for m in marked:
            m.ch.dozing(self, True)
            m.board.doze(1)
        try:
            if not self.step():
                self.wake.wait(seconds)
        finally:
            for m in marked:
                m.board.doze(-1)
                m.ch.dozing(self, False)


_local = threading.local()


def driver() -> Driver:
    """This thread's Driver."""
    d: Driver | None = getattr(_local, "driver", None)
    if d is None:
        d = _local.driver = Driver()
    return d


def start(t: StagedTransport, ch: Channel, op: _Op, send: bool, deadline: float) -> None:
    """Have this thread move `op` itself where its channel's only rail is shm (op.inline set);
    else leave it to the channel's threads. A send of host bytes in one chunk stays with them
    too: the chunk is copied into its slot before the clear-to-send comes, and the reader
    thread that files it announces the chunk at once. Its receive is moved here where the
    pair has boards (this thread then finds the chunk on the board: 1-4 MiB one way, CPU VM,
    0.68-0.92x the time on the threads), and stays with the reader otherwise, which copies it
    out as it reads where this thread would first have to be woken (1.08-1.12x inline;
    docs/staged.md)."""
    link = sole_shm(ch)
    one_host_chunk = op.region.host is not None and len(op.spans) < 2
    if link is None or (one_host_chunk and (send or ch.board_in is None)):
        return
    t.paths["send inline" if send else "recv inline"] += 1
    inline = Inline(ch, link, op, send, deadline)
    if not send and ch.board_in is not None:
        inline.board = ch.board_in
        t.paths["recv board"] += 1
    op.inline = inline
    inline.driver.add(inline)
    if send:
        ch.inline_sends.append(inline)  # woken when a slot comes back (Channel._recv_loop)
