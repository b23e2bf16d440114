"""Work: the handle of an operation in flight, one progress model for every transport."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .errors import CommTimeout, InvalidArgument, MpiError, PeerLost

if TYPE_CHECKING:
    from .transports.base import Context

Poll = Callable[[], bool]

log = logging.getLogger("hetcomm")

# Spin this long before sleeping: short operations finish within it, and a spin costs no wake-up.
_SPIN_S = 200e-6
_FIRST_SLEEP_S, _MAX_SLEEP_S = 10e-6, 1e-3  # Work.wait's naps: the first, the longest


# Whether the call this thread is issuing will wait for its operation at once (a blocking
# call): the communicator says so before it hands the call to a transport, which may then leave
# its progress thread asleep, since the calling thread is about to run the operation itself.
_issuing = threading.local()


def set_blocking(blocking: bool) -> None:
    _issuing.blocking = blocking


def take_blocking() -> bool:
    """Whether the call being issued on this thread is a blocking one; read once."""
    if getattr(_issuing, "blocking", False):
        _issuing.blocking = False
        return True
    return False


def thread_stacks() -> str:
    """The Python stack of every thread of this process, innermost call last (as a traceback
    prints it): where a stalled operation's threads wait."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        stack = "".join(traceback.format_stack(frame))
        parts.append(f"thread {names.get(ident, ident)!r}:\n{stack}")
    return "\n".join(parts)


# ---- observers: callables told of every operation that completes (hetcomm.trace is one) -------

Observer = Callable[["Work"], None]

# Replaced whole, never changed in place: a completing Work iterates the tuple it read while
# another thread registers or removes an observer.
_observers: tuple[Observer, ...] = ()
_observers_lock = threading.Lock()

# True while any observer is registered. The communicator reads it once per call: its prepared
# blocking calls make no Work, so it takes them only while nobody observes.
observing = False


def add_observer(fn: Observer) -> None:
    """Call `fn(work)` with every Work that completes from now on, on the completing thread."""
    global _observers, observing
    if not callable(fn):
        raise InvalidArgument(f"add_observer: expected a callable, got {type(fn).__name__}")
    with _observers_lock:
        if fn not in _observers:
            _observers = (*_observers, fn)
        observing = True


def remove_observer(fn: Observer) -> bool:
    """Stop calling `fn`; whether it was registered (a bound method matches an equal one)."""
    global _observers, observing
    with _observers_lock:
        kept = tuple(o for o in _observers if o != fn)
        removed = len(kept) != len(_observers)
        _observers = kept
        observing = bool(kept)
    return removed


def observers() -> tuple[Observer, ...]:
    """The observers registered now, in the order they are called."""
    return _observers


class Signal:
    """What another thread sets once an operation has ended (a lane's or driver's job, the
    direct proxy's task): `notify(fn)` has `fn()` called once it is set, on the thread that
    sets it, or at once where it is set already. A Work whose transport completes it on such
    a thread carries it (Work.signal), so that what follows the Work without polling it (the
    torch layer's operations, for their futures) is completed by that thread."""

    __slots__ = ("_fired", "_listeners")

    def __init__(self) -> None:
        self._fired = False
        self._listeners: list[Callable[[], None]] | None = None

    def notify(self, fn: Callable[[], None]) -> None:
        with _LISTENING:
            if self._listeners is None:
                self._listeners = [fn]
            else:
                self._listeners.append(fn)
        if self._fired:  # set meanwhile: its own look may have found nobody listening yet
            self._call_listeners()

    def fire(self) -> None:
        """Call once the operation has ended (its outcome in place): tell every listener."""
        self._fired = True
        if self._listeners is not None:
            self._call_listeners()

    def _call_listeners(self) -> None:
        with _LISTENING:  # each listener is taken once, by whichever thread comes first
            listeners, self._listeners = self._listeners, None
        for fn in listeners or ():
            try:
                fn()
            except Exception:  # the setting thread is a transport's: it must go on
                log.exception("hetcomm: a listener of an operation's end failed")


_LISTENING = threading.Lock()


class Work:
    """An operation in flight: `wait(timeout)`, `test()`, `exception()`.

    A transport hands over a `poll` callable that advances the operation and returns True once it
    is complete, and optionally `finish` steps that run once, after completion, on the waiting
    thread (unpacking, averaging).

    `info` is None or a dict a transport fills with facts for the trace (HETCOMM_TRACE):
    "transport" (its name), "bytes" (the operation's size on this rank), "stages" (the pieces
    it moved in), or anything JSON can hold. `source`: for a receive, the rank the message
    came from (set on completion; what a receive from ANY_SOURCE learns). `signal`: the
    Signal another thread sets once the operation has ended, where one does (else None).
    """

    __slots__ = (
        "_comm",
        "_done",
        "_drive",
        "_error",
        "_finish",
        "_keep",
        "_poll",
        "_t0",
        "_timeout",
        "_waiter",
        "info",
        "observed",
        "op",
        "seq",
        "signal",
        "source",
    )

    def __init__(
        self,
        comm: Context,
        op: str,
        seq: int,
        poll: Poll,
        finish: Sequence[Callable[[], None]] = (),
        timeout: float | None = None,
        waiter: Callable[[float], bool] | None = None,
        drive: Callable[[float], bool] | None = None,
        signal: Signal | None = None,
    ) -> None:
        self._comm = comm
        self.op, self.seq = op, seq
        self._poll = poll
        self._finish = finish
        self._timeout = timeout
        self._done = False
        self._error: BaseException | None = None
        self._keep: tuple[object, ...] = ()
        # blocks up to the given seconds until completion is likely: no spinning needed
        self._waiter = waiter
        # runs the operation to its end on the calling thread where it has not started
        # elsewhere, within the given deadline: whether it did (see drive())
        self._drive = drive
        self._t0 = time.perf_counter()  # the start of the operation, for the trace
        self.info: dict[str, Any] | None = None
        self.source: int | None = None  # a receive's sender, once complete
        self.signal = signal
        # whether observers are told of it (not of a wait inside another operation)
        self.observed = True

    def test(self) -> bool:
        """True once the operation is complete (its result is in place); never blocks."""
        if self._done:
            if self._error is not None:
                raise self._error
            return True
        try:
            if not self._poll():
                return False
            for step in self._finish:
                step()
        except BaseException as exc:
            err = self._failed(exc)
            if err is exc:
                raise
            raise err from exc
        self._done = True
        self._keep = ()
        if observing and self.observed:
            for fn in _observers:
                fn(self)
        return True

    def is_completed(self) -> bool:
        """Alias of test() for torch-style callers."""
        return self.test()

    def wait(self, timeout: float | None = None) -> None:
        """Block until complete, at most `timeout` seconds (default: the operation's timeout).

        On expiry raises CommTimeout and aborts the communicator, since ranks that disagree
        about an operation cannot be brought back in step.
        """
        if self.test():
            return
        if timeout is not None and (isinstance(timeout, bool) or not timeout > 0):
            raise InvalidArgument(
                f"Work.wait: timeout must be a positive number of seconds, got {timeout!r}"
            )
        limit = timeout if timeout is not None else self._timeout
        if limit is None:
            limit = self._comm.config.timeout
        start = time.monotonic()
        deadline = start + limit
        spin_until = start + _SPIN_S
        stall_at = start + self._comm.config.stall
        sleep = _FIRST_SLEEP_S
        while True:
            self.drive(deadline)  # where the operation may run here, it does
            if self.test():
                return
            now = time.monotonic()
            if now >= deadline:
                break
            if now >= stall_at:
                self._warn_stall(now - start, deadline - now)
                stall_at = deadline
            if not self.block(min(deadline - now, 0.1)) and now >= spin_until:
                time.sleep(min(sleep, deadline - now))
                sleep = min(sleep * 2, _MAX_SLEEP_S)
        missing, detail = self._comm.late(self.op, self.seq)
        exc = CommTimeout(self._comm.name, self.op, self.seq, limit, missing, detail)
        self._fail(exc)
        self._comm._abort(exc)
        raise exc

    def drive(self, deadline: float) -> bool:
        """Run the operation to its end on this thread, where its transport allows (its work
        queued for a helper thread that has not taken it yet) and it ends by `deadline`
        (monotonic): whether it ran here. A thread about to wait for the operation calls it,
        so that an asynchronous call waited for soon costs what the blocking call does rather
        than two thread hand-offs. Raises nothing: the outcome is the next test()'s."""
        if self._drive is None or self._done:
            return False
        try:
            return self._drive(deadline)
        except BaseException as exc:
            self._failed(exc)
            return True

    def _failed(self, exc: BaseException) -> BaseException:
        """Record that the operation failed with `exc` (polled or waited for): the error the
        caller sees, hetcomm's where MPI raised (which group, operation and sequence); a
        timeout or a lost peer aborts the communicator."""
        mpi = sys.modules.get("mpi4py.MPI")  # loaded wherever an MPI call could fail
        if mpi is not None and isinstance(exc, mpi.Exception):
            wrapped = MpiError(self._comm.name, self.op, self.seq, exc)
            wrapped.__cause__ = exc  # also where a waiter met it and test() raises it later
            self._fail(wrapped)
            self._comm._abort(wrapped)
            return wrapped
        self._fail(exc)
        if isinstance(exc, (CommTimeout, PeerLost)):
            self._comm._abort(exc)
        return exc

    def block(self, seconds: float) -> bool:
        """Wait up to `seconds` for completion to be likely, as wait() does between its polls:
        through the transport's waiter (which yields, or sleeps on the operation's own signal),
        returning True; False at once where the transport gave none. Raises nothing: a waiter
        that polled and met the operation's failure records it, and the next test() raises it
        (a mismatched receive found so is the same error as one found by test)."""
        if self._waiter is None or self._done:
            return False
        try:
            self._waiter(seconds)
        except BaseException as exc:
            self._failed(exc)
        return True

    def _warn_stall(self, waited: float, left: float) -> None:
        missing, detail = self._comm.late(self.op, self.seq)
        who = f"ranks not arrived: {list(missing)}" if missing is not None else ""
        log.warning(
            "group '%s': %s #%d has waited %.1f s without completing (CommTimeout in %.1f s); "
            "%s\nwhere each thread of this rank is:\n%s",
            self._comm.name,
            self.op,
            self.seq,
            waited,
            left,
            "; ".join(part for part in (who, detail) if part),
            thread_stacks(),
        )

    def exception(self) -> BaseException | None:
        """The error the operation ended with, or None (also while it is still running)."""
        return self._error

    def _fail(self, exc: BaseException) -> None:
        self._done = True
        self._error = exc

    def __repr__(self) -> str:
        state = "failed" if self._error else ("done" if self._done else "pending")
        return f"<Work {self._comm.name} {self.op} #{self.seq} {state}>"


def wait_for(
    owner: Context,
    op: str,
    seq: int,
    poll: Poll,
    timeout: float | None = None,
    waiter: Callable[[float], bool] | None = None,
) -> None:
    """Wait (bounded, with the stall warning) for a step inside an operation: `poll` returns
    True once it is done (`waiter`: as Work's). Not traced as an operation of its own."""
    work = Work(owner, op, seq, poll, timeout=timeout, waiter=waiter)
    work.observed = False
    work.wait()


class BusyPoll:
    """`poll` waited for without sleeping: call it as the poll (True once it has been: the
    underlying poll is not called again after it completed, since an MPI request Tested
    after its completion reads as another, empty one) and hand `wait` to Work as its waiter,
    which keeps polling, yielding the core in between, for the seconds it is given.

    For MPI requests: MPI moves a message larger than the eager size only inside MPI calls, a
    fragment at a time (Open MPI 4's ob1 pipeline), so a wait that sleeps between Tests made a
    16 MiB send/recv 70 times slower than MPI_Wait, which itself polls without sleeping."""

    __slots__ = ("_poll", "done")

    def __init__(self, poll: Poll) -> None:
        self._poll = poll
        self.done = False

    def __call__(self) -> bool:
        if self.done:
            return True
        if self._poll():
            self.done = True
            return True
        return False

    def wait(self, seconds: float) -> bool:
        until = time.monotonic() + seconds
        while not self():
            os.sched_yield()
            if time.monotonic() >= until:
                return False
        return True


class Follow:
    """The drive and waiter of a Work that completes with other Works: `current()` names the
    one it waits for now (None while none has started). A wait drives that Work where it may
    run on the waiting thread and blocks on its own signal (its waiter); a growing nap where
    it has none, or none has started, as Work.wait naps. (Without them the wrapping Work's
    wait would nap between polls of the Works it follows, whatever signal those have.)"""

    __slots__ = ("_nap", "current")

    def __init__(self, current: Callable[[], Work | None]) -> None:
        self.current = current
        self._nap = _FIRST_SLEEP_S

    def drive(self, deadline: float) -> bool:
        work = self.current()
        return work is not None and work.drive(deadline)

    def wait(self, seconds: float) -> bool:
        work = self.current()
        if work is not None and (work._done or work.block(seconds)):
            return True
        time.sleep(min(self._nap, seconds))
        self._nap = min(self._nap * 2, _MAX_SLEEP_S)
        return False


def completed(comm: Context, op: str, seq: int) -> Work:
    """A Work that is already complete (for operations with nothing to move)."""
    work = Work(comm, op, seq, _true)
    work._done = True
    return work


def _true() -> bool:
    return True


def all_of(comm: Context, works: list[Work], op: str = "all_reduce") -> Work:
    """One Work over several, complete once each is (in order; the first failure is its own)."""
    left = list(works)

    def poll() -> bool:
        while left:
            if not left[0].test():
                return False
            left.pop(0)
        return True

    follow = Follow(lambda: left[0] if left else None)
    return Work(comm, op, works[-1].seq, poll, waiter=follow.wait, drive=follow.drive)
