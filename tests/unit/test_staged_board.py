"""A shm rail's board (staged/board.py): chunks announced in shared words, taken by their
receive only, slots handed back once and to the sender's free list, the socket rung only where
the other end needs it. Both ends map one real /dev/shm segment, as two ranks do."""

from __future__ import annotations

import os
import secrets
import threading
import time

import numpy as np
import pytest

from hetcomm.testing import mapped_files
from hetcomm.transports import flags
from hetcomm.transports.shm import SharedSlots
from hetcomm.transports.staged import board, links
from hetcomm.transports.staged.board import BoardIn, BoardOut

pytestmark = pytest.mark.skipif(flags.unsupported() is not None, reason="no shared-word order")

SLOTS, SLOT_BYTES = 4, 4096


def _pair(name: str) -> tuple[SharedSlots, SharedSlots, BoardOut, BoardIn]:
    """A segment made and mapped as a pair's two ends do, and the board at each end."""
    out = SharedSlots(name, SLOTS, SLOT_BYTES, create=True, words=board.words(SLOTS))
    into = SharedSlots(name, SLOTS, SLOT_BYTES, create=False, words=board.words(SLOTS))
    out.unlink()
    sender, receiver = BoardOut(out.words, SLOTS), BoardIn(into.words, SLOTS)
    out.reaper = sender
    return out, into, sender, receiver


def _name() -> str:
    return f"hetcomm-test-board-{os.getpid()}-{secrets.token_hex(4)}"


@pytest.fixture
def ends():
    """(sender's segment, its board, receiver's board, what each end rang)."""
    out, into, sender, receiver = _pair(_name())
    rang: dict[str, list[tuple[int, int]]] = {"sender": [], "receiver": []}
    sender.ring = lambda kind, slot: rang["sender"].append((kind, slot))
    receiver.ring = lambda kind, slot: rang["receiver"].append((kind, slot))
    yield out, sender, receiver, rang
    into.close()
    out.close()


def _live(*ops: int):
    return set(ops).__contains__


def test_a_receive_takes_its_own_rows_once(ends) -> None:
    out, sender, receiver, rang = ends
    rng = np.random.default_rng()
    mine, other = (int(v) for v in rng.choice(1 << 40, 2, replace=False))
    slots = out.try_acquire(3)
    chunks = [(int(rng.integers(1 << 30)), int(rng.integers(1, SLOT_BYTES))) for _ in slots]
    for i, (slot, (off, n)) in enumerate(zip(slots[:2], chunks)):
        assert not sender.publish(slot, mine, i, off, n, polls=True)  # no one dozes
    sender.publish(slots[2], other, 0, 1, 2, polls=True)
    looked, rows = receiver.take(mine, -1, set(), _live(mine, other))
    got = sorted((r.slot, r.idx, r.off, r.n, r.polls) for r in rows)
    want = sorted((s, i, o, n, True) for i, (s, (o, n)) in enumerate(zip(slots[:2], chunks)))
    assert got == want
    # nothing new since that look: no row, and none twice while the receive holds them
    assert receiver.take(mine, looked, {r.slot for r in rows}, _live(mine, other))[1] == []
    assert receiver.take(mine, -1, {r.slot for r in rows}, _live(mine, other))[1] == []
    assert rang == {"sender": [], "receiver": []}


def test_freed_slots_come_back_once(ends) -> None:
    out, sender, receiver, rang = ends
    slots = out.try_acquire(SLOTS)
    assert out.try_acquire(1) == []
    for i, slot in enumerate(slots):
        sender.publish(slot, 5, i, i * 10, 10, polls=i % 2 == 0)
    assert sender.out()
    _, rows = receiver.take(5, -1, set(), _live(5))
    assert len(rows) == SLOTS
    for row in rows[:2]:
        receiver.free(row)
    # a polling sender's slot rings no one (it looks itself); another's rings FREE of REAP
    polled = sum(r.polls for r in rows[:2])
    assert rang["receiver"] == [(links.FREE, board.REAP)] * (2 - polled)
    assert out.free_count() == 2
    assert sorted(out.try_acquire(2)) == sorted(r.slot for r in rows[:2])
    assert sender.reap() == []  # given once
    for row in rows[2:]:
        receiver.free(row)
    assert sorted(out.try_acquire(SLOTS)) == sorted(r.slot for r in rows[2:])
    assert not sender.out()


def test_a_dozing_end_is_rung(ends) -> None:
    out, sender, receiver, rang = ends
    slot = out.try_acquire(1)[0]
    receiver.doze(1)
    assert sender.publish(slot, 9, 0, 0, 1, polls=True)  # the receiver dozes: ring it
    receiver.doze(-1)
    _, (row,) = receiver.take(9, -1, set(), _live(9))
    sender.doze(1)
    receiver.free(row)
    sender.doze(-1)
    assert rang["receiver"] == [(links.WAKE, 0)]


def test_rows_of_forgotten_receives_are_freed_by_any_look(ends) -> None:
    """A chunk of a receive that has been given up keeps its slot only until another receive
    of the pair looks; the receive's own close frees what it never looked at."""
    out, sender, receiver, rang = ends
    a, b, c = out.try_acquire(3)
    sender.publish(a, 1, 0, 0, 8, polls=True)  # receive 1: forgotten
    sender.publish(b, 2, 0, 0, 8, polls=True)  # receive 2: live, another's
    sender.publish(c, 3, 0, 0, 8, polls=False)  # receive 3: given up, not looked at
    _, rows = receiver.take(4, -1, set(), _live(2, 3, 4))
    assert rows == []
    assert out.free_count() == SLOTS - 2  # slot a is back
    receiver.sweep(3, set())
    assert rang["receiver"] == [(links.FREE, board.REAP)]
    assert out.free_count() == SLOTS - 1
    _, (row,) = receiver.take(2, -1, set(), _live(2))
    assert row.slot == b


def test_a_waiting_taker_gets_a_slot_freed_on_the_board(ends) -> None:
    """shm.SharedSlots.acquire: a slot handed back on the board rings no one, and the wait
    looks again every millisecond while any is out."""
    out, sender, receiver, _ = ends
    slots = out.try_acquire(SLOTS)
    for i, slot in enumerate(slots):
        sender.publish(slot, 7, i, 0, 1, polls=True)
    _, rows = receiver.take(7, -1, set(), _live(7))
    freer = threading.Timer(0.05, receiver.free, (rows[1],))
    freer.start()
    t0 = time.monotonic()
    got = out.acquire(time.monotonic() + 5, lambda: True)
    waited = time.monotonic() - t0
    freer.join()
    assert got == rows[1].slot
    assert waited < 1.0


def test_a_closed_segment_leaves_no_mapping() -> None:
    """Once its boards let go (board.detach, as a channel's release does), closing a segment
    unmaps all of it: one page still mapped keeps every page of the file in memory."""
    name = _name()
    out, into, sender, receiver = _pair(name)
    sender.publish(0, 1, 0, 0, 8, polls=True)
    assert len(mapped_files(name)) == 4  # each end: its slots, its board
    for b in (sender, receiver):
        b.detach()
    out.close()
    into.close()
    assert mapped_files(name) == []
    assert receiver.take(1, -1, set(), _live(1)) == (0, [])  # a late look reads zeros


def test_a_late_second_free_takes_nothing_back(ends) -> None:
    """Two threads that both found a row free it once; one that frees it after the sender
    has announced a new chunk in the slot leaves that announcement alone."""
    out, sender, receiver, rang = ends
    slot = out.try_acquire(SLOTS)[0]
    sender.publish(slot, 1, 0, 0, 8, polls=False)
    _, (first,) = receiver.take(1, -1, set(), _live(1))
    receiver.free(first)
    receiver.free(first)  # a second thread's look, late
    assert rang["receiver"] == [(links.FREE, board.REAP)]
    assert sender.reap() == [slot]
    sender.publish(slot, 2, 0, 0, 8, polls=False)  # the slot again, a new count
    receiver.free(first)  # later still: the old count
    _, (second,) = receiver.take(2, -1, set(), _live(2))
    assert (second.slot, second.pub) == (slot, first.pub + 1)
    assert sender.reap() == []
    receiver.free(second)
    assert sender.reap() == [slot]
