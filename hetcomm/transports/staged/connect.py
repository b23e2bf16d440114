"""Opening the staged transport's channels: the cards a pair of ranks exchange, the links one
connects and the other accepts, and the shared segments and eager rings they map.

A channel to a peer is opened at the first operation between the two, by both together
(collectives open every channel they need at once). What it is made of follows the cards: a
link per rail the pair shares (choose_rails), and between ranks of one host the shared
segments of staged chunks and the eager ring of small messages; the segments' names are
unlinked as soon as both sides have mapped them, so that nothing stays in /dev/shm.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from mpi4py import MPI

from ...errors import HetcommError, TransportUnavailable
from .. import flags, tags
from ..shm import SegmentError, SharedSlots
from . import board, links
from .channel import Channel
from .eager import EagerIn, EagerOut, segment_bytes
from .ops import PeerTimeout
from .schedule import choose_rails, slots_that_fit

if TYPE_CHECKING:
    from .transport import StagedTransport

log = logging.getLogger("hetcomm")


class Opener:
    """Opens the channels of one StagedTransport into its `_channels`, one lock per peer."""

    def __init__(self, t: StagedTransport) -> None:
        self._t = t
        self._lock = threading.Lock()  # the peer locks' creation
        self._peer_locks: dict[int, threading.Lock] = {}

    def open(self, peers: list[int], deadline: float) -> list[Channel]:
        """Channels to `peers`, the missing ones opened together.

        Each peer must ask for a set that holds this rank at the same point (collectives do):
        every rank then posts its hellos to all of them before waiting for any, so no order of
        opening can wait in a circle (a ring whose ranks each greet their left first would).
        """
        t = self._t
        wanted = sorted({p for p in peers if p != t.rank})
        with self._lock:
            locks = [self._peer_locks.setdefault(p, threading.Lock()) for p in wanted]
        # one lock per peer, taken in rank order: opens of disjoint peer sets (a send to the
        # right while receiving from the left) run side by side, and none waits in a circle
        for lock in locks:
            lock.acquire()
        try:
            missing = [p for p in wanted if p not in t._channels]
            if missing:
                self._open(missing, deadline)
        finally:
            for lock in reversed(locks):
                lock.release()
        for p in missing:
            t.opened(p)
        return [t._channels[p] for p in peers if p != t.rank]

    def _swap(self, values: dict[int, Any], deadline: float) -> dict[int, Any]:
        """Send values[p] to every p and receive one object from each, all at once."""
        t = self._t
        sends = [t.svc.isend(v, dest=p, tag=tags.STAGED_HELLO) for p, v in values.items()]
        recvs = {p: t.svc.irecv(source=p, tag=tags.STAGED_HELLO) for p in values}
        got: dict[int, Any] = {}
        while len(got) < len(recvs):
            for p, req in recvs.items():
                if p not in got:
                    done, msg = req.test()
                    if done:
                        got[p] = msg
            if len(got) < len(recvs):
                if t.closed:
                    raise HetcommError("the staged transport was closed while opening channels")
                if time.monotonic() > deadline:
                    late = sorted(set(recvs) - set(got))
                    raise PeerTimeout(late, f"ranks {late} did not open their staged channels")
                time.sleep(50e-6)
        MPI.Request.waitall(sends)
        return got

    def _open(self, peers: list[int], deadline: float) -> None:
        t = self._t
        cards = self._swap({p: t.card for p in peers}, deadline)
        opened: dict[int, Channel] = {}
        try:
            self._connect(peers, cards, opened, deadline)
        except BaseException:
            # a peer that fails or dies while the channels open: nothing of them stays behind
            # (a shared segment left in /dev/shm would hold its memory until the next boot)
            for ch in opened.values():
                ch.release()
            raise
        for peer, ch in opened.items():
            log.info("staged: rank %d <-> rank %d over %s", t.rank, peer, ch.describe())
            ch.start()
            t._channels[peer] = ch

    def _connect(
        self, peers: list[int], cards: dict[int, Any], opened: dict[int, Channel], deadline: float
    ) -> None:
        """The links and shared segments of a channel to each of `peers`, into `opened` as they
        are made."""
        t = self._t
        # ascending peers: a rank connects to higher ranks (their listeners always accept) and
        # takes from lower ones, which never wait on it, so the connections cannot deadlock
        for peer in peers:
            theirs = cards[peer]
            specs = choose_rails(t.card, theirs, t.mode)
            ch = opened[peer] = Channel(t, t.cts, peer, specs)
            for spec in ch.specs:
                if spec.kind == "mpi":
                    continue
                try:
                    if t.rank < peer:
                        sock = links.connect(
                            spec, peer, theirs["token"], t.rank, theirs["unix"], deadline
                        )
                    else:
                        sock = t.listener.take(peer, spec.index, deadline)
                except links.RailError as exc:
                    # a rail is tried until the deadline: the peer did not open its side in time
                    raise PeerTimeout([peer], str(exc)) from exc
                ch.links.append(links.Link(sock, spec, peer))
        shm = [p for p, ch in opened.items() if any(s.kind == "shm" for s in ch.specs)]
        if shm:
            base = f"hetcomm-{t.token.hex()[:12]}"
            slots = slots_that_fit(t.slots, t.chunk_bytes, 2 * len(shm))
            # the boards (board.py) only where shared words order this host's messages: both
            # ends of a pair run on one host, so they agree on it
            words = board.words(slots) if flags.unsupported() is None else 0
            # a rank that cannot make or map its segments says why in the swaps, instead of
            # its names, so that both ends of each pair fail at once, naming the cause
            mine: dict[int, Any] = {}
            try:
                for p in shm:
                    opened[p].shm_out = SharedSlots(
                        f"{base}-{t.rank}-{p}", slots, t.chunk_bytes, create=True, words=words
                    )
                rings = {p: self._eager_ring(opened[p], f"{base}-e{t.rank}-{p}") for p in shm}
                mine = {p: (f"{base}-{t.rank}-{p}", slots, t.chunk_bytes, rings[p]) for p in shm}
            except OSError as exc:
                mine = dict.fromkeys(shm, _failed(exc))
            names = self._swap(mine, deadline)
            _refuse(t.rank, mine, names)
            mapped: dict[int, Any] = dict.fromkeys(shm)
            try:
                for p in shm:
                    name, count, slot_bytes, ring = names[p]
                    theirs = board.words(count) if words else 0
                    opened[p].shm_in = SharedSlots(
                        name, count, slot_bytes, create=False, words=theirs
                    )
                    if ring is not None:
                        ename, eslots, ebytes = ring
                        seg = SharedSlots(ename, 1, segment_bytes(eslots, ebytes), create=False)
                        opened[p].eager_in = EagerIn(seg, eslots, ebytes, t.single_copy)
            except OSError as exc:
                mapped = dict.fromkeys(shm, _failed(exc))
            # both sides have mapped both segments: the names can go
            _refuse(t.rank, mapped, self._swap(mapped, deadline))
            for p in shm:
                opened[p].boards()
                opened[p].shm_out.unlink()  # type: ignore[union-attr]
                out = opened[p].eager_out
                if out is not None:
                    out.unlink()

    def _eager_ring(self, ch: Channel, name: str) -> tuple[str, int, int] | None:
        """Make the eager ring of messages to `ch`'s peer (its name, slots and slot bytes for
        the peer to map), or None where this host cannot order messages through shared words,
        eager messages are off, or /dev/shm has no room (the pair then uses the rails only)."""
        t = self._t
        if t.eager_bytes <= 0 or t.eager_slots <= 0 or flags.unsupported() is not None:
            return None
        size = segment_bytes(t.eager_slots, t.eager_bytes)
        try:
            seg = SharedSlots(name, 1, size, create=True)
        except SegmentError as exc:
            log.warning("staged: no eager messages to rank %d (%s)", ch.peer, exc)
            return None
        ch.eager_out = EagerOut(seg, t.eager_slots, t.eager_bytes, t.tickets(ch.peer))
        return name, t.eager_slots, t.eager_bytes


class _Failed(str):
    """What a rank sends in place of its segments' names where it could not make or map
    them: why (a str, so that it pickles as one)."""


def _failed(exc: OSError) -> _Failed:
    return _Failed(f"{type(exc).__name__}: {exc}")


def _refuse(rank: int, mine: dict[int, Any], theirs: dict[int, Any]) -> None:
    """Raise TransportUnavailable where this rank or a peer could not make or map the shared
    segments of their channel (each side then raises, naming the cause)."""
    why = [f"rank {rank}: {v}" for v in mine.values() if isinstance(v, _Failed)][:1]
    why += [f"rank {p}: {v}" for p, v in sorted(theirs.items()) if isinstance(v, _Failed)]
    if why:
        raise TransportUnavailable(
            "staged: the shared segments between ranks of this host could not be made or "
            f"mapped ({'; '.join(why)}); free room in /dev/shm, or set HETCOMM_RAILS to "
            "rails without shm"
        )
