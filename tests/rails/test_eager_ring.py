"""The eager ring of one pair of staged ranks (staged/eager.py), both ends in one process: slots
are taken, published, found by (tag, number) in any order, landed for posted receives and
freed; a full ring has no slot; the words each end writes are its own. PULL messages are read
from the sender's memory (a process may read its own), withdrawn ones are never taken as
data, and what the receiver found reaches the sender."""

from __future__ import annotations

import ctypes
import os
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from hetcomm.errors import HetcommError, MismatchError
from hetcomm.testing import mapped_files
from hetcomm.transports import cma
from hetcomm.transports.local import Region
from hetcomm.transports.shm import SharedSlots
from hetcomm.transports.staged import pull
from hetcomm.transports.staged.eager import (
    DATA,
    DOZING,
    FREED,
    GONE,
    NOT_READ,
    PUB,
    PULL,
    RAILS,
    EagerIn,
    EagerOut,
    Found,
    Posted,
    segment_bytes,
)

SLOTS, SLOT_BYTES = 4, 4096


@pytest.fixture
def ring() -> Iterator[tuple[EagerOut, EagerIn]]:
    name = f"hetcomm-test-{uuid.uuid4().hex[:12]}"
    size = segment_bytes(SLOTS, SLOT_BYTES)
    out = EagerOut(SharedSlots(name, 1, size, create=True), SLOTS, SLOT_BYTES)
    inbox = EagerIn(SharedSlots(name, 1, size, create=False), SLOTS, SLOT_BYTES)
    out.unlink()
    assert not os.path.exists(f"/dev/shm/{name}")
    assert not os.path.exists(out.wake_path)
    yield out, inbox
    out.close()
    inbox.close()


def _send(out: EagerOut, tag: int, number: int, data: np.ndarray, kind: int = DATA) -> int:
    slot = out.claim(out.ticket())
    assert slot is not None
    out.put(slot, data.view(np.uint8))
    out.publish(slot, tag, number, data.nbytes, kind)
    return slot


def _taken(inbox: EagerIn, found: Found) -> np.ndarray:
    """The bytes of a taken message, in its slot."""
    return inbox.data[found.slot, : found.nbytes]


def test_a_slots_address_is_where_its_bytes_are(ring):
    """A device copy's end in a slot (`address`) is the slot's bytes in this process, on
    either end of the ring (each maps the segment at an address of its own)."""
    out, inbox = ring
    data = np.random.default_rng().integers(0, 255, (out.slots, 8), dtype=np.uint8)
    for s in range(out.slots):
        out.put(s, data[s])
        for end in (out, inbox):
            mem = np.ctypeslib.as_array((ctypes.c_uint8 * 8).from_address(end.address(s)))
            assert np.array_equal(mem, data[s])


def test_messages_are_found_by_tag_and_number_in_any_order(ring):
    out, inbox = ring
    rng = np.random.default_rng()
    msgs = {
        (t, k): rng.integers(0, 255, 10 + t + k, dtype=np.uint8) for t in (1, 2) for k in (0, 1)
    }
    for (t, k), data in msgs.items():
        _send(out, t, k, data)
    waiting = out.ticket()
    assert out.claim(waiting) is None  # four slots, four messages: full
    assert inbox.take(3, 0) is None
    for t, k in [(2, 1), (1, 1), (2, 0), (1, 0)]:
        found = inbox.take(t, k)
        assert found is not None and found.kind == DATA and found.nbytes == msgs[(t, k)].nbytes
        assert inbox.take(t, k) is None  # taken once
        assert np.array_equal(_taken(inbox, found), msgs[(t, k)])
        inbox.free(found)
    assert (out.head[:, PUB] == out.head[:, FREED]).all()
    slots = {out.claim(waiting)} | {out.claim(out.ticket()) for _ in range(SLOTS - 1)}
    assert slots == set(range(SLOTS)) and out.claim(out.ticket()) is None


def _take_one(inbox: EagerIn, tag: int, number: int) -> None:
    found = inbox.take(tag, number)
    assert found is not None
    inbox.free(found)


def test_slots_go_to_sends_in_the_order_they_were_made(ring):
    """A send that found the ring full keeps its place: a later one may not take a slot
    freed meanwhile; a send given up lets the next one through."""
    out, inbox = ring
    sent = iter(range(100))  # the numbers of the messages published, in order

    def send(ticket: int) -> bool:
        slot = out.claim(ticket)
        if slot is not None:
            out.publish(slot, 5, next(sent), 0, DATA)
        return slot is not None

    taken = iter(range(100))

    def take() -> None:
        _take_one(inbox, 5, next(taken))

    for _ in range(SLOTS):
        assert send(out.ticket())
    first = out.ticket()
    assert not send(first)  # full
    take()
    later = out.ticket()
    assert not send(later)  # a slot is free, but `first` came before
    assert send(first)
    assert not send(later)  # full again
    take()
    assert send(later)
    # a send given up in its turn
    gone, after = out.ticket(), out.ticket()
    out.skip(gone)
    take()
    assert send(after)
    # and one given up before its turn
    a, b, c = out.ticket(), out.ticket(), out.ticket()
    out.skip(b)
    take()
    take()
    assert not send(c) and send(a)
    assert send(c)  # b was given up: c is next


def test_posted_receives_are_landed_by_progress(ring):
    out, inbox = ring
    early = np.arange(8, dtype=np.uint8)
    _send(out, 0, 0, early)
    got0 = np.zeros(8, np.uint8)
    rec0 = Posted(Region(8, got0), 0, 0, None)
    found = inbox.post(rec0)
    assert found is not None  # here already: taken at once
    inbox.free(found)
    recs = [Posted(Region(4, np.zeros(4, np.uint8)), 5, k, None) for k in range(3)]
    for rec in recs:
        assert inbox.post(rec) is None
    assert inbox.progress() == []  # nothing published since
    _send(out, 5, 2, np.full(4, 2, np.uint8))
    _send(out, 6, 0, np.full(4, 9, np.uint8))  # nobody has posted it
    _send(out, 5, 0, np.full(4, 0, np.uint8))
    hits = inbox.progress()
    assert sorted(rec.number for _, rec in hits) == [0, 2]
    for found, rec in hits:
        assert np.array_equal(_taken(inbox, found), np.full(4, rec.number, np.uint8))
        inbox.free(found)
    assert inbox.progress() == []
    assert list(inbox.posted) == [(5, 1)]
    assert inbox.unpost(recs[1]) and not inbox.unpost(recs[1])
    other = inbox.take(6, 0)
    assert other is not None and np.array_equal(_taken(inbox, other), np.full(4, 9, np.uint8))


def test_a_marker_carries_the_size_and_no_data(ring):
    out, inbox = ring
    slot = out.claim(out.ticket())
    assert slot is not None
    out.publish(slot, 3, 7, 1 << 30, RAILS)
    found = inbox.take(3, 7)
    assert found is not None and found.kind == RAILS and found.nbytes == 1 << 30
    inbox.free(found)
    assert out.head[slot, PUB] == out.head[slot, FREED] == 1


def test_an_unpublished_slot_is_not_seen(ring):
    out, inbox = ring
    slot = out.claim(out.ticket())
    assert slot is not None
    out.put(slot, np.ones(4, np.uint8))
    assert inbox.take(0, 0) is None  # claimed and written, not published
    out.unclaim(slot)
    assert out.claim(out.ticket()) == slot


def test_a_message_sent_and_received_in_one_step(ring):
    """EagerOut.send claims, fills and publishes the slot after the last one taken in one
    step, EagerIn.receive copies it out and frees it; each does nothing, and says so, where
    the general path must run (another ticket's turn, a busy slot; another message, size or
    kind in that slot), and the general path then finds what is there."""
    out, inbox = ring
    rng = np.random.default_rng()
    data = [rng.integers(0, 255, 20 + i, dtype=np.uint8) for i in range(SLOTS + 1)]
    assert out.send(data[0].data, 1, 0, out.ticket())
    got = np.full(data[0].nbytes + 4, 7, np.uint8)
    assert not inbox.receive(got[:-4].data, 1, 1)  # another number
    assert not inbox.receive(got[:-4].data, 2, 0)  # another tag
    assert not inbox.receive(got[:-3].data, 1, 0)  # another size
    assert (got == 7).all() and out.head[0, PUB] != out.head[0, FREED]  # nothing taken
    assert inbox.receive(got[:-4].data, 1, 0)
    assert np.array_equal(got[:-4], data[0]) and (got[-4:] == 7).all()
    assert out.head[0, PUB] == out.head[0, FREED]
    # not its turn: an earlier ticket has not taken its slot
    first, later = out.ticket(), out.ticket()
    assert not out.send(data[1].data, 1, 1, later)
    assert out.send(data[1].data, 1, 1, first) and out.send(data[2].data, 1, 2, later)
    # a marker in the next slot: the receive declines, take finds it
    slot = out.claim(out.ticket())
    assert slot is not None
    out.publish(slot, 1, 3, 8, RAILS)
    for k in (1, 2):
        got = np.zeros(data[k].nbytes, np.uint8)
        assert inbox.receive(got.data, 1, k) and np.array_equal(got, data[k])
    assert not inbox.receive(np.zeros(8, np.uint8).data, 1, 3)
    marker = inbox.take(1, 3)
    assert marker is not None and marker.kind == RAILS
    inbox.free(marker)
    # the next slot busy, another free: send declines, claim finds the free one
    for k in range(SLOTS):
        assert out.send(data[k].data, 2, k, out.ticket())
    found = inbox.take(2, 1)  # the second slot of the four
    assert found is not None
    inbox.free(found)
    ticket = out.ticket()
    assert not out.send(data[SLOTS].data, 3, 0, ticket)
    assert out.claim(ticket) == found.slot


def test_searches_stop_at_the_messages_not_taken(ring):
    """A search of the ring ends once it has seen every message not taken yet, wherever they
    lie (the slots wrap, freed out of order), and progress and take still find every one."""
    out, inbox = ring
    for k in range(SLOTS):
        _send(out, 4, k, np.full(4, k, np.uint8))
    for k in (2, 0):
        _take_one(inbox, 4, k)
    assert inbox.take(4, 9) is None
    recs = [Posted(Region(4, np.zeros(4, np.uint8)), 4, k, None) for k in (4, 5)]
    for rec in recs:
        assert inbox.post(rec) is None
    for k in (4, 5):  # into the two freed slots
        _send(out, 4, k, np.full(4, k, np.uint8))
    hits = inbox.progress()
    assert sorted(rec.number for _, rec in hits) == [4, 5]
    for found, rec in hits:
        assert np.array_equal(_taken(inbox, found), np.full(4, rec.number, np.uint8))
        inbox.free(found)
    assert not inbox.posted and inbox.progress() == []
    for k in (3, 1):
        _take_one(inbox, 4, k)
    assert inbox.take(4, 1) is None
    assert (out.head[:, PUB] == out.head[:, FREED]).all()


needs_cma = pytest.mark.skipif(cma.unavailable() is not None, reason=f"{cma.unavailable()}")


def _lend(out: EagerOut, tag: int, number: int, data: np.ndarray) -> tuple[int, int]:
    slot = out.claim(out.ticket())
    assert slot is not None
    return slot, out.lend(slot, tag, number, data.nbytes, data.ctypes.data)


@needs_cma
def test_the_receiver_probes_and_reads_a_pull_message_from_the_senders_array(ring):
    out, inbox = ring
    assert inbox.reads_why is None and out.readable
    rng = np.random.default_rng()
    data = rng.integers(0, 255, 3 * SLOT_BYTES + 5, dtype=np.uint8)  # larger than a slot
    slot, pub = _lend(out, 2, 0, data)
    assert out.claim(out.ticket()) != slot  # held until released
    found = inbox.take(2, 0)
    assert found is not None and found.kind == PULL and found.nbytes == data.nbytes
    dst = np.full(data.nbytes + 8, 7, np.uint8)
    assert inbox.pull(found, dst.ctypes.data)
    assert np.array_equal(dst[: data.nbytes], data) and (dst[data.nbytes :] == 7).all()
    assert not pull.lent_back(out, slot, pub, data.nbytes, 0, 1)  # not freed yet
    inbox.free(found, data.nbytes)
    assert pull.lent_back(out, slot, pub, data.nbytes, 0, 1)


@needs_cma
def test_what_the_receiver_found_fails_the_sender(ring):
    out, inbox = ring
    data = np.arange(SLOT_BYTES * 2, dtype=np.uint8)
    slot, pub = _lend(out, 1, 0, data)
    found = inbox.take(1, 0)
    assert found is not None
    inbox.free(found, 100)  # a receive of 100 bytes
    with pytest.raises(MismatchError, match=f"sends {data.nbytes} bytes, rank 1 receives 100"):
        pull.lent_back(out, slot, pub, data.nbytes, 0, 1)
    slot, pub = _lend(out, 1, 1, data)
    found = inbox.take(1, 1)
    assert found is not None
    inbox.free(found)  # freed unread: the receive failed
    with pytest.raises(HetcommError, match="could not read"):
        pull.lent_back(out, slot, pub, data.nbytes, 0, 1)


@needs_cma
def test_a_withdrawn_message_is_never_taken_as_data(ring):
    """Withdrawn before the read: the receiver sees GONE; during it (the sender's array
    changes after its withdrawal): the read says so; the slot comes back once freed."""
    out, inbox = ring
    data = np.ones(SLOT_BYTES * 2, np.uint8)
    slot, pub = _lend(out, 4, 0, data)
    assert not pull.give_up(out, slot, pub, data.nbytes, 0, 1)
    found = inbox.take(4, 0)
    assert found is not None and found.kind == GONE
    inbox.free(found)
    slot, pub = _lend(out, 4, 1, data)
    found = inbox.take(4, 1)
    assert found is not None and found.kind == PULL
    out.withdraw(slot, pub)  # as a sender whose wait ran out would, while the receiver reads
    data[:] = 9
    dst = np.zeros(data.nbytes, np.uint8)
    assert not inbox.pull(found, dst.ctypes.data)
    inbox.free(found)
    out.release(slot)
    assert sorted(s for s in (out.claim(out.ticket()) for _ in range(SLOTS)) if s is not None) == [
        *range(SLOTS)
    ]


@needs_cma
def test_a_read_of_a_range_the_sender_no_longer_maps_fails(ring):
    out, inbox = ring
    data = np.ones(16, np.uint8)
    slot = out.claim(out.ticket())
    assert slot is not None
    pub = out.lend(slot, 0, 0, 1 << 20, 8)  # an address nobody maps
    found = inbox.take(0, 0)
    assert found is not None
    with pytest.raises(OSError):
        inbox.pull(found, data.ctypes.data)
    inbox.free(found)
    assert out.collect(slot, pub) == NOT_READ


@needs_cma
def test_slots_of_pull_messages_read_come_back_before_their_sends_look(ring):
    """A ring full of PULL messages that the receiver has read and freed: the next send
    takes a slot back although no send of them has looked yet (their callers wait on other
    things first), and each send then finds what the receiver wrote of its own message,
    whatever the slot holds by then. Withdrawing a message whose slot came back so leaves
    the slot's new message alone."""
    out, inbox = ring
    rng = np.random.default_rng()
    arrays = [rng.integers(0, 255, SLOT_BYTES + 1 + i, dtype=np.uint8) for i in range(SLOTS)]
    lent = [_lend(out, 5, i, a) for i, a in enumerate(arrays)]
    waiting = out.ticket()
    assert out.claim(waiting) is None  # full
    for i, a in enumerate(arrays):
        found = inbox.take(5, i)
        assert found is not None and found.kind == PULL
        dst = np.zeros(a.nbytes, np.uint8)
        assert inbox.pull(found, dst.ctypes.data) and np.array_equal(dst, a)
        inbox.free(found, a.nbytes - (i == 2))  # the third receive took a byte less
    fresh = rng.integers(0, 255, 9, dtype=np.uint8)
    slot = out.claim(waiting)  # a slot of a PULL message, taken back
    assert slot in {s for s, _ in lent}
    out.put(slot, fresh)
    out.publish(slot, 6, 0, fresh.nbytes, DATA)
    for s, pub in lent:
        assert out.returned(s, pub)
        out.withdraw(s, pub)  # too late: harmless
    found = inbox.take(6, 0)
    assert found is not None and found.kind == DATA and np.array_equal(_taken(inbox, found), fresh)
    inbox.free(found)
    for i, (s, pub) in enumerate(lent):
        assert out.collect(s, pub) == arrays[i].nbytes - (i == 2)


def test_a_receiver_told_not_to_read_says_so():
    name = f"hetcomm-test-{uuid.uuid4().hex[:12]}"
    size = segment_bytes(SLOTS, SLOT_BYTES)
    out = EagerOut(SharedSlots(name, 1, size, create=True), SLOTS, SLOT_BYTES)
    inbox = EagerIn(SharedSlots(name, 1, size, create=False), SLOTS, SLOT_BYTES, reads=False)
    out.unlink()
    try:
        assert inbox.reads_why == "switched off" and not out.readable
        assert not pull.lends(out, Region(4, np.zeros(4, np.uint8)))
    finally:
        out.close()
        inbox.close()


def test_the_probe_tells_another_process_from_the_one_it_names():
    word = np.array([12345], np.int64)
    assert cma.probe(os.getpid(), word.ctypes.data, 12345) in (None, cma.unavailable())
    if cma.unavailable() is None:
        assert "another process" in str(cma.probe(os.getpid(), word.ctypes.data, 54321))
        assert cma.probe(2**22 + 12345, word.ctypes.data, 12345) is not None  # no such pid


def test_a_dozing_receiver_wakes_when_the_sender_publishes(ring):
    """A doze without a publish lasts its time; one that a publish from another thread
    interrupts ends at once, and one after a publish the last look did not see does not sleep;
    DOZING counts the dozers and is 0 again after; once the sender's end has closed, a doze
    sleeps instead of waking at the pipe's end of file."""
    import threading
    import time

    out, inbox = ring
    assert inbox.take(9, 9) is None  # a look into the ring, as a wait's makes before it dozes
    t0 = time.monotonic()
    inbox.doze(0.05)
    assert time.monotonic() - t0 >= 0.045
    assert out.words[DOZING] == 0

    def publish_soon() -> None:
        time.sleep(0.02)
        _send(out, 1, 0, np.zeros(4, np.uint8))

    thread = threading.Thread(target=publish_soon)
    assert inbox.take(9, 9) is None
    t0 = time.monotonic()
    thread.start()
    inbox.doze(5.0)
    woke = time.monotonic() - t0
    thread.join()
    assert woke < 1.0, f"slept {woke:.3f} s through the publish"
    assert out.words[DOZING] == 0
    t0 = time.monotonic()
    inbox.doze(0.05)  # published since the last look: no sleep
    assert time.monotonic() - t0 < 0.04
    out.close()
    t0 = time.monotonic()
    for _ in range(3):
        assert inbox.take(9, 9) is None
        inbox.doze(0.02)
    assert time.monotonic() - t0 >= 0.055  # slept each time, no spinning on end of file


def test_a_closed_ring_leaves_no_mapping():
    """Closing a ring unmaps its segment at once, views and all, rather than when the
    collector frees the ring (which kept 2 MiB per pair and communicator mapped); a thread
    that still looks afterwards finds nothing."""
    name = f"hetcomm-test-{uuid.uuid4().hex[:12]}"
    size = segment_bytes(SLOTS, SLOT_BYTES)
    out = EagerOut(SharedSlots(name, 1, size, create=True), SLOTS, SLOT_BYTES)
    inbox = EagerIn(SharedSlots(name, 1, size, create=False), SLOTS, SLOT_BYTES)
    out.unlink()
    _send(out, 3, 0, np.arange(4, dtype=np.float32))
    assert len(mapped_files(name)) == 2
    out.close()
    inbox.close()
    assert mapped_files(name) == []
    assert inbox.take(3, 0) is None
    assert not inbox.data.any()
