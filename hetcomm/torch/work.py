"""Operations in flight: the torch Work of each, and the thread that completes them.

A call torch waits for at once (asyncOp=False in its options: `dist.<op>` without async_op) runs
as the Communicator's blocking call and returns None, which torch takes as a call that has
completed. Others start at once (non-blocking hetcomm calls, in issue order) and return a
`Work`; the issuing thread drives each for a moment (most small ones end there), and
`Work.wait()` drives it on the waiting thread. What nobody waits on still completes, so that
`Work.get_future()` does without a wait (DDP waits on futures only): an operation that a
transport's own thread ends (a lane's or driver's job, the direct proxy's task: its Work's
`signal`) is completed by that thread, the moment it ends, and the progress thread, woken at
once, settles its future (whose callbacks are user code, kept off the transport's thread).
The progress thread polls the rest (MPI requests, which move only inside MPI calls, and
operations that end with this rank's own reads) and fails the first kind past their deadline.
It leaves alone an operation a thread waits on: it sleeps until that wait ends rather than
waking to poll beside it. A torch future is made only when asked for.
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..errors import CommTimeout
from .errors import torch_error
from .profile import Record

if TYPE_CHECKING:
    from ..work import Signal
    from ..work import Work as HetcommWork

log = logging.getLogger("hetcomm")

# ---- operations in flight -----------------------------------------------------------------------


class _Pending:
    """One torch-level operation: hetcomm Works, steps to run after them, the result, a future."""

    __slots__ = (
        "_after",
        "_future",
        "_future_lock",
        "_lock",
        "_works",
        "deadline",
        "done",
        "error",
        "key",
        "limit",
        "name",
        "pushed",
        "record",
        "result",
        "source",
        "waited",
    )

    def __init__(
        self,
        name: str,
        works: list[Any],
        after: list[Callable[[], None]],
        result: list[torch.Tensor],
        limit: float,
    ) -> None:
        self.name, self._works, self._after, self.result = name, works, after, result
        self.limit = limit
        self.deadline = time.monotonic() + limit
        self.done = False
        self.error: BaseException | None = None
        self.source: int | None = None  # a receive's sender, once complete
        self.record: Record | None = None  # its torch profiler event, while a profiler records
        self.key: int | None = None  # its queue of the progress thread, once given to it
        self.waited = False  # a thread is in wait(), driving it: the progress thread leaves it
        # the threads that end its Works complete it (their signals): the progress thread
        # leaves it until its deadline
        self.pushed = False
        self._lock = threading.RLock()
        # made when asked for (DDP asks; a blocking call never does), completed by whichever
        # of the two comes last: the operation's completion or the question
        self._future: torch.futures.Future | None = None
        self._future_lock = threading.Lock()

    @property
    def future(self) -> torch.futures.Future:
        """The operation's torch future (made on first use; complete once the operation is)."""
        with self._future_lock:
            future = self._future
            if future is not None:
                return future
            devices = sorted({t.device for t in self.result if t.device.type != "cpu"}, key=str)
            future = self._future = torch.futures.Future(
                devices=list[int | str | torch.device](devices) or None
            )
            done = self.done
        if done:
            self._settle_future(future)
        return future

    def _settle_future(self, future: torch.futures.Future) -> None:
        if self.error is not None:
            future.set_exception(self.error)
        else:
            future.set_result(self.result)

    def poll(self) -> bool:
        """True once complete (never blocks; skips when another thread is completing it)."""
        if self.done:
            return True
        if not self._lock.acquire(blocking=False):
            return False
        try:
            return self.done or self._advance(self.deadline, self.limit)
        finally:
            self._lock.release()

    def settle(self) -> bool:
        """Drive the operation on the calling thread for a moment (up to SETTLE_S): whether
        it completed. Small operations among ranks in step do, and their Work and future are
        complete before torch sees them, with no hand-off to the progress thread."""
        if self.poll():
            return True
        until = time.monotonic() + SETTLE_S
        while not self.poll():
            if time.monotonic() >= until:
                return False
            os.sched_yield()  # the peer may need this core (more ranks than cores)
        return True

    def signals(self) -> list[Signal] | None:
        """The signals of its Works where each has one (a transport's thread ends it), else
        None."""
        signals: list[Signal] = []
        for work in self._works:
            signal = getattr(work, "signal", None)
            if signal is None:
                return None
            signals.append(signal)
        return signals or None

    def signalled(self) -> None:
        """A signal of one of its Works has fired (on the thread that fired it): complete it
        here where every Work has ended; where another thread holds it (a wait() completes it
        itself; a poll that looked too early may not), the progress thread takes it over."""
        _SIGNALLED.active = True
        try:
            completed = self.poll()
        finally:
            _SIGNALLED.active = False
        if completed:
            _PROGRESS.waited(self.key)
        elif not self.waited and all(s._fired for s in self.signals() or ()):
            _PROGRESS.take_over(self)

    def test(self) -> bool:
        """poll(), raising what the operation failed with (so a _Pending can be a part)."""
        if self.poll() and self.error is not None:
            raise self.error
        return self.done

    def wait(self, timeout: float | None = None) -> None:
        """Block until complete (at most `timeout` s, default the group's); raise what the
        operation failed with."""
        if not self.done:
            if timeout is None:
                deadline, limit = self.deadline, self.limit
            else:
                deadline, limit = time.monotonic() + timeout, timeout
            with self._lock:
                self.waited = True
                try:
                    self._drive(deadline, limit)
                finally:
                    self.waited = False
            if self.key is not None:
                _PROGRESS.waited(self.key)
        if self.error is not None:
            raise self.error

    def _drive(self, deadline: float, limit: float) -> None:
        """wait()'s loop, under the lock: until complete (or failed, or past `deadline`)."""
        spin_until = time.monotonic() + _SPIN_S
        sleep = _POLL_MIN_S
        while not self.done and not self._advance(deadline, limit):
            head = self._works[0] if self._works else None
            drive = getattr(head, "drive", None)  # a hetcomm Work's: run it here if it may
            if drive is not None and drive(deadline):
                continue
            now = time.monotonic()
            if now < spin_until:
                os.sched_yield()  # as flags.wait: polling, but giving up the core
                continue
            # the operation's own waiter where its Work has one (a yielding poll, or a sleep
            # on its signal): a sleep of this VM's 55 us or more between polls was most of a
            # staged send/recv through torch (126 us one way)
            block = getattr(head, "block", None)
            if block is not None and block(min(max(deadline - now, 0.0), 0.1)):
                continue
            time.sleep(sleep)
            sleep = min(sleep * 2, _WAIT_MAX_S)

    def _advance(self, deadline: float, limit: float) -> bool:
        """One non-blocking step, under the lock: True once complete (or failed)."""
        try:
            while self._works:
                if not self._works[0].test():
                    if time.monotonic() > deadline:
                        self._expire(self._works[0], limit)
                    return False
                source = getattr(self._works.pop(0), "source", None)
                if source is not None:
                    self.source = source
            for step in self._after:
                step()
        except BaseException as exc:
            self._fail(exc)
        else:
            self._complete()
        return True

    def _expire(self, work: Any, limit: float) -> None:
        # hetcomm's own wait raises CommTimeout and aborts the communicator; say how long it was
        try:
            work.wait(timeout=1e-3)
        except CommTimeout as exc:
            raise CommTimeout(exc.group, exc.op, exc.seq, limit) from exc

    def _complete(self) -> None:
        if self.record is not None:
            _PROGRESS.end_record(self.record)
        self._end()

    def _fail(self, exc: BaseException) -> None:
        self.error = torch_error(exc, self.name)  # what torch callers catch; hetcomm's as cause
        if self.record is not None:
            _PROGRESS.end_record(self.record)
        self._end()

    def _end(self) -> None:
        with self._future_lock:
            self.done = True
            future = self._future
        if future is not None:
            if getattr(_SIGNALLED, "active", False):
                # on a transport's thread: the future's callbacks are user code (DDP's comm
                # hooks), and one that made a blocking call there would wait for that very
                # thread (the direct proxy); the progress thread, woken now, runs them
                _PROGRESS.settle(self)
            else:
                self._settle_future(future)


# set while a transport's thread completes an operation (_Pending.signalled)
_SIGNALLED = threading.local()


class _Progress:
    """A daemon thread completing operations nobody waits on, in issue order per group.

    It polls the oldest operation of each group, unless a thread waits on it (wait() drives
    it there) or the threads that end its Works complete it (pushed: it polls that one only
    once past its deadline, to fail it): while no group's oldest is its to poll it sleeps, and
    the thread that completed one wakes it once the group has more. A poll beside a wait only
    took the interpreter from the waiting thread: on the CPU VM, a 1 MiB dist.send/recv over
    the mpi transport took 142 us one way so, 104 us without the polls (the bare non-blocking
    call: 88).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queues: dict[int, collections.deque[_Pending]] = {}
        self._thread: threading.Thread | None = None
        self._stop = False
        self._records: list[Record] = []
        self._settling: list[_Pending] = []  # completed operations whose futures to settle

    def add(self, key: int, pending: _Pending) -> None:
        """Complete `pending` (of group `key`) in its group's order: told by the signals of
        its Works where each has one, else polled."""
        signals = pending.signals()
        with self._cond:
            pending.key = key
            pending.pushed = signals is not None
            self._queues.setdefault(key, collections.deque()).append(pending)
            self._start()
            self._cond.notify()
        for signal in signals or ():
            signal.notify(pending.signalled)

    def take_over(self, pending: _Pending) -> None:
        """Poll `pending` from now on (its Works have ended, but it is not complete yet)."""
        with self._cond:
            pending.pushed = False
            self._cond.notify()

    def waited(self, key: int | None) -> None:
        """A wait on an operation of group `key` has ended (or the thread that ended it has
        completed it): the group's ended operations leave its queue, and the thread is woken
        where the next one is its to poll."""
        if key is None:
            return
        with self._cond:
            queue = self._queues.get(key)
            if not queue:
                return
            while queue and queue[0].done:
                queue.popleft()
            if _head(queue) is not None:
                self._cond.notify()

    def _polled(self) -> bool:
        """Whether some group's oldest operation is this thread's to poll (under the lock)."""
        return any(_head(q) is not None for q in self._queues.values())

    def _next_deadline(self) -> float | None:
        """Seconds until the first deadline of a group's oldest operation that the threads
        ending its Works complete (None: no such one), when this thread fails it if it has
        not completed (under the lock)."""
        first = min(
            (q[0].deadline for q in self._queues.values() if q and q[0].pushed), default=None
        )
        return None if first is None else max(first - time.monotonic(), 0.0)

    def _start(self) -> None:
        """The thread, started on first use (under the condition's lock)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="hetcomm-torch-progress", daemon=True
            )
            self._thread.start()
            _at_exit(self.stop)

    def drain(self, key: int, timeout: float) -> None:
        """Wait for the operations of group `key` still in flight (at most `timeout` s)."""
        with self._cond:
            queue = list(self._queues.pop(key, ()))
        for pending in queue:
            try:
                pending.wait(timeout)
            except BaseException as exc:
                log.warning("hetcomm: %s did not end cleanly at shutdown: %s", pending.name, exc)

    def end_record(self, record: Record) -> None:
        """End a profiler event. One that would end on the thread that started it is ended by
        this thread instead: torch's profiler calls an event asynchronous (as gloo's are) when
        it ends on another thread, and an operation's event spans issue to completion."""
        if record.thread != threading.get_ident() or self._stop:
            record.end()
            return
        with self._cond:
            self._records.append(record)
            self._start()
            self._cond.notify()

    def settle(self, pending: _Pending) -> None:
        """Settle the future of completed `pending` on this thread, now."""
        with self._cond:
            if not self._stop:
                self._settling.append(pending)
                self._start()
                self._cond.notify()
                return
        pending._settle_future(pending.future)

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        sleep = _POLL_MIN_S
        while True:
            with self._cond:
                while (
                    not self._stop
                    and not self._records
                    and not self._settling
                    and not self._polled()
                ):
                    self._cond.wait(self._next_deadline())
                    sleep = _POLL_MIN_S
                settling, self._settling = self._settling, []
                if self._stop:
                    break
                queues = [q for q in self._queues.values() if q]
                records, self._records = self._records, []
            for pending in settling:
                pending._settle_future(pending.future)
            for record in records:
                record.end()
            progressed = False
            for queue in queues:
                while True:
                    with self._cond:
                        head = _head(queue)
                    if head is None or not head.poll():
                        break
                    with self._cond:
                        while queue and queue[0].done:
                            queue.popleft()
                    progressed = True
            if progressed or settling:
                sleep = _POLL_MIN_S
            else:
                time.sleep(sleep)
                sleep = min(sleep * 2, _POLL_MAX_S)
        for pending in settling:
            pending._settle_future(pending.future)


def _head(queue: collections.deque[_Pending]) -> _Pending | None:
    """The oldest operation of a group's queue where it is the progress thread's to poll (an
    ended one, to take off; one no thread waits on and no thread ending its Works completes,
    or past its deadline), else None (call under the lock)."""
    head = queue[0] if queue else None
    if head is None or head.done:
        return head
    if head.waited or (head.pushed and time.monotonic() < head.deadline):
        return None
    return head


# Sleeps between polls double from the first value to the second (the progress thread) or the
# third (a thread blocked in wait()): long enough not to steal a core from the computation being
# overlapped, short enough that MPI's non-blocking algorithms, which advance only while polled,
# do not stall between their rounds.
_POLL_MIN_S, _POLL_MAX_S, _WAIT_MAX_S = 20e-6, 500e-6, 50e-6
# a waiting thread first polls without sleeping, yielding the core between polls: small
# operations end within it. Polls back to back held the core a peer on it needed: 4 ranks on
# 2 cores, staged, dist.send/recv of 8 B took 393 us over the bare Communicator, 64 us
# yielding (2026-12-02, `hetcomm bench --latency --transport staged --op sendrecv`)
_SPIN_S = 100e-6
# how long the issuing thread drives an operation before the progress thread takes it over:
# long enough for a small collective among ranks in step, short enough not to hold back a
# caller that overlaps communication with compute
SETTLE_S = 50e-6
_PROGRESS = _Progress()


class _Finished:
    """An operation that completed while it was issued: _Pending's face, without its locks
    and deadline, which nothing here needs (it is never driven)."""

    __slots__ = ("_future", "_group", "_op", "result", "source")

    done = True
    error: BaseException | None = None
    limit = 0.0

    def __init__(self, group: str, op: str, result: list[torch.Tensor]) -> None:
        self._group, self._op, self.result = group, op, result
        self._future: torch.futures.Future | None = None
        self.source: int | None = None  # a receive's sender

    @property
    def name(self) -> str:
        return f"{self._group}: {self._op}"

    @property
    def future(self) -> torch.futures.Future:
        """A completed torch future, made on first use (two threads asking at once may each
        make one: both complete, with the same result)."""
        future = self._future
        if future is None:
            devices = sorted({t.device for t in self.result if t.device.type != "cpu"}, key=str)
            future = torch.futures.Future(devices=list[int | str | torch.device](devices) or None)
            future.set_result(self.result)
            self._future = future
        return future

    def poll(self) -> bool:
        return True

    def test(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> None:
        return None


class _Work(dist.Work):
    """torch's Work for one hetcomm operation: wait(), get_future(), is_completed(), result()."""

    def __init__(self, pending: _Pending | _Finished) -> None:
        super().__init__()
        self._pending = pending

    def wait(self, timeout: timedelta | None = None) -> bool:
        seconds = timeout.total_seconds() if timeout is not None else 0.0
        self._pending.wait(seconds if seconds > 0 else None)
        return True

    def get_future(self) -> torch.futures.Future:
        return self._pending.future

    def is_completed(self) -> bool:
        return self._pending.poll()

    def is_success(self) -> bool:
        return self._pending.poll() and self._pending.error is None

    def exception(self) -> BaseException | None:
        return self._pending.error

    def result(self) -> list[torch.Tensor]:
        self._pending.wait()
        return self._pending.result

    def synchronize(self) -> None:
        self._pending.wait()

    def _source_rank(self) -> int:
        """The sender's rank in the group, for a receive (torch's `dist.recv` without src)."""
        self._pending.wait()
        if self._pending.source is None:
            raise ValueError(
                f"hetcomm: _source_rank() of {self._pending.name}: only a receive has a source"
            )
        return self._pending.source

    def __repr__(self) -> str:
        state = "failed" if self._pending.error else "done" if self._pending.done else "pending"
        return f"<hetcomm.torch Work {self._pending.name} {state}>"


def _joined(parts: list[_Pending], name: str) -> _Work:
    """One Work that completes when every part has (end_coalescing)."""
    result = [t for p in parts for t in p.result]
    pending = _Pending(name, list(parts), [], result, max((p.limit for p in parts), default=60.0))
    if _synchronous():
        pending.wait()
    else:
        _PROGRESS.add(0, pending)
    return _Work(pending)


class _Threads:
    multiple: bool | None = None  # MPI.Query_thread() >= THREAD_MULTIPLE, asked once


def _synchronous() -> bool:
    """True when MPI cannot take calls from two threads: then every operation ends before
    returning (correct, without overlap)."""
    if _Threads.multiple is None:
        from mpi4py import MPI

        _Threads.multiple = MPI.Query_thread() >= MPI.THREAD_MULTIPLE
        if not _Threads.multiple:
            log.warning(
                "hetcomm.torch: MPI is not THREAD_MULTIPLE; operations complete before "
                "they return (no overlap with computation)"
            )
    return not _Threads.multiple


# ---- at exit ------------------------------------------------------------------------------------

_EXIT_HOOKS: list[Callable[[], None]] = []


def _at_exit(hook: Callable[[], None]) -> None:
    # registered after mpi4py's own exit hook, so these run first: threads stop before
    # MPI_Finalize
    if not _EXIT_HOOKS:
        atexit.register(_run_exit_hooks)
    _EXIT_HOOKS.append(hook)


def _run_exit_hooks() -> None:
    while _EXIT_HOOKS:
        try:
            _EXIT_HOOKS.pop()()
        except Exception as exc:
            print(f"hetcomm.torch: at exit: {exc}", file=sys.stderr)


def finished_now(
    works: list[HetcommWork], group: str, name: str, result: list[torch.Tensor]
) -> _Finished | None:
    """The finished Work of operations just started, driven on this thread for a moment (up
    to SETTLE_S in all, yielding the core between polls; small ones among ranks in step end
    within it), or None: then a _Pending follows them, which also reports their errors."""
    source = None
    until = 0.0
    try:
        for work in works:
            while not work.test():
                now = time.monotonic()
                if not until:
                    until = now + SETTLE_S
                elif now >= until:
                    return None
                os.sched_yield()  # the peer may need this core (more ranks than cores)
            if work.source is not None:
                source = work.source
    except BaseException:
        return None
    finished = _Finished(group, name, result)
    finished.source = source
    return finished
