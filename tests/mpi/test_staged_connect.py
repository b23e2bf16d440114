"""Opening a staged channel between ranks of one host when a shared segment cannot be made
or mapped (/dev/shm full, say): both ends of the pair fail at once with TransportUnavailable
naming the rank and the cause, nothing stays in /dev/shm, and the pair can try again."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from hetcomm import introspect
from hetcomm.errors import TransportUnavailable
from hetcomm.transports.shm import SegmentError
from hetcomm.transports.staged import connect


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("where", ["make", "map"])
def test_a_segment_that_fails_fails_both_ends(hetcomm_make_comm, errors, rng, monkeypatch, where):
    """The odd rank of each pair cannot make (or map) its shared segments: its first message
    with its partner raises TransportUnavailable on both ranks, naming the odd rank and the
    cause, well before the timeout; no segment is left; once the fault is gone the same pair
    exchanges right data. (A pair that shares no host opens no segment: its exchange just
    works.)"""
    comm = hetcomm_make_comm(transport="staged", timeout=30)
    peer = comm.rank ^ 1
    if peer >= comm.size:
        peer = None
    comm.barrier()
    staged = introspect.transports(comm)["staged"]
    made = SlotsThatFail(connect.SharedSlots, where if comm.rank % 2 else None)
    monkeypatch.setattr(connect, "SharedSlots", made)
    mine, theirs = rng.standard_normal(8), rng.standard_normal(8)  # the same on every rank
    if comm.rank % 2:
        mine, theirs = theirs, mine
    if peer is not None:
        got = np.full(8, -1.0)
        start = time.monotonic()
        try:
            _exchange(comm, peer, mine, got)
        except TransportUnavailable as exc:
            took = time.monotonic() - start
            odd = max(comm.rank, peer)
            errors.expect(made.calls > 0, f"raised without opening a segment: {exc}")
            errors.expect(f"rank {odd}: SegmentError" in str(exc), f"does not name the rank: {exc}")
            errors.expect(took < 10, f"took {took:.1f} s to fail")
            errors.expect((got == -1.0).all(), "the receive's array was written")
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
        else:
            errors.expect(made.calls == 0, f"{where}: a segment failed and the exchange passed")
        token = staged.token.hex()[:12]
        left = [f for f in os.listdir("/dev/shm") if token in f]
        errors.expect(not left, f"segments left in /dev/shm: {left}")
        monkeypatch.undo()
        if errors.run("again", _exchange, comm, peer, mine, got):
            errors.expect(np.array_equal(got, theirs), "again: wrong data")
    errors.verify()


class SlotsThatFail:
    """connect.SharedSlots, raising SegmentError (as a full /dev/shm does) where a segment
    is made (`where` "make") or mapped ("map"); None: never."""

    def __init__(self, slots: type, where: str | None) -> None:
        self.slots, self.where, self.calls = slots, where, 0

    def __call__(self, name: str, count: int, nbytes: int, create: bool, words: int = 0):
        self.calls += 1
        if self.where == ("make" if create else "map"):
            raise SegmentError(f"no room for {name} (injected)")
        return self.slots(name, count, nbytes, create=create, words=words)


def _exchange(comm, peer, send, into):
    """Even rank sends first, odd receives first."""
    if comm.rank % 2 == 0:
        comm.send(send, peer)
        comm.recv(into, peer)
    else:
        comm.recv(into, peer)
        comm.send(send, peer)
