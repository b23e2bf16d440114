"""Eager messages between two staged ranks of one host: a ring of slots in shared memory.

Per ordered pair of ranks on one host the sender makes one segment (`shm.SharedSlots`, mapped
by the receiver when their channel opens, unlinked once both have mapped it): a control row,
then `slots` header rows, then `slots` data areas of `slot_bytes` each. A send of at most
`slot_bytes` copies its bytes into a free slot and publishes it; the receive of that (tag,
number) finds the slot, copies the bytes out and frees it. No clear-to-send, no thread.

Each word has one writer. The sender writes a slot's TAG, NUMBER, NBYTES, KIND and data, then
its PUB (the slot's publish count) and last the control row's TOTAL (publishes so far); the
receiver writes the slot's FREED (the PUB it consumed). A slot is free while PUB == FREED. The
order of those stores is what a reader relies on (`flags`: x86-64 keeps stores in order).

A send above `slot_bytes` publishes a *marker* in a slot, no data, which tells its receive how
the message comes (a receive above `slot_bytes` waits for it before anything else, and an eager
receive that finds one learns that the sizes disagree):
- KIND PULL: the receiver reads the bytes straight from the sender's array (its address in ADDR,
  the sender's pid in the control row; `cma.py`), one copy instead of two, writes the byte count
  it took into STATUS and frees the slot; the send completes then, and fails with
  MismatchError where STATUS is another count. Host arrays, where the receiver's probe at
  mapping (READS) found that it may read the sender's memory. A sender that gives up (time
  out, close) rewrites KIND to GONE before its array may change, and the receiver checks KIND
  again after its read: under x86-64's store order a read that saw the array change saw GONE
  too, so a withdrawn message is never taken as data.
- KIND RAILS: the message follows over the rails behind a clear-to-send (device arrays, or a
  pair whose receiver cannot read the sender's memory); the receive frees the marker, then
  posts its clear-to-send.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import secrets
import select
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from .. import cma
from ..local import Region
from ..shm import SharedSlots

# The largest message sent eagerly, and the slots of one ring. Measured on the 2-core CPU VM,
# 4 ranks, host arrays, one-way ping-pong of eager against rails in interleaved rounds
# (2026-12-01, load average 6-7 from other jobs, so one digit at most): eager 343-576 us
# against rails 534-977 us at 128-256 KiB, even at 512 KiB (712 / 718 us), slower at 1 MiB
# (1283 / 726 us). A receive that waits longer than flags.wait's 2 ms of yielding naps in
# steps of up to 1 ms, where the rails' receive sleeps on an event and wakes at once: that
# bounds the size worth sending eagerly. Eight slots: a ring costs 2 MiB of /dev/shm per
# ordered pair of a host's ranks (not measured further; more slots only let more messages
# wait for their receives).
EAGER_BYTES = 256 << 10
EAGER_SLOTS = 8

_ROW = 8  # int64 words per header row
PUB, TAG, NUMBER, NBYTES, KIND, FREED, ADDR, STATUS = range(8)  # STATUS, FREED: the receiver's
# words of the control row: the sender's TOTAL, PID, PROBE_AT (the address of PROBE in its
# process) and PROBE (a random value); the receiver's READS (1: it can read the sender's memory)
# and DOZING (how many of its threads sleep on the ring's wake pipe)
TOTAL, PID, PROBE_AT, PROBE, READS, DOZING = range(6)
# KIND: bytes in the slot; a marker of a message over the rails; of one the receiver reads from
# the sender's memory; of one its sender withdrew
DATA, RAILS, PULL, GONE = 1, 2, 3, 4
NOT_READ = -1  # STATUS of a PULL message freed without a read (the receive failed)
_ALIGN = 4096


def segment_bytes(slots: int, slot_bytes: int) -> int:
    """The size of a ring's segment: the header rows, page-aligned, then the data areas."""
    return _data_offset(slots) + slots * slot_bytes


def _data_offset(slots: int) -> int:
    head = (slots + 1) * _ROW * 8
    return (head + _ALIGN - 1) // _ALIGN * _ALIGN


class _Ring:
    """The views of one ring's segment that both ends use."""

    def __init__(self, seg: SharedSlots, slots: int, slot_bytes: int) -> None:
        self.seg, self.slots, self.slot_bytes = seg, slots, slot_bytes
        self._view(seg.array[: segment_bytes(slots, slot_bytes)])
        # where the slots' bytes start in this process: device copies' address
        self._base = seg.ptr + _data_offset(slots)
        self.lock = threading.Lock()  # this rank's threads that take slots of the ring
        # the ring's wake pipe (a FIFO beside the segment): a receiver whose wait has gone on
        # past its yielding sleeps on it, and the sender writes a byte when it publishes
        # while one does (DOZING); None where it could not be made or opened (the waits
        # then nap, as they would without it)
        self.wake_path = seg.path + ".wake"
        self._wake: int | None = None

    def _view(self, mem: np.ndarray) -> None:
        """The ring's views of `mem`, its segment's bytes."""
        slots, slot_bytes = self.slots, self.slot_bytes
        words = mem[: (slots + 1) * _ROW * 8].view(np.int64).reshape(slots + 1, _ROW)
        self.control = words[0]
        self.head = words[1:]
        # the same words as Python ints, one read or write each: the calls below touch a few
        # words per message, where a numpy expression over the rows costs a microsecond or more
        self.words = words.reshape(-1).data.cast("B").cast("q")
        off = _data_offset(slots)
        self.data = mem[off : off + slots * slot_bytes].reshape(slots, slot_bytes)
        self._bytes = self.data.reshape(-1).data  # host copies by slice assignment

    def address(self, slot: int) -> int:
        """The address of `slot`'s bytes in this process (a device copy's end)."""
        return self._base + slot * self.slot_bytes

    def unlink(self) -> None:
        """Remove the segment's and the wake pipe's names (both ends have opened them)."""
        self.seg.unlink()
        with contextlib.suppress(OSError):
            os.unlink(self.wake_path)

    def close(self) -> None:
        """Close the wake pipe and unmap the segment now: the ring's views move to zeroed
        private memory (never touched, so never resident), which a thread that still looks
        afterwards reads; while they held the segment it stayed mapped until the collector
        freed the ring, 2 MiB per pair and communicator."""
        if self._wake is not None:
            with contextlib.suppress(OSError):
                os.close(self._wake)
            self._wake = None
        self._view(np.zeros(segment_bytes(self.slots, self.slot_bytes), np.uint8))
        self.seg.close()


class EagerOut(_Ring):
    """The sending end: this rank made the segment and writes the messages.

    Sends take slots in the order in which they were made (`ticket`, drawn by the call): a
    send that found the ring full and waits for a slot on a driver thread keeps its place,
    and a later send may not take a slot freed meanwhile. Out of order, messages made later
    could fill the ring while the receiver waits, in MPI's order, for the one that has no
    slot: 32 back-to-back asynchronous sends of 1 MiB stalled so (2026-12-01). `drawn`
    counts the tickets: the transport's for this peer, from which asynchronous sends made
    before the ring opened drew theirs already."""

    def __init__(
        self, seg: SharedSlots, slots: int, slot_bytes: int, drawn: Iterator[int] | None = None
    ) -> None:
        super().__init__(seg, slots, slot_bytes)
        self._filling: set[int] = set()  # slots taken by a thread of this rank, not published
        self._next = 0  # where the search for a free slot starts: the slots go round in turn
        self._drawn = itertools.count() if drawn is None else drawn
        self._serving = 0  # the ticket whose send takes the next slot
        self._skipped: set[int] = set()  # later tickets given up before their turn
        self._lent: set[int] = set()  # slots of PULL messages whose receiver may read us
        # PULL messages (slot, pub) the receiver had freed when a claim took their slots back
        # before their sends looked: what it wrote of each (`collect`)
        self._ended: dict[tuple[int, int], int] = {}
        w = self.words
        w[PID], w[PROBE] = os.getpid(), secrets.randbits(62) | 1
        w[PROBE_AT] = self.control.ctypes.data + PROBE * 8
        try:
            os.mkfifo(self.wake_path, 0o600)
            # read-write: a FIFO so opened never blocks, and writes need no reader yet
            self._wake = os.open(self.wake_path, os.O_RDWR | os.O_NONBLOCK)
        except OSError:
            self._wake = None

    def poke(self) -> None:
        """Wake the receiver's threads that sleep on the ring (after a publish)."""
        if self.words[DOZING] and self._wake is not None:
            with contextlib.suppress(OSError):  # a full pipe has woken them already
                os.write(self._wake, b"\x01")

    @property
    def readable(self) -> bool:
        """Whether the receiver found that it can read this process's memory (PULL messages)."""
        return self.words[READS] == 1

    def ticket(self) -> int:
        """This send's place in the order of slots (draw it where the send is made)."""
        return next(self._drawn)  # one C call: atomic under the interpreter lock

    def claim(self, ticket: int) -> int | None:
        """A free slot, taken for `ticket`'s send to fill; None when every slot is in use or
        an earlier ticket has not taken its slot yet."""
        w, slots = self.words, self.slots
        with self.lock:
            if ticket != self._serving:
                return None
            if self._lent:
                self._take_back()
            for i in range(slots):
                s = (self._next + i) % slots
                row = (s + 1) * _ROW
                if w[row + PUB] == w[row + FREED] and s not in self._filling:
                    self._filling.add(s)
                    self._next = (s + 1) % slots
                    self._advance()
                    return s
        return None

    def send(self, src: memoryview, tag: int, number: int, ticket: int) -> bool:
        """Send host bytes `src` as message (`tag`, `number`) in `ticket`'s turn through the
        slot after the last one taken, claimed, filled and published in one hold of the lock;
        False (nothing done, the ticket still to be served) where it is not the ticket's turn
        or that slot is in use: `claim` then searches every slot, and may wait for one. The
        lock is held over the copy (at most `slot_bytes`), so no other thread of this rank
        sees the slot half made and the copy needs no mark of its own (`_filling`)."""
        w = self.words
        with self.lock:
            s = self._next
            row = (s + 1) * _ROW
            if ticket != self._serving or w[row + PUB] != w[row + FREED] or s in self._filling:
                return False
            n = len(src)
            if n:
                at = s * self.slot_bytes
                self._bytes[at : at + n] = src
            self._next = (s + 1) % self.slots
            self._serving = ticket + 1
            if self._skipped:
                self._advance_skipped()
            # _announce's stores, inline: the header, then PUB, then TOTAL
            w[row + TAG], w[row + NUMBER], w[row + NBYTES], w[row + KIND] = tag, number, n, DATA
            w[row + PUB] += 1
            w[TOTAL] += 1
        if w[DOZING]:
            self.poke()
        return True

    def skip(self, ticket: int) -> None:
        """Give up `ticket` without a slot (its send failed before it took one)."""
        with self.lock:
            if ticket == self._serving:
                self._advance()
            elif ticket > self._serving:
                self._skipped.add(ticket)

    def _advance(self) -> None:
        self._serving += 1
        self._advance_skipped()

    def _advance_skipped(self) -> None:
        """Past the tickets given up before their turn."""
        while self._skipped and self._serving in self._skipped:
            self._skipped.discard(self._serving)
            self._serving += 1

    def put(self, slot: int, src: np.ndarray) -> None:
        """Copy host bytes `src` (flat uint8) into `slot`: a slice assignment, where numpy's
        copyto into a slice costs a microsecond more at a few bytes."""
        at = slot * self.slot_bytes
        self._bytes[at : at + src.nbytes] = src.data

    def publish(self, slot: int, tag: int, number: int, nbytes: int, kind: int) -> None:
        """Announce the claimed `slot` (its bytes written already) to the receiver."""
        self._announce(slot, tag, number, nbytes, kind)
        with self.lock:
            self._filling.discard(slot)
        self.poke()

    def lend(self, slot: int, tag: int, number: int, nbytes: int, addr: int) -> int:
        """Publish the claimed `slot` as a PULL message of `nbytes` at `addr` of this process;
        the slot stays this rank's until `release`. Returns its PUB, for `returned`."""
        self.words[(slot + 1) * _ROW + ADDR] = addr
        pub = self._announce(slot, tag, number, nbytes, PULL)
        with self.lock:
            self._lent.add(slot)
        self.poke()
        return pub

    def _announce(self, slot: int, tag: int, number: int, nbytes: int, kind: int) -> int:
        """Write `slot`'s header, then its PUB, then TOTAL (the order readers rely on)."""
        w, row = self.words, (slot + 1) * _ROW
        w[row + TAG], w[row + NUMBER], w[row + NBYTES], w[row + KIND] = tag, number, nbytes, kind
        w[row + PUB] = pub = w[row + PUB] + 1  # after the header and the data
        w[TOTAL] += 1  # last: receivers look again when it moves
        return pub

    def returned(self, slot: int, pub: int) -> bool:
        """Whether the receiver has freed the message `pub` of `slot`."""
        return self.words[(slot + 1) * _ROW + FREED] == pub or (slot, pub) in self._ended

    def collect(self, slot: int, pub: int) -> int | None:
        """What the receiver wrote of the PULL message `pub` of `slot` once it has freed it
        (the bytes its receive took, or NOT_READ), the slot then released; None before."""
        with self.lock:
            taken = self._ended.pop((slot, pub), None)
            if taken is not None:
                return taken
            row = (slot + 1) * _ROW
            if self.words[row + FREED] != pub:
                return None
            self._lent.discard(slot)
            self._filling.discard(slot)
            return self.words[row + STATUS]

    def _take_back(self) -> None:
        """Release the slots of PULL messages their receiver has freed, keeping what it wrote
        for their sends (`collect`): a send is polled when its caller waits on it, which may
        be after sends that need the slots (under `lock`)."""
        w = self.words
        for slot in list(self._lent):
            row = (slot + 1) * _ROW
            pub = w[row + PUB]
            if w[row + FREED] == pub:
                self._ended[(slot, pub)] = w[row + STATUS]
                self._lent.discard(slot)
                self._filling.discard(slot)

    def withdraw(self, slot: int, pub: int) -> None:
        """Take back the PULL message `pub` of `slot` (its send failed), unless its slot was
        taken back already: from now on its receiver fails it instead of taking it, even one
        reading it now (it checks again after)."""
        with self.lock:
            row = (slot + 1) * _ROW
            if slot in self._lent and self.words[row + PUB] == pub:
                self.words[row + KIND] = GONE

    def release(self, slot: int) -> None:
        """The withdrawn PULL message of `slot` has ended: the slot is free once the receiver
        frees it."""
        with self.lock:
            self._lent.discard(slot)
            self._filling.discard(slot)

    def withdraw_all(self) -> None:
        """Withdraw every PULL message not returned yet (the transport closes)."""
        with self.lock:
            for slot in self._lent:
                self.words[(slot + 1) * _ROW + KIND] = GONE

    def unclaim(self, slot: int) -> None:
        """Give back a claimed slot that was not published (its copy failed)."""
        with self.lock:
            self._filling.discard(slot)
            self._next = slot  # the next claim takes it again


class Found:
    """A message taken from the ring by a receive: its slot, kind and size."""

    __slots__ = ("kind", "nbytes", "pub", "slot")

    def __init__(self, slot: int, kind: int, nbytes: int, pub: int) -> None:
        self.slot, self.kind, self.nbytes, self.pub = slot, kind, nbytes, pub


class Posted:
    """A receive waiting for its message or marker in the ring: where it goes, and how it
    ended (set by the thread that lands it: `op`, the receive over the rails that a marker
    started, for a message larger than a slot)."""

    __slots__ = ("deadline", "done", "error", "number", "op", "ready", "region", "tag", "waited")

    def __init__(
        self, region: Region, tag: int, number: int, ready: Any, deadline: float = 0.0
    ) -> None:
        self.region, self.tag, self.number, self.ready = region, tag, number, ready
        self.deadline = deadline
        self.done = False
        self.waited = False  # a thread waits on it, looking at the ring (the Watcher need not)
        self.error: BaseException | None = None
        self.op: Any = None


class EagerIn(_Ring):
    """The receiving end: the peer made the segment; this rank reads and frees its slots.

    Receives that wait for their message are `posted` by (tag, number): whichever thread of
    this rank looks at the ring (`progress`) takes every message a posted receive waits for,
    as MPI's progress does for its posted receives, so that a ring full of messages for
    receives nobody waits on yet still drains. `posted`, `_taken` and `_scanned` are guarded
    by `lock`."""

    def __init__(self, seg: SharedSlots, slots: int, slot_bytes: int, reads: bool = True) -> None:
        super().__init__(seg, slots, slot_bytes)
        w = self.words
        self.pid = w[PID]
        # whether this rank reads the sender's large host messages from its memory (PULL):
        # where it may (`cma.probe`) and `reads` asks for it; the sender sees READS
        self.reads_why = cma.probe(self.pid, w[PROBE_AT], w[PROBE]) if reads else "switched off"
        w[READS] = 1 if self.reads_why is None else 2
        try:
            self._wake = os.open(self.wake_path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            self._wake = None
        self._dozers = 0
        self._looked = -1  # TOTAL at the last look into the ring
        self._taken: set[int] = set()  # slots a thread of this rank is reading
        self.posted: dict[tuple[int, int], Posted] = {}
        self._scanned = -1  # TOTAL at the last progress
        self._next = 0  # where searches start: the slot after the last message taken
        # messages taken so far: TOTAL less this many are published and not taken yet, so a
        # search stops once it has seen that many (each publish is taken once)
        self._took = 0

    def post(self, rec: Posted) -> Found | None:
        """The message of `rec`, taken, if it is here; else `rec` is posted for `progress`."""
        with self.lock:
            found = self._take(rec.tag, rec.number)
            if found is None:
                self.posted[(rec.tag, rec.number)] = rec
            return found

    def unpost(self, rec: Posted) -> bool:
        """Withdraw a posted receive (it timed out); False when a thread has taken its message
        already (it is being landed)."""
        with self.lock:
            return self.posted.pop((rec.tag, rec.number), None) is not None

    def fail_posted(self, exc: BaseException) -> None:
        """End every posted receive with `exc` (the transport closes)."""
        with self.lock:
            posted, self.posted = self.posted, {}
        for rec in posted.values():
            rec.error = exc
            rec.done = True

    def progress(self) -> list[tuple[Found, Posted]]:
        """The messages that posted receives wait for, taken (each with its receive) for the
        caller to land; reads one word unless the sender has published since the last look."""
        w = self.words
        self._looked = total = w[TOTAL]
        if total == self._scanned:
            return []
        hits: list[tuple[Found, Posted]] = []
        with self.lock:
            self._scanned = total
            if not self.posted:
                return hits
            # the messages not taken yet; one published after TOTAL was read may be seen in
            # their place, and the rest are seen at the look after TOTAL moves again
            untaken, slots, start = total - self._took, self.slots, self._next
            i = 0
            while untaken > 0 and i < slots:
                s = (start + i) % slots
                i += 1
                row = (s + 1) * _ROW
                if w[row + PUB] == w[row + FREED] or s in self._taken:
                    continue
                untaken -= 1
                rec = self.posted.pop((w[row + TAG], w[row + NUMBER]), None)
                if rec is not None:
                    self._taken.add(s)
                    self._took += 1
                    self._next = (s + 1) % slots
                    hits.append((Found(s, w[row + KIND], w[row + NBYTES], w[row + PUB]), rec))
        return hits

    def take(self, tag: int, number: int) -> Found | None:
        """Message (tag, number), taken for this thread to read, if it has been published."""
        with self.lock:
            return self._take(tag, number)

    def _take(self, tag: int, number: int) -> Found | None:
        w, slots = self.words, self.slots
        self._looked = total = w[TOTAL]  # before the search: what it misses moves TOTAL
        # a slot whose PUB differs from FREED holds a message whose header the sender no
        # longer writes (it wrote the header before PUB); only this rank frees slots, under
        # `lock`. Messages fill the slots in turn, so the search starts after the last one,
        # and it ends once it has seen every message not taken yet (see progress).
        untaken, start = total - self._took, self._next
        i = 0
        while untaken > 0 and i < slots:
            s = (start + i) % slots
            i += 1
            row = (s + 1) * _ROW
            if w[row + PUB] == w[row + FREED] or s in self._taken:
                continue
            if w[row + TAG] == tag and w[row + NUMBER] == number:
                self._taken.add(s)
                self._took += 1
                self._next = (s + 1) % slots
                return Found(s, w[row + KIND], w[row + NBYTES], w[row + PUB])
            untaken -= 1
        return None

    def receive(self, dst: memoryview, tag: int, number: int) -> bool:
        """Copy message (`tag`, `number`) into host bytes `dst` and free its slot, where it is
        the message in the slot after the last one taken, of `dst`'s size and eager, in one
        hold of the lock; False (nothing done) otherwise, and the general path (`take` or
        `post`, then its landing) finds it wherever it is, markers and mismatches included."""
        w = self.words
        n = len(dst)
        with self.lock:
            self._looked = w[TOTAL]  # as _take's look
            s = self._next
            row = (s + 1) * _ROW
            pub = w[row + PUB]
            if (
                pub == w[row + FREED]
                or w[row + NUMBER] != number
                or w[row + TAG] != tag
                or w[row + KIND] != DATA
                or w[row + NBYTES] != n
                or s in self._taken
            ):
                return False
            if n:
                at = s * self.slot_bytes
                dst[:] = self._bytes[at : at + n]
            self._took += 1
            self._next = (s + 1) % self.slots
            w[row + STATUS] = NOT_READ
            w[row + FREED] = pub  # after the copy out and STATUS
        return True

    def get(self, found: Found, dst: np.ndarray) -> None:
        """Copy a taken message's bytes into host bytes `dst` (flat uint8, its size)."""
        at = found.slot * self.slot_bytes
        dst.data[:] = self._bytes[at : at + found.nbytes]

    def doze(self, seconds: float) -> None:
        """Sleep up to `seconds` or until the sender publishes (flags.wait's nap, for waits
        on this ring): not at all where TOTAL has moved since the last look into the ring
        (`progress`, `take`), so a wait's `ready()` must end with the look that finds what it
        waits for. A publish that misses the poke (the sender read DOZING before this rank's
        store reached it) is seen when `seconds` have passed, as a nap's would be."""
        fd = self._wake
        if fd is None:
            time.sleep(seconds)
            return
        w = self.words
        with self.lock:
            self._dozers += 1
            w[DOZING] = self._dozers
        try:
            if w[TOTAL] == self._looked:  # nothing published since the last look: sleep
                select.select((fd,), (), (), seconds)
            try:
                poked = os.read(fd, 4096)  # the pokes, all at once
            except BlockingIOError:
                poked = b"-"
            if not poked:  # end of file: the sender closed its end, its pokes are over
                self._wake = None
                os.close(fd)
                time.sleep(seconds)
        finally:
            with self.lock:
                self._dozers -= 1
                w[DOZING] = self._dozers

    def pull(self, found: Found, local: int) -> bool:
        """Read a taken PULL message from the sender's memory to address `local` (its
        NBYTES); False where the sender withdrew it meanwhile (the bytes read are not its
        message). OSError where the read fails (the sender is gone, or its range is)."""
        w, row = self.words, (found.slot + 1) * _ROW
        cma.read(self.pid, w[row + ADDR], local, found.nbytes)
        return w[row + KIND] == PULL  # read after the data: see the module's docstring

    def free(self, found: Found, status: int = NOT_READ) -> None:
        """Hand a taken slot back to the sender; `status`: the bytes a receive took of a PULL
        message."""
        row = (found.slot + 1) * _ROW
        self.words[row + STATUS] = status
        self.words[row + FREED] = found.pub  # after STATUS
        with self.lock:
            self._taken.discard(found.slot)
