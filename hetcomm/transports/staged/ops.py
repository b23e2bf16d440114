"""Pieces of a staged operation: the bytes it touches, a message in flight, the driver threads."""

from __future__ import annotations

import collections
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...trace import Stamps
from ..base import Job
from ..local import Region

_STOP = object()
# the staged pipeline's steps, stamped while stamp.marks is a list; no module reads them: a
# profiling run sets and reads stamp.marks itself (docs/staged.md, "Where a message's time goes")
stamp = Stamps()


@dataclass(eq=False)
class _Op:
    """One message in flight between this rank and one peer."""

    peer: int
    region: Region
    spans: list[tuple[int, int]]
    remote: int = -1  # the receiver's op id (sends)
    key: int = -1  # this receive's op id, its key in the transport's receives (receives)
    awaiting_cts: bool = False  # a send still waiting for the receiver's clear-to-send
    board: bool = False  # a send whose receive looks for its chunks on the board (board.py)
    ready: Any = None  # device event the copies must wait for
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    left: int = 0
    # sends: chunks copied into shared slots before the clear-to-send came (slot, event, span)
    early: list[tuple[int, Any, tuple[int, int]]] = field(default_factory=list)
    seen: set[int] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # inline.Inline where the thread that waits for the message moves it itself (inline.py)
    inline: Any = None

    def fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        self.done.set()
        if self.inline is not None:
            self.inline.driver.wake.set()

    def count(self, chunk: int) -> None:
        """One chunk sent (or arrived); duplicates from a resend are counted once."""
        with self.lock:
            if chunk in self.seen:
                return
            self.seen.add(chunk)
            self.left -= 1
            finished = self.left <= 0
        if finished:
            stamp("op done")
            self.done.set()

    def ended(self, until: float) -> bool:
        """Whether the message has ended (done or failed) by `until` (monotonic): waiting on
        `done`, or moving this thread's messages meanwhile where it moves this one (inline.py)."""
        if self.inline is not None:
            return bool(self.inline.driver.wait(self, until))
        return self.done.wait(max(0.0, until - time.monotonic()))

    def wait(self, deadline: float) -> None:
        if not self.ended(deadline):
            raise self.late()
        if self.error is not None:
            raise self.error

    def late(self) -> PeerTimeout:
        """The error of the message when its deadline has passed."""
        if self.awaiting_cts:
            return PeerTimeout([self.peer], f"rank {self.peer} never posted the matching receive")
        return PeerTimeout([self.peer], f"no progress with rank {self.peer}")


class Body(Job):
    """An operation's body queued for the drivers, `call(deadline)`, run once by whichever
    thread claims it first: a driver, or a thread about to wait for the operation (`run_here`,
    through Work.drive), which then runs it itself, as a blocking call would, rather than
    sleeping through two thread hand-offs (the driver's wake, then its own)."""

    __slots__ = ("_claim", "deadline")

    def __init__(self, call: Callable[[float], None], deadline: float) -> None:
        super().__init__(call)
        self.deadline = deadline  # the body ends by then (monotonic)
        self._claim = threading.Lock()

    def claim(self) -> bool:
        """Take the body to run (once: whether this thread is the one that runs it)."""
        return self._claim.acquire(False)

    def run_here(self, deadline: float) -> bool:
        """Run the body on this thread where no driver has taken it yet, ending by `deadline`
        too (a waiter's, which the body must not outlast): whether it ran here."""
        if not self.claim():
            return False
        self.run(min(self.deadline, deadline))
        return True


# the most driver threads one transport starts: bodies beyond that many waiting on their
# peers at once wait for a driver to come free
DRIVERS_MAX = 256


class _Drivers:
    """Daemon threads that run operations' bodies: `count` at first, one more whenever a body
    is queued and none is free (up to `most`). A body may wait on its peer (a send over
    the rails for its clear-to-send, a receive for its message), so a fixed pool could be
    all taken by bodies that wait for ones queued behind them, on this rank or another: two
    ranks that made every send and receive asynchronous, more than the drivers, over tcp or
    MPI rails and then waited in another order, waited so until the timeout (2026-12-06).
    MPI completes every such set of calls; an idle driver sleeps and costs no core.

    Not concurrent.futures' pool: its exit hook joins every worker, and a body waiting for a
    rank that died would then hold the interpreter's exit until the body's own deadline.
    """

    def __init__(self, count: int, name: str, most: int = DRIVERS_MAX) -> None:
        self.submitted = 0  # bodies handed over so far
        self._most = most
        self._name = name
        # under `_ready`: the bodies not taken yet, the drivers waiting for one, the threads
        self._ready = threading.Condition()
        self._bodies: collections.deque[Any] = collections.deque()
        self._idle = 0
        self._threads: list[threading.Thread] = []
        with self._ready:
            for _ in range(count):
                self._add()

    def _add(self) -> None:
        thread = threading.Thread(
            target=self._loop, name=f"{self._name}-{len(self._threads)}", daemon=True
        )
        self._threads.append(thread)
        self._idle += 1  # from its start: it takes a body queued before it runs
        thread.start()

    def submit(self, fn: Callable[[float], None], deadline: float = math.inf) -> Body:
        """Queue `fn(deadline)` for the next free driver (one more is started if none is)."""
        body = Body(fn, deadline)
        self.submitted += 1
        with self._ready:
            self._bodies.append(body)
            if len(self._bodies) > self._idle and len(self._threads) < self._most:
                self._add()
            else:
                self._ready.notify()
        return body

    def _loop(self) -> None:
        ready = self._ready
        while True:
            with ready:
                while not self._bodies:
                    ready.wait()
                body = self._bodies.popleft()
                if body is _STOP:
                    self._bodies.appendleft(_STOP)  # for the other drivers too
                    ready.notify_all()
                    return
                self._idle -= 1
            if body.claim():  # else a waiting thread runs it
                body.run(body.deadline)
            with ready:
                self._idle += 1

    def shutdown(self, wait_s: float = 0.0) -> None:
        with self._ready:
            self._bodies.append(_STOP)  # after the bodies queued so far
            self._ready.notify_all()
            threads = list(self._threads)
        end = time.monotonic() + wait_s
        for t in threads:
            t.join(max(0.0, end - time.monotonic()))


class PeerTimeout(TimeoutError):
    """A wait on named ranks ran out of time (becomes CommTimeout on the caller's side)."""

    def __init__(self, ranks: list[int], text: str) -> None:
        super().__init__(text)
        self.ranks = ranks
