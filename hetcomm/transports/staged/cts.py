"""The staged transport's clear-to-send messages: a receive tells its sender it may send, and
the sender's chunks go only then. ClearToSend is the base of the rail threads (staged_rails.py),
which file the clear-to-sends that arrive; StagedTransport (staged.py) inherits both."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
from mpi4py import MPI

from ...errors import HetcommError
from .. import tags
from . import links
from .ops import PeerTimeout, _Op

if TYPE_CHECKING:
    from .channel import Channel

# a sender waiting for a clear-to-send over MPI polls for it, first after this many seconds,
# doubling up to the second value (only between hosts: a host's ranks ring the shm doorbell);
# the mpi rail's receiving thread polls for chunks the same way
_CTS_POLL_S, _CTS_POLL_MAX_S = 20e-6, 500e-6


class ClearToSend:
    """Clear-to-send messages of StagedTransport, which sets the attributes declared here."""

    rank: int
    svc: MPI.Intracomm
    _closed: bool
    _channels: dict[int, Channel]
    _inbox: dict[tuple[int, int, int, int], list[tuple[int, int]]]
    _inbox_cond: threading.Condition
    # sends that wait for their clear-to-send: the thread that files it queues their chunks
    _waiting_sends: dict[tuple[int, int, int, int], tuple[Channel, _Op]]
    _queue_send: Callable[[Channel, _Op, int, int], None]

    # A receive tells its sender "clear to send" over the unix socket of their shm rail where
    # they have one, and the socket's reader thread files it: no polling, no MPI. Between
    # hosts it goes over MPI, and the sender's waiting thread receives it there itself, so no
    # thread of this transport sits in a blocking MPI call: one would keep a core spinning for
    # as long as it waits (and on a machine with fewer cores than threads, stall the rest).

    def _doorbell(self, peer: int) -> links.Link | None:
        """The link that carries `peer`'s clear-to-send messages: the shm rail's socket, or
        None (MPI). Both ranks of a pair see the same rails, so they agree on it."""
        ch = self._channels.get(peer)
        if ch is not None:
            for link in ch.links:
                if link.spec.kind == "shm":
                    return link
        return None

    def _send_cts(self, peer: int, kind: int, k1: int, k2: int, op_id: int, nbytes: int) -> None:
        if peer == self.rank:
            self._file_cts(peer, kind, k1, k2, op_id, nbytes)
            return
        link = self._doorbell(peer)
        if link is not None:
            link.send(links.CTS, kind, op_id, k1, k2, nbytes)
            return
        self.svc.Send(
            np.array([kind, k1, k2, op_id, nbytes, 0], dtype=np.int64), peer, tags.STAGED_CTS
        )

    def _take_mpi_cts(self) -> int:
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
            self._file_cts(status.Get_source(), kind, k1, k2, op_id, nbytes)
            taken += 1

    def _await_cts(
        self, peer: int, kind: int, k1: int, k2: int, deadline: float
    ) -> tuple[int, int]:
        key = (peer, kind, k1, k2)
        doorbell = self._doorbell(peer) if peer != self.rank else None
        by_mpi = peer != self.rank and doorbell is None
        pause = _CTS_POLL_S
        with self._inbox_cond:
            while not self._inbox.get(key):
                if self._closed:
                    raise HetcommError("the staged transport was closed while waiting to send")
                if doorbell is not None and not doorbell.alive:
                    # the peer closed its transport or died: its receive can never come
                    ch = self._channels[peer]
                    why = "; ".join(ch.dead) or "the peer closed it"
                    raise HetcommError(
                        f"send to rank {peer}: its shm rail is gone ({why}) "
                        "while waiting for the matching receive"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PeerTimeout([peer], f"rank {peer} never posted the matching receive")
                if not by_mpi:
                    self._inbox_cond.wait(min(left, 0.5))
                    continue
                self._inbox_cond.release()
                try:
                    taken = self._take_mpi_cts()
                finally:
                    self._inbox_cond.acquire()
                if not taken and not self._inbox.get(key):
                    self._inbox_cond.wait(min(left, pause))
                    pause = min(2 * pause, _CTS_POLL_MAX_S)
            entry = self._take_filed(key)
            assert entry is not None
            return entry

    def _take_filed(self, key: tuple[int, int, int, int]) -> tuple[int, int] | None:
        """The oldest clear-to-send filed under `key` (receiver's op id, bytes), taken; None if
        none is. The caller holds _inbox_cond."""
        filed = self._inbox.get(key)
        if not filed:
            return None
        entry = filed.pop(0)
        if not filed:
            del self._inbox[key]
        return entry

    def _cts_or_register(
        self, ch: Channel, op: _Op, key: tuple[int, int, int, int], deadline: float
    ) -> tuple[int, int] | None:
        """The clear-to-send of the send `op` (peer, kind and keys in `key`) if it is here.
        Where the peer rings the shm doorbell and it is not, the send is registered for the
        thread that files it (None); over MPI this thread waits for it."""
        doorbell = self._doorbell(key[0])
        if doorbell is not None:
            with self._inbox_cond:
                # alive is read under the lock that _wake_senders takes: a doorbell that goes
                # later finds this send registered and fails it
                if doorbell.alive:
                    entry = self._take_filed(key)
                    if entry is None:
                        op.awaiting_cts = True
                        self._waiting_sends[key] = (ch, op)
                    return entry
        # over MPI, or the doorbell is gone (this raises, naming it)
        return self._await_cts(*key, deadline)

    def _unwait(self, op: _Op) -> None:
        """Forget a send that waited for its clear-to-send in vain (timed out), so that a late
        one cannot start it."""
        dropped = None
        with self._inbox_cond:
            for key, (ch, waiting) in list(self._waiting_sends.items()):
                if waiting is op:
                    del self._waiting_sends[key]
                    dropped = ch
        if dropped is not None and op.early:
            dropped.drop_early(op)  # no clear-to-send can take them now

    def _file_cts(self, src: int, kind: int, k1: int, k2: int, op_id: int, nbytes: int) -> None:
        """A clear-to-send has arrived: start the send that waits for it on this thread, or
        file it for a sender to take."""
        with self._inbox_cond:
            waiting = self._waiting_sends.pop((src, kind, k1, k2), None)
            if waiting is None:
                self._inbox.setdefault((src, kind, k1, k2), []).append((op_id, nbytes))
                self._inbox_cond.notify_all()
                return
        self._queue_send(*waiting, op_id, nbytes)

    def _wake_senders(self) -> None:
        """Let senders waiting for a clear-to-send look again (a link has just gone); sends
        waiting on a doorbell that has gone fail now, naming it."""
        with self._inbox_cond:
            self._inbox_cond.notify_all()
            gone = [
                (key, ch)
                for key, (ch, _) in self._waiting_sends.items()
                if not any(link.alive for link in ch.links if link.spec.kind == "shm")
            ]
            failed = [(ch, self._waiting_sends.pop(key)[1]) for key, ch in gone]
        for ch, op in failed:
            why = "; ".join(ch.dead) or "the peer closed it"
            op.fail(
                HetcommError(
                    f"send to rank {ch.peer}: its shm rail is gone ({why}) while "
                    "waiting for the matching receive"
                )
            )
