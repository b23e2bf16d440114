"""Clear-to-send: a receive tells its sender it may send, and the sender's chunks go only then.

`ClearToSend` is the bookkeeping one staged transport and its channels share: the transport's
senders wait for their clear-to-send or register to be started by it; a channel's reader thread
files the ones that arrive over the shm rail's socket. Every field is guarded by `cond`.

A receive tells its sender "clear to send" over the unix socket of their shm rail where they
have one, and the socket's reader thread files it: no polling, no MPI. Between hosts it goes
over MPI, and the sender's waiting thread receives it there itself, so no thread of the
transport sits in a blocking MPI call: one would keep a core spinning for as long as it waits
(and on a machine with fewer cores than threads, stall the rest).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import numpy as np
from mpi4py import MPI

from ...errors import HetcommError, PeerLost
from .. import tags
from . import links
from .ops import PeerTimeout, _Op

if TYPE_CHECKING:
    from .channel import Channel

# a sender waiting for a clear-to-send over MPI polls for it, first after this many seconds,
# doubling up to the second value (only between hosts: a host's ranks ring the shm doorbell);
# the mpi rail's receiving thread polls for chunks the same way
CTS_POLL_S, CTS_POLL_MAX_S = 20e-6, 500e-6

Key = tuple[int, int, int, int]  # (peer, kind, k1, k2): which message a clear-to-send is for
# kinds of message: a send/recv (k1, k2: the tag and the pair's message number), a collective's
# step (k1, k2: the collective's sequence number and its step)
CTS_P2P, CTS_COLL = 1, 2
# on the shm rail's socket, added to the kind: the receive looks for the chunks on the board
BOARD = 1 << 8
# what a clear-to-send says: the receive's op id, its bytes, whether it looks on the board
Entry = tuple[int, int, bool]


class ClearToSend:
    """The clear-to-send messages of one staged transport and the sends waiting for theirs."""

    def __init__(
        self,
        rank: int,
        svc: MPI.Intracomm,
        channels: Mapping[int, Channel],
        queue_send: Callable[[Channel, _Op, int, int, bool], None],
    ) -> None:
        self.rank, self.svc = rank, svc
        self._channels = channels  # the transport's open channels (read here, never changed)
        self._queue_send = queue_send  # starts a send whose clear-to-send has come
        self.cond = threading.Condition()
        # guarded by `cond`: clear-to-sends filed for a sender to take, the sends registered
        # to be started by the thread that files theirs, and whether the transport has closed
        self.inbox: dict[Key, list[Entry]] = {}
        self.waiting: dict[Key, tuple[Channel, _Op]] = {}
        self.closed = False

    def doorbell(self, peer: int) -> links.Link | None:
        """The link that carries `peer`'s clear-to-send messages: the shm rail's socket, or
        None (MPI). Both ranks of a pair see the same rails, so they agree on it."""
        ch = self._channels.get(peer)
        return ch.doorbell() if ch is not None else None

    def send(
        self, peer: int, kind: int, k1: int, k2: int, op_id: int, nbytes: int, board: bool = False
    ) -> None:
        """Tell `peer` that receive `op_id` of `nbytes` takes its message (kind, k1, k2);
        `board`: it looks for the chunks on the shm rail's board (only over that rail)."""
        if peer == self.rank:
            self.file(peer, kind, k1, k2, op_id, nbytes)
            return
        link = self.doorbell(peer)
        if link is not None:
            try:
                link.send(links.CTS, kind | (BOARD if board else 0), op_id, k1, k2, nbytes)
            except links.RailError as exc:
                # the doorbell is the shm rail's socket: the peer's process is gone
                raise PeerLost(
                    f"rank {peer}: its clear-to-send could not go ({exc})", [peer]
                ) from exc
            return
        self.svc.Send(
            np.array([kind, k1, k2, op_id, nbytes, 0], dtype=np.int64), peer, tags.STAGED_CTS
        )

    def _take_mpi(self) -> int:
        """File every clear-to-send that has arrived over MPI; how many there were. Matched
        probes, so that several waiting threads never receive the same message."""
        taken = 0
        msg = np.zeros(6, dtype=np.int64)
        status = MPI.Status()
        while True:
            found = self.svc.Improbe(source=MPI.ANY_SOURCE, tag=tags.STAGED_CTS, status=status)
            if found is None:
                return taken
            found.Recv(msg)
            kind, k1, k2, op_id, nbytes = (int(v) for v in msg[:5])
            self.file(status.Get_source(), kind, k1, k2, op_id, nbytes)
            taken += 1

    def wait_for(self, peer: int, kind: int, k1: int, k2: int, deadline: float) -> Entry:
        """On this thread, until it comes: the clear-to-send of message (kind, k1, k2) to
        `peer`."""
        key = (peer, kind, k1, k2)
        doorbell = self.doorbell(peer) if peer != self.rank else None
        by_mpi = peer != self.rank and doorbell is None
        pause = CTS_POLL_S
        with self.cond:
            while not self.inbox.get(key):
                if self.closed:
                    raise HetcommError("the staged transport was closed while waiting to send")
                if doorbell is not None and not doorbell.alive:
                    # the peer closed its transport or died: its receive can never come
                    why = "; ".join(self._channels[peer].dead) or "the peer closed it"
                    raise PeerLost(
                        f"send to rank {peer}: its shm rail is gone ({why}) "
                        "while waiting for the matching receive",
                        [peer],
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PeerTimeout([peer], f"rank {peer} never posted the matching receive")
                if not by_mpi:
                    self.cond.wait(min(left, 0.5))
                    continue
                self.cond.release()
                try:
                    taken = self._take_mpi()
                finally:
                    self.cond.acquire()
                if not taken and not self.inbox.get(key):
                    self.cond.wait(min(left, pause))
                    pause = min(2 * pause, CTS_POLL_MAX_S)
            entry = self._take_filed(key)
            assert entry is not None
            return entry

    def _take_filed(self, key: Key) -> Entry | None:
        """The oldest clear-to-send filed under `key`, taken; None if none is. The caller holds
        `cond`."""
        filed = self.inbox.get(key)
        if not filed:
            return None
        entry = filed.pop(0)
        if not filed:
            del self.inbox[key]
        return entry

    def take_or_register(self, ch: Channel, op: _Op, key: Key, deadline: float) -> Entry | None:
        """The clear-to-send of the send `op` (peer, kind and keys in `key`) if it is here.
        Where the peer rings the shm doorbell and it is not, the send is registered for the
        thread that files it (None); over MPI this thread waits for it."""
        doorbell = self.doorbell(key[0])
        if doorbell is not None:
            with self.cond:
                # alive is read under the lock that wake_senders takes: a doorbell that goes
                # later finds this send registered and fails it
                if doorbell.alive:
                    entry = self._take_filed(key)
                    if entry is None:
                        op.awaiting_cts = True
                        self.waiting[key] = (ch, op)
                    return entry
        # over MPI, or the doorbell is gone (this raises, naming it)
        return self.wait_for(*key, deadline)

    def unwait(self, op: _Op) -> None:
        """Forget a send that waited for its clear-to-send in vain (timed out), so that a late
        one cannot start it."""
        dropped = None
        with self.cond:
            for key, (ch, waiting) in list(self.waiting.items()):
                if waiting is op:
                    del self.waiting[key]
                    dropped = ch
        if dropped is not None and op.early:
            dropped.drop_early(op)  # no clear-to-send can take them now

    def file(self, src: int, kind: int, k1: int, k2: int, op_id: int, nbytes: int) -> None:
        """A clear-to-send has arrived: start the send that waits for it on this thread, or
        file it for a sender to take. `kind` may carry BOARD (the socket's)."""
        board = bool(kind & BOARD)
        kind &= ~BOARD
        with self.cond:
            waiting = self.waiting.pop((src, kind, k1, k2), None)
            if waiting is None:
                self.inbox.setdefault((src, kind, k1, k2), []).append((op_id, nbytes, board))
                self.cond.notify_all()
                return
        self._queue_send(*waiting, op_id, nbytes, board)

    def wake_senders(self) -> None:
        """Let senders waiting for a clear-to-send look again (a link has just gone); sends
        waiting on a doorbell that has gone fail now, naming it."""
        with self.cond:
            self.cond.notify_all()
            gone = [
                (key, ch)
                for key, (ch, _) in self.waiting.items()
                if not any(link.alive for link in ch.links if link.spec.kind == "shm")
            ]
            failed = [(ch, self.waiting.pop(key)[1]) for key, ch in gone]
        for ch, op in failed:
            why = "; ".join(ch.dead) or "the peer closed it"
            op.fail(
                PeerLost(
                    f"send to rank {ch.peer}: its shm rail is gone ({why}) while "
                    "waiting for the matching receive",
                    [ch.peer],
                )
            )

    def take_waiting(self) -> list[tuple[Channel, _Op]]:
        """The sends still waiting for their clear-to-send, taken (the transport closes)."""
        with self.cond:
            waiting, self.waiting = self.waiting, {}
        return list(waiting.values())

    def wake(self) -> None:
        """Wake every thread waiting here (to see `closed`)."""
        with self.cond:
            self.cond.notify_all()
