"""How a lent buffer's record reaches the rank that copies, and that rank's "done" comes back.

A direct send or receive has a lender (it publishes its buffer's record) and a copier (it
takes the record, copies into or out of the lender's buffer, and says "done" with the bytes it
copied); `schedule.copier` names which is which. Between two ranks of a host whose CPU keeps
stores in order (`flags.unsupported`), the record and the "done" go through shared words: per
ordered pair (lender -> copier) a ring of record slots, staged's eager ring
(`staged/eager.py`) with slots of one record. The lender copies its record into a free slot
and publishes it as message (tag, number): the user tag and the message's direction
(`_ring_tag`), and the how-many-th message of that direction and user tag, which both ends
count in issue order (`Posts.number`), so a record meets exactly its copy, as MPI's in-order
matching of one tag would make it; the copier takes
it and frees the slot with the bytes it copied in the slot's STATUS: that is its "done". No
MPI message and no thread: each side's wait is a poll of one word, on whichever thread runs
the operation (the proxy's `Polled` wait, or the prepared call's own).

Elsewhere (a CPU that may reorder stores, or no room in /dev/shm) the two travel as MPI
messages on the service communicator, the record then the "done", under the tags of the
message's user tag (`DirectTransport._tags`), and MPI's matching keeps them in order.

The two ends of a pair open their rings at their first send or receive with each other
(`open`, a step that either path runs): each makes the ring of its own records, they swap the
names, each maps the other's and says whether it could, and each then unlinks its own name,
so nothing of theirs stays in /dev/shm. A direction whose ring could not be made or mapped
takes MPI messages, which both ends then know.

A lender that gives up (its wait timed out, the transport closes) withdraws its record: the
copier that takes it afterwards copies nothing and frees it unread; one that took it already
may still copy, as it could after an MPI record had been received.
"""

from __future__ import annotations

import itertools
import logging
import secrets
from collections.abc import Generator
from typing import Any

import numpy as np
from mpi4py import MPI

from ...errors import HetcommError
from .. import flags, tags
from ..shm import SegmentError, SharedSlots
from ..staged.eager import NOT_READ, EagerIn, EagerOut, segment_bytes
from .peer import RECORD

log = logging.getLogger("hetcomm")

# records a lender may have published and not had answered, per ordered pair: a send waits for
# a free slot beyond this (it is more than any program here keeps in flight to one peer)
SLOTS = 64
_SLOT_BYTES = 128  # one record (96 bytes), in whole cache lines
_NAME_BYTES = 96  # a ring's name as it travels (ASCII, zero-padded; empty: no ring)


class Polled:
    """A wait on words another process writes: there is no MPI request to block in, so the
    proxy calls `test` until it holds (direct/proxy.py); `ring`: the ring whose publish ends
    it, whose sender wakes a thread dozing on it (`EagerIn.doze`), or None."""

    __slots__ = ("ring", "test")

    def __init__(self, test: Any, ring: EagerIn | None = None) -> None:
        self.test, self.ring = test, ring


Step = Generator[Any, None, None]


class Withdrawn(HetcommError):
    """The lender took its record back before this rank copied (it gave up or closed)."""


class _MpiLent:
    """A lent record sent as an MPI message, and the receive of the copier's "done"."""

    __slots__ = ("done", "rec", "reqs", "wait")

    def __init__(self, svc: MPI.Intracomm, rec: np.ndarray, peer: int, pair: tuple[int, int]):
        self.rec = rec  # kept until sent
        self.done = np.zeros(1, np.int64)
        self.reqs = [
            svc.Isend(rec.view(np.uint8), peer, pair[0]),
            svc.Irecv(self.done, peer, pair[1]),
        ]
        self.wait: Any = self.reqs

    def test(self) -> bool:
        return bool(MPI.Request.Testall(self.reqs))

    def copied(self) -> int:
        """The bytes the copier copied (once `test` held)."""
        return int(self.done[0])

    def withdraw(self) -> None:
        """Nothing to take back: an MPI message, once sent, is the peer's."""


class _RingLent:
    """A lent record in a slot of the ring to the copier: published in its turn (`ticket`,
    drawn when lent: records leave in the order they were lent), answered once the copier
    frees the slot."""

    __slots__ = ("_copied", "number", "pub", "rec", "ring", "slot", "tag", "ticket", "wait")

    def __init__(self, ring: EagerOut, rec: np.ndarray, tag: int, number: int) -> None:
        self.ring, self.rec, self.tag, self.number = ring, rec, tag, number
        self.ticket = ring.ticket()
        self.slot: int | None = None
        self.pub = 0
        self._copied: int | None = None
        self.wait: Any = Polled(self.test)
        self._publish()

    def _publish(self) -> bool:
        ring = self.ring
        slot = ring.claim(self.ticket)
        if slot is None:  # every slot is waiting for its copier, or an earlier record is
            return False
        ring.put(slot, self.rec.view(np.uint8))
        self.pub = ring.lend(slot, self.tag, self.number, self.rec.nbytes, 0)
        self.slot = slot
        return True

    def test(self) -> bool:
        if self._copied is not None:
            return True
        slot = self.slot
        if slot is None:
            if not self._publish():
                return False
            slot = self.slot
        ring = self.ring
        if not ring.returned(slot, self.pub):  # type: ignore[arg-type]
            return False
        self._copied = ring.status(slot)  # type: ignore[arg-type]
        ring.release(slot)  # type: ignore[arg-type]
        return True

    def copied(self) -> int:
        return NOT_READ if self._copied is None else self._copied

    def withdraw(self) -> None:
        """Take the record back (this rank gives up the message)."""
        if self._copied is not None:
            return
        if self.slot is None:
            self.ring.skip(self.ticket)
        else:
            self.ring.withdraw(self.slot)
            # ours no more: the slot is taken again once the copier frees it
            self.ring.release(self.slot)
        self._copied = NOT_READ


class _MpiExpected:
    """The receive of a record sent as an MPI message (posted where the copy is issued)."""

    __slots__ = ("_done", "peer", "record", "req", "svc", "tags", "test", "wait")

    def __init__(self, svc: MPI.Intracomm, peer: int, pair: tuple[int, int]) -> None:
        self.svc, self.peer, self.tags = svc, peer, pair
        self.record = np.empty(1, RECORD)
        self.req = svc.Irecv(self.record.view(np.uint8), peer, pair[0])
        self.wait: Any = self.req
        self.test = self.req.Test
        self._done = np.zeros(1, np.int64)

    def withdrawn(self) -> bool:
        return False

    def answer(self, nbytes: int) -> Any:
        """Say "done" with the bytes copied: the send's request, to wait for."""
        self._done[0] = nbytes
        return self.svc.Isend(self._done, self.peer, self.tags[1])


class _RingExpected:
    """A record to take from the lender's ring, as message (tag, number)."""

    __slots__ = ("found", "number", "record", "ring", "tag", "wait")

    def __init__(self, ring: EagerIn, tag: int, number: int) -> None:
        self.ring, self.tag, self.number = ring, tag, number
        self.found: Any = None
        self.record = np.empty(1, RECORD)
        self.wait: Any = Polled(self.test, ring)

    def test(self) -> bool:
        if self.found is not None:
            return True
        found = self.ring.take(self.tag, self.number)
        if found is None:
            return False
        self.record.view(np.uint8)[:] = self.ring.view(found)[: RECORD.itemsize]
        self.found = found
        return True

    def withdrawn(self) -> bool:
        """Whether the lender has taken the record back (look just before copying)."""
        return self.ring.withdrawn(self.found)

    def answer(self, nbytes: int) -> None:
        """Say "done" with the bytes copied (NOT_READ: none): the slot goes back."""
        self.ring.free(self.found, nbytes)


class Posts:
    """The records and "done"s of one DirectTransport's sends and receives, per peer."""

    def __init__(self, svc: MPI.Intracomm, rank: int) -> None:
        self.svc, self.rank = svc, rank
        self._token = secrets.token_hex(6)
        self._numbers: dict[tuple[str, int, int], itertools.count[int]] = {}
        self.opened: set[int] = set()
        self._opening: set[int] = set()
        self._out: dict[int, EagerOut | None] = {}  # rings of our records, by copier
        self._in: dict[int, EagerIn | None] = {}  # rings of the peers' records, by lender
        self._made: list[EagerOut] = []  # every ring made, named until both ends mapped it
        self.why: str | None = flags.unsupported()  # why no ring can order records here

    def number(self, op: str, peer: int, tag: int) -> int:
        """The number of this message among those of its direction and user tag (draw it in
        issue order, once the message is certain to go)."""
        key = (op, peer, tag)
        counter = self._numbers.get(key)
        if counter is None:
            counter = self._numbers.setdefault(key, itertools.count())
        return next(counter)

    def ring(self, peer: int) -> bool:
        """Whether this rank's records to `peer` go through shared words (once opened)."""
        return self._out.get(peer) is not None

    # ---- opening ------------------------------------------------------------------------------

    def open(self, peer: int) -> Step:
        """Open the rings with `peer` (both ends at their first send or receive with each
        other); a step that waits on MPI requests, or on the open another operation began."""
        if peer in self.opened:
            return
        if peer in self._opening:
            yield Polled(lambda: peer in self.opened)
            return
        self._opening.add(peer)
        out = self._make(peer)
        try:
            yield from self._swap(peer, out)
        finally:
            if peer not in self.opened:  # it failed or was given up: nothing of it stays
                self._opening.discard(peer)
                if out is not None:
                    out.unlink()
                    out.close()
                    self._made.remove(out)

    def _swap(self, peer: int, out: EagerOut | None) -> Step:
        """Swap the rings' names with `peer`, map its ring, and swap whether each could."""
        hello = np.zeros(_NAME_BYTES, np.uint8)
        if out is not None:
            name = out.seg.name.encode()
            hello[: len(name)] = np.frombuffer(name, np.uint8)
        got = np.zeros(_NAME_BYTES, np.uint8)
        svc = self.svc
        yield [
            svc.Isend(hello, peer, tags.DIRECT_HELLO),
            svc.Irecv(got, peer, tags.DIRECT_HELLO),
        ]
        ring_in = self._map(peer, bytes(got).rstrip(b"\0").decode())
        ack = np.array([ring_in is not None], np.int8)
        their_ack = np.zeros(1, np.int8)
        yield [
            svc.Isend(ack, peer, tags.DIRECT_HELLO),
            svc.Irecv(their_ack, peer, tags.DIRECT_HELLO),
        ]
        if out is not None:
            out.unlink()  # the peer has mapped it, or will not
            if not their_ack[0]:
                out.close()
                self._made.remove(out)
                out = None
        self._out[peer], self._in[peer] = out, ring_in
        self.opened.add(peer)
        log.debug(
            "direct: records to rank %d through %s, from it through %s",
            peer,
            "shared words" if out is not None else "MPI",
            "shared words" if ring_in is not None else "MPI",
        )

    def _make(self, peer: int) -> EagerOut | None:
        if self.why is not None:
            return None
        name = f"hetcomm-d{self._token}-{self.rank}-{peer}"
        try:
            seg = SharedSlots(name, 1, segment_bytes(SLOTS, _SLOT_BYTES), create=True)
        except (SegmentError, OSError) as exc:
            log.warning("direct: records to rank %d go as MPI messages (%s)", peer, exc)
            return None
        out = EagerOut(seg, SLOTS, _SLOT_BYTES)
        self._made.append(out)
        return out

    def _map(self, peer: int, name: str) -> EagerIn | None:
        if not name:
            return None
        try:
            seg = SharedSlots(name, 1, segment_bytes(SLOTS, _SLOT_BYTES), create=False)
        except (SegmentError, OSError) as exc:
            log.warning("direct: records from rank %d come as MPI messages (%s)", peer, exc)
            return None
        return EagerIn(seg, SLOTS, _SLOT_BYTES, reads=False)

    # ---- messages -----------------------------------------------------------------------------

    def lend(
        self, peer: int, op: str, tag: int, number: int, pair: tuple[int, int], rec: np.ndarray
    ) -> _MpiLent | _RingLent:
        """Publish the record `rec` of this rank's `op` (message (`tag`, `number`)) to its
        copier `peer`; MPI messages under `pair` (record, done) where the direction has no
        ring."""
        ring = self._out.get(peer)
        if ring is None:
            return _MpiLent(self.svc, rec, peer, pair)
        return _RingLent(ring, rec, _ring_tag(tag, op == "send"), number)

    def expect(
        self, peer: int, op: str, tag: int, number: int, pair: tuple[int, int]
    ) -> _MpiExpected | _RingExpected:
        """The record of the message (`tag`, `number`) this rank's `op` copies, from its
        lender `peer`, to wait for."""
        ring = self._in.get(peer)
        if ring is None:
            return _MpiExpected(self.svc, peer, pair)
        return _RingExpected(ring, _ring_tag(tag, op == "recv"), number)

    def close(self) -> None:
        """Withdraw every record not answered, unmap every ring, unlink the names left."""
        for out in self._made:
            out.withdraw_all()
            out.unlink()
            out.close()
        for ring in self._in.values():
            if ring is not None:
                ring.close()
        self._made.clear()
        self._out.clear()
        self._in.clear()


def _ring_tag(tag: int, lender_sends: bool) -> int:
    """A record's tag in a ring, which carries the records of both directions of its pair
    where one rank copies both ways (one GPU): the user tag and whether the lender sends."""
    return 2 * tag + lender_sends


def withdrawn_error(op: str, peer: int) -> Withdrawn:
    """The copier's error for a record its lender took back before the copy."""
    return Withdrawn(
        f"{op}: rank {peer} withdrew its message before this rank copied it (it gave up the "
        "operation or closed its communicator)"
    )


def check_copied(op: str, peer: int, copied: int, nbytes: int, mismatch: Any) -> None:
    """Raise where the copier's "done" says other than `nbytes` were copied."""
    if copied == nbytes:
        return
    if copied == NOT_READ:
        raise HetcommError(
            f"{op}: rank {peer} did not copy this message (its end of the operation failed)"
        )
    raise mismatch(copied)
