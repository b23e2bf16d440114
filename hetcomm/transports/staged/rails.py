"""The mpi rail's receiving thread, and the rules every rail's threads share (staged).

Chunks over the mpi rail travel as two messages on the service communicator, a header and its
body (tags.STAGED_HEAD, STAGED_BODY). One thread per transport (`MpiRail`) receives them from
every peer; the senders are the channels' mpi-rail threads (channel.py).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Protocol

import numpy as np
from mpi4py import MPI

from ...errors import MismatchError
from .. import tags
from .cts import CTS_POLL_MAX_S, CTS_POLL_S
from .ops import _Op


class Owner(Protocol):
    """What the mpi rail uses of its transport (StagedTransport)."""

    rank: int
    svc: Any
    #: receives in flight by op id, where arriving chunks land
    receives: dict[int, _Op]
    #: the staging device, made before device chunks move
    gpu: Any


# kinds of the mpi rail's headers
DATA_MPI, ERROR_MPI, BYE_MPI = 1, 4, 5
# a device chunk this small is copied and waited for by the rail thread itself (a few
# microseconds), saving the hand-off to the thread that waits for longer copies
INLINE_COPY_BYTES = 256 << 10


class MpiRail:
    """The one thread that receives the mpi rail's chunks (head, then body) from every peer.

    Started by the first channel that uses the mpi rail; ended by `stop`, a BYE this rank
    sends itself, so that no thread is left inside MPI when the process finalizes it. Its
    only state is the thread (guarded by `_lock` until started)."""

    def __init__(self, owner: Owner) -> None:
        self.owner = owner
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the receiving thread, once (the first channel with an mpi rail calls it)."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, daemon=True, name="hetcomm-mpi-rail"
                )
                self._thread.start()

    def stop(self) -> None:
        """End the thread (if it ever started): a BYE to this very rank, then a bounded join."""
        if self._thread is None:
            return
        owner = self.owner
        owner.svc.Send(np.array([BYE_MPI, 0, 0, 0, 0], np.int64), owner.rank, tags.STAGED_HEAD)
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        owner = self.owner
        svc, rank, receives = owner.svc, owner.rank, owner.receives
        head = np.zeros(5, dtype=np.int64)
        status = MPI.Status()
        while True:
            # polled, not a blocking receive: that would keep a core spinning for as long as
            # the rail is idle
            request = svc.Irecv(head, source=MPI.ANY_SOURCE, tag=tags.STAGED_HEAD)
            pause = CTS_POLL_S
            while not request.Test(status):
                time.sleep(pause)
                pause = min(2 * pause, CTS_POLL_MAX_S)
            peer = status.Get_source()
            kind, op_id, idx, off, n = (int(v) for v in head)
            if kind == BYE_MPI:
                if peer == rank:
                    return
                continue
            op = receives.get(op_id)
            if kind == ERROR_MPI:
                if op is not None:
                    op.fail(size_mismatch(peer, n, op.region.nbytes))
                continue
            if op is None or op.done.is_set():
                svc.Recv(np.empty(n, np.uint8), source=peer, tag=tags.STAGED_BODY)
                continue
            dest = op.region.sub(off, n)
            if dest.host is not None:
                svc.Recv(dest.host, source=peer, tag=tags.STAGED_BODY)
            else:
                gpu = owner.gpu
                with gpu.bounce(n) as staging:
                    svc.Recv(staging, source=peer, tag=tags.STAGED_BODY)
                    gpu.copy_from_host(dest, staging, op.ready)
            op.count(idx)


def short(n: int, op: _Op) -> bool:
    """Whether a rail thread may wait for a chunk's copy itself: a small one that waits for
    nothing the caller queued before (else it could hold the link for as long as that runs)."""
    return n <= INLINE_COPY_BYTES and (op.ready is None or bool(op.ready.done))


def size_mismatch(peer: int, sent: int, expected: int) -> MismatchError:
    """The error of a receive whose sender has another byte count."""
    return MismatchError(
        f"receive from rank {peer}: the sender has {sent} bytes, this receive takes {expected}"
    )
