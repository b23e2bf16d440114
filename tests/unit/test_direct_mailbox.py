"""The direct transport's mailbox (direct/mailbox.py) between two ranks, both in this process
over one shared buffer: lends are received in order per key whatever order the keys are
received in, a full ring or ticket set makes a lend wait and frees up as the peer takes and
answers, tickets come back with their generation, and every "done" reaches its own lend."""

from __future__ import annotations

import numpy as np
import pytest

from hetcomm.transports.direct import mailbox
from hetcomm.transports.direct.mailbox import RING, TICKETS, ShmPost
from hetcomm.transports.direct.peer import RECORD

pytestmark = pytest.mark.skipif(
    mailbox.lanes_bytes([0, 0], ["h", "h"]) == 0, reason="this CPU may reorder stores"
)


def _rec(rng: np.random.Generator, nbytes: int) -> np.ndarray:
    rec = np.zeros(1, RECORD)
    rec.view(np.uint8)[:] = rng.integers(0, 256, RECORD.itemsize, dtype=np.uint8)
    rec["nbytes"] = nbytes
    return rec


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng()


@pytest.fixture
def pair():
    size = 3  # a third rank's lanes sit between, never written
    shared = bytearray(mailbox.lanes_bytes([0] * size, ["h"] * size))
    posts = [ShmPost(memoryview(shared), r, size) for r in range(2)]
    yield posts, shared
    for p in posts:
        p.close()


def test_lends_match_in_order_per_key_across_keys(pair, rng) -> None:
    (a, b), _ = pair
    sent = {k: [_rec(rng, 100 * k + i) for i in range(5)] for k in (64, 68, 72)}
    lends = []
    for i in range(5):
        for k in (72, 64, 68):  # interleaved keys
            lend = a.lend(1, k, sent[k][i])
            assert lend is not None
            lends.append((k, i, lend))
    # b receives key 68 first, then 64 (one posted before the lends are taken), then 72
    early = b.expect(0, 64)
    for i in range(5):
        e = b.expect(0, 68)
        assert e.Test()
        assert e.got.tobytes() == sent[68][i].tobytes()
        b.done(0, e, 7 + i)
    assert early.Test() and early.got.tobytes() == sent[64][0].tobytes()
    b.done(0, early, 1000)
    rest = [b.expect(0, 64) for _ in range(4)] + [b.expect(0, 72) for _ in range(5)]
    assert all(e.Test() for e in rest)
    for n, e in enumerate(rest):
        b.done(0, e, 2000 + n)
    assert [e.got.tobytes() for e in rest] == [r.tobytes() for r in sent[64][1:] + sent[72]]
    # each "done" reached its own lend
    by = {(k, i): lend for k, i, lend in lends}
    assert all(lend.Test() for lend in by.values())
    assert [by[68, i].copied for i in range(5)] == [7, 8, 9, 10, 11]
    assert by[64, 0].copied == 1000
    assert [by[64, i].copied for i in range(1, 5)] == [2000, 2001, 2002, 2003]
    assert [by[72, i].copied for i in range(5)] == [2004 + i for i in range(5)]


def test_a_receive_waits_for_its_lend_and_a_lend_for_its_done(pair, rng) -> None:
    (a, b), _ = pair
    e = b.expect(0, 64)
    assert not e.Test()
    rec = _rec(rng, 4096)
    lend = a.lend(1, 64, rec)
    assert not lend.Test()
    assert e.Test() and e.got.tobytes() == rec.tobytes()
    assert not lend.Test()  # taken, not yet answered
    b.done(0, e, 4096)
    assert lend.Test() and lend.copied == 4096
    # the other direction uses the other lanes
    e2 = a.expect(1, 64)
    lend2 = b.lend(0, 64, rec)
    assert e2.Test() and e2.got.tobytes() == rec.tobytes()
    a.done(1, e2, 5)
    assert lend2.Test() and lend2.copied == 5


def test_a_full_ring_waits_until_the_peer_takes(pair, rng) -> None:
    (a, b), _ = pair
    recs = [_rec(rng, i) for i in range(RING + 1)]
    lends = [a.lend(1, 64 + 4 * (i % 3), recs[i]) for i in range(RING)]
    assert all(lend is not None for lend in lends)
    assert a.lend(1, 64, recs[RING]) is None
    room = a.room(1)
    assert not room.Test()
    e = b.expect(0, 999)  # a receive of another key takes every entry
    assert not e.Test()
    assert room.Test()
    last = a.lend(1, 64, recs[RING])
    assert last is not None
    got = [b.expect(0, 64) for _ in range(len(range(0, RING, 3)) + 1)]
    assert all(g.Test() for g in got)
    assert got[-1].got.tobytes() == recs[RING].tobytes()


def test_tickets_run_out_and_come_back_with_a_new_generation(pair, rng) -> None:
    (a, b), _ = pair
    rec = _rec(rng, 8)
    out = []
    for _ in range(TICKETS):
        lend = a.lend(1, 64, rec)
        if lend is None:  # the ring is full: the peer takes its entries
            b.expect(0, 1).Test()
            lend = a.lend(1, 64, rec)
        out.append(lend)
    b.expect(0, 1).Test()
    assert a.lend(1, 64, rec) is None and not a.room(1).Test()
    es = [b.expect(0, 64) for _ in range(TICKETS)]
    assert all(e.Test() for e in es)
    b.done(0, es[5], 8)
    assert out[5].Test() and a.room(1).Test()
    again = a.lend(1, 64, rec)
    assert again is not None and again.ticket == out[5].ticket and again.gen == out[5].gen + 1
    assert not again.Test()  # the old generation's "done" is not this one's
    e = b.expect(0, 64)
    assert e.Test()
    b.done(0, e, 3)
    assert again.Test() and again.copied == 3
    assert not any(out[i].Test() for i in range(TICKETS) if i != 5)


def test_only_the_two_ranks_lanes_are_written(pair, rng) -> None:
    (a, b), shared = pair
    e = b.expect(0, 64)
    a.lend(1, 64, _rec(rng, 1))
    assert e.Test()
    b.done(0, e, 1)
    words = np.frombuffer(shared, np.int64)
    lane = len(words) // 6  # 3 ranks: 6 lanes, in order (0,1) (0,2) (1,0) (1,2) (2,0) (2,1)
    written = {i // lane for i in np.flatnonzero(words)}
    assert written == {0, 2}
