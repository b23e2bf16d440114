"""Deferred starts: an asynchronous collective starts once its check has completed, in issue
order, driven by whichever thread gets there first.

Its check (hetcomm.agree) is started when the call is made; the operation itself must not move
a byte before every rank is known to agree, so it is started later: by the caller's next
collective on the communicator (which starts every earlier one first), by a wait or test of any
of its Works, or by the process's starter thread, which polls the checks of every communicator
that has deferred starts, so that a caller who blocks elsewhere (a send to a rank that is itself
waiting in this collective, say) does not hold the collective back. One lock per communicator
keeps the starts in issue order whichever thread makes them.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .errors import MismatchError

if TYPE_CHECKING:
    from .agree import Check, SharedCheck
    from .work import Work

# the starter thread's pause between rounds of polling while anything is deferred: short
# enough that a collective nobody waits on still starts promptly, long enough to leave the
# interpreter to the caller's threads
_POLL_S = 200e-6


class Deferred:
    """One asynchronous collective waiting for its check: once it has agreed, `start()`
    starts it and `inner` is its Work (polled by `outer`, the caller's); `error` is what it
    failed with instead."""

    __slots__ = ("check", "error", "inner", "outer", "seq", "start")

    def __init__(self, check: Check | SharedCheck, seq: int, start: Callable[[], Work]) -> None:
        self.check, self.seq, self.start = check, seq, start
        self.inner: Work | None = None
        self.outer: Work | None = None  # the caller's Work, which polls `inner`
        self.error: BaseException | None = None


class DeferredStarts:
    """The deferred collectives of one communicator, in issue order."""

    def __init__(
        self,
        mismatch: Callable[[int, Any], MismatchError],
        mpi_error: Callable[[int, BaseException], BaseException],
    ) -> None:
        # in issue order; its truth, read without a call, says whether anything is deferred
        self.queue: deque[Deferred] = deque()
        self._lock = threading.Lock()
        self._mismatch, self._mpi_error = mismatch, mpi_error

    def __bool__(self) -> bool:
        return bool(self.queue)

    def add(self, item: Deferred) -> None:
        """Queue `item` behind the earlier ones; the starter thread watches from now on."""
        with self._lock:
            self.queue.append(item)
        _STARTER.watch(self)

    def advance(self, wait: bool = True) -> None:
        """Start, in issue order, each deferred collective whose check has completed. With
        `wait` False (the starter thread), returns at once if another thread is starting."""
        if not self._lock.acquire(wait):
            return
        try:
            self._advance()
        finally:
            self._lock.release()

    def _advance(self) -> None:
        # an item leaves the queue only once its start has returned: a thread that finds the
        # queue empty (and so starts its own collective at once) never overtakes a start
        # another thread is still making
        queue = self.queue
        while queue:
            item = queue[0]
            check = item.check
            try:
                if not check.request.Test():
                    return
            except BaseException as exc:
                check.busy = False
                item.error = self._mpi_error(item.seq, exc)
                queue.popleft()
                continue
            if not check.agreed():
                try:
                    item.error = self._mismatch(item.seq, check.mismatched())
                except BaseException as exc:  # the gather of the signatures failed
                    item.error = exc
                queue.popleft()
                continue
            try:
                inner = item.inner = item.start()
            except BaseException as exc:
                item.error = exc
                queue.popleft()
                continue
            queue.popleft()
            inner.observed = False  # the caller's Work is the one traced, with these facts
            if item.outer is not None:
                item.outer.info = inner.info


class _Starter:
    """The process's thread that starts deferred collectives nobody else is driving."""

    def __init__(self) -> None:
        self._watched: weakref.WeakSet[DeferredStarts] = weakref.WeakSet()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def watch(self, starts: DeferredStarts) -> None:
        with self._lock:
            self._watched.add(starts)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="hetcomm-deferred-starts", daemon=True
                )
                self._thread.start()
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            with self._lock:
                watched = [s for s in self._watched if s]
                if not watched:
                    self._wake.clear()
                    continue
            for starts in watched:
                starts.advance(wait=False)
            time.sleep(_POLL_S)


_STARTER = _Starter()
