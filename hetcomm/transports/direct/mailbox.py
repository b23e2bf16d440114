"""Where a direct message's record and its "done" travel: shared words, or MPI messages.

A send or receive of the direct transport is two messages between the pair (pointtopoint.py):
the lending rank hands the copying rank its buffer's record, and the copier, once its copy has
run, hands back "done" with the size it copied. The ranks of a direct group share one host, so
both go through the group's mailbox, words in the arrivals segment every rank of the group maps
(arrivals.Arrivals): a lend is a few stores, a "done" one more, and either side finds its answer by
reading a word, on whichever thread drives the operation, with no MPI call and no thread of
MPI's in between. Where the group has no such segment (a CPU that may reorder stores:
flags.py; no shared memory to be had) the same two messages go as MPI messages instead
(`MpiPost`); both posts offer one interface, so the protocol is written once.

The mailbox holds one lane per ordered pair of ranks (w, r), written by w alone:
- TAKEN: how many of r's lends to w that w has taken out of r's ring (r reuses a slot once its
  entry is taken);
- w's ring of lends to r: RING slots of a publish word (PUB = position + 1, written last), the
  message's key (its tag), the ticket of its "done", that ticket's generation, and the record;
- the "done"s of r's lends that w copied, one row per ticket of r's: the bytes copied, then the
  generation (written last).
A lender holds a ticket from its lend until it has read the "done"; the copier takes the ring's
entries in order, each to the oldest receive of its key waiting for one, else into a queue of
its key until one is posted (as MPI matches messages of one source and tag in order). The
ring's slots free up as the copier takes entries, whatever their key, so the lends of one key
never hold back another key's; TICKETS lends to one peer wait for a "done" at most, and more
wait (bounded by the operation's timeout) for one of theirs to come back.

Each word has one writing process, and within it one thread at a time (the mailbox's lock);
readers rely on x86-64's store order (flags.py): a PUB or a generation is written after what it
publishes, and read before it.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
from mpi4py import MPI

from .. import flags
from .peer import RECORD
from .proxy import Poll

RING = 32  # lends to one peer not yet taken by it
TICKETS = 256  # lends to one peer not yet answered "done"
_REC = RECORD.itemsize // 8  # a record's words
PUB, KEY, TICKET, GEN = range(4)  # a ring slot's words before its record
_SLOT = 4 + _REC
_HEAD = 8  # a lane's first words (TAKEN, then the rest of its cache line)
_DONE = _HEAD + RING * _SLOT  # where a lane's "done" rows start
_LANE = _DONE + 2 * TICKETS  # a lane's words


def lanes_bytes(devices: Sequence[Any], hosts: Sequence[str]) -> int:
    """The bytes of the mailbox of a group whose ranks have `devices` on `hosts`: none unless
    every rank has a device on one host (where direct may serve the group) and this CPU keeps
    its stores in order."""
    size = len(devices)
    if size < 2 or len(set(hosts)) != 1 or any(d is None for d in devices):
        return 0
    if flags.unsupported() is not None:
        return 0
    return 8 * _LANE * size * (size - 1)


class Post(Protocol):
    """Where records and "done"s travel (ShmPost, MpiPost). A lend and an expect have Test()
    and `wait` (what the proxy waits for); a lend's `copied` and an expect's `got` hold what
    came once Test() is True."""

    def lend(self, peer: int, key: int, rec: np.ndarray) -> Any:
        """Lend `rec` to `peer` under `key`; None where it must wait for room()."""
        ...

    def expect(self, peer: int, key: int) -> Any:
        """A receive of `peer`'s next lend under `key` (posted in issue order)."""
        ...

    def done(self, peer: int, e: Any, nbytes: int) -> Any:
        """Answer the lend `e` received; what to wait for before it is out (None: nothing)."""
        ...

    def room(self, peer: int) -> Any:
        """What to wait for before lending to `peer` again."""
        ...

    def close(self) -> None:
        """Let go of what the post holds."""
        ...


class ShmPost:
    """The mailbox of one rank of a group (`lanes`: the group's mailbox, lanes_bytes long)."""

    def __init__(self, lanes: memoryview, rank: int, size: int) -> None:
        self.raw = lanes[:]  # views of its own, let go at close
        self.words = self.raw.cast("q")
        self.rank = rank
        self._lock = threading.Lock()
        # the first word of our lane to each peer p, and of p's to us (none to ourselves)
        self._out = [self._lane(rank, p, size) if p != rank else -1 for p in range(size)]
        self._in = [self._lane(p, rank, size) if p != rank else -1 for p in range(size)]
        self._sent = [0] * size  # lends written into our ring to each peer
        self._taken = [0] * size  # entries taken out of each peer's ring to us
        self._tickets = [list(range(TICKETS - 1, -1, -1)) for _ in range(size)]
        self._gens = [[0] * TICKETS for _ in range(size)]
        # per (peer, key): entries taken that no receive has yet, and receives waiting for one
        self._arrived: dict[tuple[int, int], deque[tuple[bytes, int, int]]] = {}
        self._waiting: dict[tuple[int, int], deque[Expect]] = {}

    @staticmethod
    def _lane(w: int, r: int, size: int) -> int:
        """The first word of the lane w writes for r (w != r)."""
        return _LANE * (w * (size - 1) + (r if r < w else r - 1))

    def lend(self, peer: int, key: int, rec: np.ndarray) -> Lend | None:
        """Hand `peer` the record `rec` under `key`: its "done" to wait for, or None where the
        ring to `peer` is full or every ticket is out (room() says when to try again)."""
        words = self.words
        with self._lock:
            pos = self._sent[peer]
            tickets = self._tickets[peer]
            if pos - words[self._in[peer]] >= RING or not tickets:
                return None
            t = tickets.pop()
            gen = self._gens[peer][t] = self._gens[peer][t] + 1
            s = self._out[peer] + _HEAD + (pos % RING) * _SLOT
            words[s + KEY], words[s + TICKET], words[s + GEN] = key, t, gen
            self.raw[8 * (s + 4) : 8 * (s + 4 + _REC)] = rec.view(np.uint8).data
            words[s + PUB] = pos + 1
            self._sent[peer] = pos + 1
        return Lend(self, peer, t, gen)

    def room(self, peer: int) -> Room:
        """What is ready once a lend to `peer` can be written."""
        return Room(self, peer)

    def has_room(self, peer: int) -> bool:
        """Whether a lend to `peer` can be written now."""
        return self._sent[peer] - self.words[self._in[peer]] < RING and bool(self._tickets[peer])

    def expect(self, peer: int, key: int) -> Expect:
        """A receive of `peer`'s next lend under `key` (posted in issue order)."""
        e = Expect(self, peer)
        with self._lock:
            arrived = self._arrived.get((peer, key))
            if arrived:
                e.fill(*arrived.popleft())
            else:
                self._waiting.setdefault((peer, key), deque()).append(e)
        return e

    def done(self, peer: int, e: Expect, nbytes: int) -> None:
        """Answer `peer`'s lend that `e` received: `nbytes` copied."""
        at = self._out[peer] + _DONE + 2 * e.ticket
        self.words[at + 1] = nbytes
        self.words[at] = e.gen

    def take(self, peer: int) -> None:
        """Take every entry published in `peer`'s ring to us, in order."""
        words = self.words
        with self._lock:
            pos = start = self._taken[peer]
            base = self._in[peer] + _HEAD
            while True:
                s = base + (pos % RING) * _SLOT
                if words[s + PUB] != pos + 1:
                    break
                key, ticket, gen = words[s + KEY], words[s + TICKET], words[s + GEN]
                rec = bytes(self.raw[8 * (s + 4) : 8 * (s + 4 + _REC)])
                pos += 1
                waiting = self._waiting.get((peer, key))
                if waiting:
                    waiting.popleft().fill(rec, ticket, gen)
                else:
                    self._arrived.setdefault((peer, key), deque()).append((rec, ticket, gen))
            if pos != start:
                self._taken[peer] = pos
                words[self._out[peer]] = pos  # our TAKEN of peer's ring

    def answered(self, lend: Lend) -> bool:
        """Whether `lend`'s "done" is in; it then holds the bytes copied and its ticket is
        free again."""
        at = self._in[lend.peer] + _DONE + 2 * lend.ticket
        if self.words[at] != lend.gen:
            return False
        lend.copied = self.words[at + 1]
        self._tickets[lend.peer].append(lend.ticket)
        return True

    def close(self) -> None:
        """Let the segment go (the arrivals segment is unmapped after the transports close)."""
        self.words.release()
        self.raw.release()


class Lend(Poll):
    """A lend's "done": Test() once it is in; `copied` then holds the bytes the peer copied."""

    __slots__ = ("copied", "gen", "peer", "post", "ticket")

    def __init__(self, post: ShmPost, peer: int, ticket: int, gen: int) -> None:
        self.post, self.peer, self.ticket, self.gen = post, peer, ticket, gen
        self.copied = -1

    @property
    def wait(self) -> Lend:
        """What the proxy waits for: this."""
        return self

    def Test(self) -> bool:
        """Whether the "done" is in."""
        return self.copied >= 0 or self.post.answered(self)


class Expect(Poll):
    """A receive of a lend: Test() once one came; `got` then holds its record."""

    __slots__ = ("gen", "got", "peer", "post", "ticket")

    def __init__(self, post: ShmPost, peer: int) -> None:
        self.post, self.peer = post, peer
        self.got: np.ndarray | None = None
        self.ticket = self.gen = -1

    def fill(self, rec: bytes, ticket: int, gen: int) -> None:
        """Take the lend of `rec` (whose "done" goes to `ticket` of generation `gen`)."""
        self.ticket, self.gen = ticket, gen
        self.got = np.frombuffer(bytearray(rec), RECORD)  # last: Test() reads it first

    @property
    def wait(self) -> Expect:
        """What the proxy waits for: this."""
        return self

    def Test(self) -> bool:
        """Whether a lend came (taking what the peer published)."""
        if self.got is None:
            self.post.take(self.peer)
        return self.got is not None


class Room(Poll):
    """Ready once a lend to `peer` can be written."""

    __slots__ = ("peer", "post")

    def __init__(self, post: ShmPost, peer: int) -> None:
        self.post, self.peer = post, peer

    def Test(self) -> bool:
        """Whether a lend can be written now."""
        return self.post.has_room(self.peer)


class MpiPost:
    """The same messages as MPI messages on the service communicator: a record under its key
    (a tag), "done" under key + 1."""

    def __init__(self, svc: MPI.Intracomm) -> None:
        self.svc = svc

    def lend(self, peer: int, key: int, rec: np.ndarray) -> MpiLend:
        """The record sent, and the receive of its "done" posted."""
        return MpiLend(self.svc, peer, key, rec)

    def expect(self, peer: int, key: int) -> MpiExpect:
        """The receive of a record posted."""
        return MpiExpect(self.svc, peer, key)

    def done(self, peer: int, e: MpiExpect, nbytes: int) -> MPI.Request:
        """The "done" sent."""
        return self.svc.Isend(np.array([nbytes], np.int64), peer, e.key + 1)

    def room(self, peer: int) -> None:
        """Never asked for: an MPI lend is always written."""
        raise AssertionError("an MPI lend is always written")

    def close(self) -> None:
        """Nothing held."""


class MpiLend:
    """A record sent and its "done" awaited, as MPI messages."""

    __slots__ = ("_done", "wait")

    def __init__(self, svc: MPI.Intracomm, peer: int, key: int, rec: np.ndarray) -> None:
        self._done = np.full(1, -1, np.int64)
        self.wait = [svc.Isend(rec.view(np.uint8), peer, key), svc.Irecv(self._done, peer, key + 1)]

    @property
    def copied(self) -> int:
        """The bytes the peer copied (-1 before its "done")."""
        return int(self._done[0])

    def Test(self) -> bool:
        """Whether both messages are through."""
        return bool(MPI.Request.Testall(self.wait))


class MpiExpect:
    """A record awaited as an MPI message."""

    __slots__ = ("got", "key", "wait")

    def __init__(self, svc: MPI.Intracomm, peer: int, key: int) -> None:
        self.key = key
        self.got = np.empty(1, RECORD)
        self.wait = svc.Irecv(self.got.view(np.uint8), peer, key)

    def Test(self) -> bool:
        """Whether the record came."""
        return bool(self.wait.Test())
