"""A shm rail's board: where a chunk lies, and when its slot is free, in shared words.

Per direction of a staged shm rail the sender's slot segment (shm.SharedSlots) ends in a board:
a control row, then one row per slot. The sender announces a chunk it has copied into slot s by
writing s's row (the receive's op id, the chunk's index, offset and bytes, and whether the
sending thread itself looks for the slot's return), then the row's PUB (its publish count), and
last the control row's TOTAL; the receiver takes the rows of its receives, and once its copy
out of a slot has ended writes the row's FREED (= PUB): the slot is the sender's again. Each
word has one writing process, and within it one thread at a time (`lock`); readers rely on the
order of the stores (flags.py: x86-64's store order).

A receive uses the board where the thread that waits for it moves it (inline.py) and its
clear-to-send said so (cts.py): that thread looks at the board between its copies, so a chunk's
announcement crosses no socket and no other thread. A sender's thread that looks too (an inline
send) takes its slots back by reading FREED; for any other sender the receiver rings the rail's
socket (FREE of slot REAP) and the sender's reader thread takes them back. A looking thread
that has found nothing for a while dozes on its wake event, counted in its side's DOZING word;
whoever writes the board while the other side's count is not zero rings the socket (WAKE), as
the eager ring's sender writes its wake pipe (eager.py). A write that misses a dozer (each read
the other's word before its own store showed) is seen at the dozer's next look, within
inline.NAP_S.

Why: the socket and the reader thread put 42-58 us between a device chunk's copy out of the
GPU and its copy in on an H100, holding a staged 16 MiB message sent one at a time to 0.74 of
its back-to-back rate (docs/lab-notes/benchmarks-2026-11.md, "A staged 16 MiB message step by
step").
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from . import links

_ROW = 8  # int64 words per row
# the control row: the sender's TOTAL (publishes so far); each side's threads dozing on it
TOTAL, RECV_DOZING, SEND_DOZING = range(3)
# a slot's row: the sender writes PUB and what it announces, the receiver FREED
PUB, OP, IDX, OFF, NBYTES, POLLS, FREED = range(7)
# the slot of a FREE on the socket that says "slots came back on the board"
REAP = -1


def words(slots: int) -> int:
    """The int64 words of a board for `slots` slots (after them in the segment)."""
    return (slots + 1) * _ROW


class Row:
    """A chunk a receive took from the board: its slot and publish count, and what it holds."""

    __slots__ = ("idx", "n", "off", "polls", "pub", "slot")

    def __init__(self, slot: int, pub: int, idx: int, off: int, n: int, polls: bool) -> None:
        self.slot, self.pub, self.idx, self.off, self.n, self.polls = slot, pub, idx, off, n, polls


class _Board:
    """One board's words and this rank's count of threads dozing on it."""

    _DOZING = RECV_DOZING

    def __init__(self, w: memoryview, slots: int) -> None:
        self.w, self.slots = w, slots
        self.lock = threading.Lock()
        self._dozers = 0
        # rings the peer over the rail's socket (kind, slot): set by the channel
        self.ring: Callable[[int, int], None] = _no_ring

    def detach(self) -> None:
        """Let go of the segment's words (its channel closes): while a board holds them the
        whole segment stays in memory. A thread that still looks afterwards reads zeros."""
        self.w = memoryview(bytearray(8 * len(self.w))).cast("q")

    def doze(self, delta: int) -> None:
        """Count a thread of this rank in (+1) or out of (-1) this side's DOZING word."""
        with self.lock:
            self._dozers += delta
            self.w[self._DOZING] = self._dozers


def _no_ring(kind: int, slot: int) -> None:
    """No socket to ring (a board not yet joined to its channel)."""


class BoardOut(_Board):
    """The sending end: announces chunks, takes slots back (shm.SharedSlots's reaper)."""

    _DOZING = SEND_DOZING

    def __init__(self, w: memoryview, slots: int) -> None:
        super().__init__(w, slots)
        self._out: dict[int, int] = {}  # slot -> the PUB of its announcement, until FREED

    def publish(self, slot: int, op_id: int, idx: int, off: int, n: int, polls: bool) -> bool:
        """Announce chunk `idx` (`n` bytes at `off`) of receive `op_id` in `slot`, its bytes
        written already; `polls`: the calling thread looks for the slot's return itself.
        Whether a thread of the receiver dozes (the caller rings WAKE)."""
        w, row = self.w, (slot + 1) * _ROW
        with self.lock:
            w[row + OP], w[row + IDX], w[row + OFF], w[row + NBYTES] = op_id, idx, off, n
            w[row + POLLS] = 1 if polls else 0
            w[row + PUB] = pub = w[row + PUB] + 1  # after the row
            self._out[slot] = pub
            w[TOTAL] += 1  # last: a receiver looks again when it moves
        return w[RECV_DOZING] != 0

    def out(self) -> bool:
        """Whether a slot announced here has not come back yet."""
        return bool(self._out)

    def reap(self) -> list[int]:
        """The slots whose receiver has freed them since the last call, each given once."""
        w = self.w
        with self.lock:
            back = [s for s, pub in self._out.items() if w[(s + 1) * _ROW + FREED] == pub]
            for s in back:
                del self._out[s]
        return back


class BoardIn(_Board):
    """The receiving end: takes the rows of this rank's receives and frees their slots."""

    def take(
        self, op_id: int, looked: int, taken: set[int], live: Callable[[int], bool]
    ) -> tuple[int, list[Row]]:
        """(TOTAL now, the rows of receive `op_id` published and not in `taken` (slots the
        receive holds already)); nothing is read past TOTAL where it is still `looked`. A row
        of a receive that has been forgotten (`live` false: it ended or was given up) is freed
        on the way, so that a late chunk of it does not keep its slot from the sender."""
        w = self.w
        total = w[TOTAL]  # before the rows: a row missed now moves it
        if total == looked:
            return total, []
        rows = []
        for s in range(self.slots):
            row = (s + 1) * _ROW
            pub = w[row + PUB]
            if pub == w[row + FREED]:
                continue
            owner = w[row + OP]
            if owner == op_id:
                if s not in taken:
                    idx, off, n, polls = w[row + IDX], w[row + OFF], w[row + NBYTES], w[row + POLLS]
                    rows.append(Row(s, pub, idx, off, n, polls == 1))
            elif not live(owner):
                self._free(s, pub, w[row + POLLS] == 1)
        return total, rows

    def free(self, row: Row) -> None:
        """Hand `row`'s slot back (its copy out has ended, or the receive gave it up)."""
        self._free(row.slot, row.pub, row.polls)

    def sweep(self, op_id: int, taken: set[int]) -> None:
        """Free every row of receive `op_id` not in `taken` (it was given up)."""
        w = self.w
        for s in range(self.slots):
            row = (s + 1) * _ROW
            pub = w[row + PUB]
            if pub != w[row + FREED] and w[row + OP] == op_id and s not in taken:
                self._free(s, pub, w[row + POLLS] == 1)

    def _free(self, slot: int, pub: int, polls: bool) -> None:
        w, row = self.w, (slot + 1) * _ROW
        with self.lock:
            # one writer at a time, and only over the announcement it read: two threads may
            # both find a row of a forgotten receive, and the one that writes last must not
            # take back an announcement made since with the slot's earlier count
            if w[row + PUB] != pub or w[row + FREED] == pub:
                return
            w[row + FREED] = pub
        if not polls:
            self.ring(links.FREE, REAP)  # its reader thread takes the slot back
        elif self.w[SEND_DOZING]:
            self.ring(links.WAKE, 0)
