"""The shared segment of one group's ranks on one host: made, grown, shared and closed, and the
arrivals that synchronise the ranks in it (hetcomm.transports.hostcoll runs collectives over it).

The segment is one /dev/shm file that every rank of the group maps: a header of one 64-byte
line per rank (its barrier counter, whether it has mapped this segment, its pid and the start
time of its process), then one block per rank, each of two halves of `capacity` bytes that
start on cache lines. A rank writes only its own header line, so a counter has one writer.

A rank *arrives* by bumping its counter (after its writes) and waits until every rank has
arrived as often. Waits yield, then nap (`flags.wait`), bounded by the operation's deadline;
while napping they look at the late ranks' processes (/proc), so that a rank that died is
named (`Dead`) long before the deadline, and a wait that runs out names the ranks that did not
arrive (`Late`). Transports turn these into CommTimeout and PeerLost.

The segment is made at the first operation that needs it and grown at the first that needs
more (every rank reaches both at the same operation: they take the segment in one order, and
an operation's size is the same on every rank, which the default check guarantees; ranks that
call with different sizes unchecked time out in the growth, naming the ranks that did not
map). Grown rather than made at its limit at once: halves of MAX_BYTES would reserve
2 x 16 MiB of /dev/shm per rank for every group, most of which only ever reduce a few bytes.
Rank 0 creates the file and sends its name over the group's service communicator; once every
rank has mapped it, each unlinks it, so nothing is left in /dev/shm when a process is killed
afterwards. Where rank 0 cannot reserve the memory, every rank learns so from the same
message, and operations of that size or more take the transport's other path from then on.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from .. import processes
from ..errors import HetcommError
from . import flags
from .shm import SegmentError, SharedSlots

log = logging.getLogger("hetcomm")

LINE = 64  # halves start on cache lines: no two ranks write one line
_WORDS = LINE // 8  # int64 words per rank's header line
_COUNT, _MAPPED, _PID, _START = 0, 1, 2, 3  # the words of a rank's header line
INITIAL_BYTES = 64 << 10  # the first segment's halves
MAX_BYTES = 16 << 20  # the largest operation the segment takes (its input, per rank)
_MESSAGE = 256  # bytes of the setup message: a segment's name, or "!" and why there is none


class Late(TimeoutError):
    """Ranks did not arrive before the deadline (`ranks`; empty where unknown)."""

    def __init__(self, ranks: list[int], text: str) -> None:
        super().__init__(text)
        self.ranks = ranks


class Dead(ConnectionError):
    """Ranks that the wait was for have no process any more (`ranks`)."""

    def __init__(self, ranks: list[int], text: str) -> None:
        super().__init__(text)
        self.ranks = ranks


class Segment:
    """The shared segment of one group's ranks on one host (see the module's docstring): its
    halves (`mine`, `_half`: the half of the operation about to run, by parity of `_ops`)
    and the arrivals in its header."""

    def __init__(
        self,
        rank: int,
        size: int,
        service: Any,
        tag: int,
        closed: Callable[[], bool] = lambda: False,
    ) -> None:
        self.rank, self.size = rank, size
        self._svc, self._tag, self._closed = service, tag, closed
        self._seg: SharedSlots | None = None
        self._hdr: memoryview | None = None  # int64 words of the header
        self._rows: tuple[np.ndarray, ...] = ()  # per parity: every rank's half, (size, capacity)
        self._pids: list[tuple[int, int]] = []  # (pid, start time) of every rank
        self._registered = -1  # the device the segment is registered with (-1: none)
        self.capacity = 0  # bytes of one half
        self.limit = MAX_BYTES  # the largest operation the segment may grow to take
        self._generation = 0
        self._count = 0  # arrivals so far (the same on every rank at the same point)
        self._ops = 0  # operations run in this segment: their parity picks the half
        self._me = rank * _WORDS
        self._others = [q * _WORDS for q in range(size) if q != rank]

    def _grow(self, nbytes: int, deadline: float) -> bool:
        """Replace the segment by one whose halves hold `nbytes` (collective); False where the
        group cannot have one that large (rank 0 could not reserve it), on every rank."""
        if nbytes > self.limit:
            return False
        capacity = min(self.limit, max(nbytes, 2 * self.capacity, INITIAL_BYTES))
        capacity = -(-capacity // LINE) * LINE
        header = self.size * LINE
        total = header + self.size * 2 * capacity
        self._generation += 1
        seg: SharedSlots | None = None
        try:
            seg, why = self._share(total, deadline)
            if seg is None:
                # every rank got the same message: larger operations go the other way
                self.limit = self.capacity
                log.warning(
                    "hostcoll: no shared segment of %d bytes (%s); operations over %d bytes "
                    "take the transport's other path",
                    total,
                    why,
                    self.limit,
                )
                return False
            hdr = seg.array[:header].data.cast("q")
            me = self._me
            hdr[me + _PID] = os.getpid()
            hdr[me + _START] = processes.start_time(os.getpid()) or 0
            hdr[me + _MAPPED] = 1
            mapped = [q * _WORDS + _MAPPED for q in range(self.size)]

            def ready() -> bool:
                return all(hdr[i] for i in mapped)

            if not flags.wait(ready, deadline, self._check_closed):
                late = [q for q in range(self.size) if not hdr[q * _WORDS + _MAPPED]]
                raise Late(late, f"ranks {late} did not map the shared segment")
        except BaseException:
            if seg is not None:
                seg.unlink()
                seg.close()
            raise
        seg.unlink()  # every rank has mapped it (or its name is gone already)
        self._close_segment()
        self._seg, self._hdr, self.capacity = seg, hdr, capacity
        # per parity, every rank's half as a row of one array (one reduction call reads them all)
        self._rows = tuple(
            np.lib.stride_tricks.as_strided(
                seg.array[header + h * capacity :], (self.size, capacity), (2 * capacity, 1)
            )
            for h in (0, 1)
        )
        self._pids = [
            (int(hdr[q * _WORDS + _PID]), int(hdr[q * _WORDS + _START])) for q in range(self.size)
        ]
        self._count = self._ops = 0
        return True

    def _share(self, total: int, deadline: float) -> tuple[SharedSlots | None, str]:
        """Rank 0 makes a segment of `total` bytes and sends its name to the others, who map
        it: (the segment, "") or (None, why rank 0 could not make it)."""
        svc, tag = self._svc, self._tag
        if self.rank == 0:
            name = f"hetcomm-hc-{os.getpid()}-{id(self) & 0xFFFFFF:x}-{self._generation}"
            seg: SharedSlots | None
            try:
                seg, message = SharedSlots(name, 1, total, create=True), name
            except SegmentError as exc:
                seg, message = None, "!" + str(exc)
            try:
                payload = np.frombuffer(
                    message.encode()[:_MESSAGE].ljust(_MESSAGE, b"\0"), np.uint8
                )
                sends = [svc.Isend(payload, dest=q, tag=tag) for q in range(1, self.size)]
                self._requests(
                    sends, list(range(1, self.size)), deadline, "take the segment's name"
                )
            except BaseException:
                if seg is not None:
                    seg.unlink()
                    seg.close()
                raise
            return seg, "" if seg is not None else message[1:]
        got = np.zeros(_MESSAGE, np.uint8)
        self._requests(
            [svc.Irecv(got, source=0, tag=tag)], [0], deadline, "send the segment's name"
        )
        message = bytes(got).rstrip(b"\0").decode()
        if message.startswith("!"):
            return None, message[1:]
        return SharedSlots(message, 1, total, create=False), ""

    def _requests(self, requests: list[Any], ranks: list[int], deadline: float, what: str) -> None:
        """Wait for MPI requests (one per rank of `ranks`) until `deadline`."""
        pause = 20e-6
        while True:
            done = [r.Test() for r in requests]
            if all(done):
                return
            self._check_closed()
            if time.monotonic() > deadline:
                if self.rank != 0:  # a receive left posted could take a later message
                    for r, ok in zip(requests, done, strict=True):
                        if not ok:
                            with contextlib.suppress(Exception):
                                r.Cancel()
                late = [q for q, ok in zip(ranks, done, strict=True) if not ok]
                raise Late(late, f"ranks {late} did not {what}")
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)

    def register_with_gpu(self, device: int) -> None:
        """Pin and map the segment for `device`'s copies (once per segment)."""
        assert self._seg is not None
        if self._registered != device:
            self._seg.register_with_gpu(device)
            self._registered = device

    def _close_segment(self) -> None:
        if self._seg is not None:
            self._rows = ()
            self._hdr = None
            self._seg.close()
            self._seg = None
        self._registered = -1

    def close(self) -> None:
        """Unmap the segment (local: a rank whose peers are gone still closes)."""
        self._close_segment()
        self.capacity = 0

    # ---- arrivals -----------------------------------------------------------------------

    def _check_closed(self) -> None:
        if self._closed():
            raise HetcommError("the transport was closed during a collective in shared memory")

    def _arrive(self) -> int:
        """Bump this rank's counter (after its writes): the arrival's number."""
        assert self._hdr is not None
        self._count = k = self._count + 1
        self._hdr[self._me] = k
        return k

    def _wait(self, k: int, deadline: float) -> None:
        """Until every rank has arrived `k` times."""
        if self._arrived(k):
            return
        hdr = self._hdr
        assert hdr is not None
        words = self._others
        ready = partial(self._arrived, k)

        def check() -> None:
            self._check_closed()
            late = [i // _WORDS for i in words if hdr[i] < k]
            dead = [q for q in late if processes.gone(*self._pids[q])]
            if dead:
                raise Dead(dead, f"ranks {dead} died (their processes are gone)")

        if not flags.wait(ready, deadline, check):
            late = [i // _WORDS for i in words if hdr[i] < k]
            raise Late(late, f"ranks {late} did not arrive in shared memory")

    def _barrier(self, deadline: float) -> None:
        self._wait(self._arrive(), deadline)

    def _half(self, q: int) -> np.ndarray:
        return self._rows[self._ops & 1][q]

    def mine(self, nbytes: int) -> np.ndarray:
        """The first `nbytes` of this rank's half for the operation about to run: where a caller
        that stages its own input (a device copy) puts it before calling with x=None."""
        return self._half(self.rank)[:nbytes]

    def _stage(self, x: np.ndarray | None) -> None:
        if x is not None and x.nbytes:
            self._half(self.rank)[: x.nbytes] = x

    def _arrived(self, k: int) -> bool:
        """Whether every other rank has arrived `k` times (one look)."""
        hdr = self._hdr
        if hdr is None:
            raise HetcommError("the shared segment was closed during a collective")
        # a loop, not all() over a generator: this runs at every poll of a spinning wait
        for i in self._others:  # noqa: SIM110
            if hdr[i] < k:
                return False
        return True
