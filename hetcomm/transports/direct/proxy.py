"""The direct transport's proxy: one thread per communicator that progresses its operations.

An operation is a generator of waits (an MPI request, a list of them, a Poll of shared words,
GPU work, or None); the proxy advances every operation that can move and blocks only when none
can (see Proxy). A blocking call may run its operation on the calling thread instead
(Proxy.wait).
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import deque
from collections.abc import Generator
from functools import partial
from typing import Any

import numpy as np
from mpi4py import MPI

from ...kernels.device import on_device
from ...trace import Stamps
from ...work import Signal
from .. import flags, tags

# a step of an operation waits for one of these: an MPI request (or a list of them), a Poll, a
# GPU event, or nothing (None)
Step = Generator[Any, None, None]


class Poll:
    """A wait on words another rank writes (mailbox.py): Test() is True once it is over."""

    __slots__ = ()

    def Test(self) -> bool:
        """Whether the wait is over (named as an MPI request's Test)."""
        raise NotImplementedError


class Task(Signal):
    """One operation on the proxy: a generator of waits, and its outcome (its listeners are
    told once it has one, on the thread that ran its last step)."""

    __slots__ = ("done", "error", "finished", "gen", "here", "waiting")

    def __init__(self, gen: Step) -> None:
        super().__init__()
        self.gen = gen
        self.here = True  # may still run on the calling thread (Proxy.wait)
        self.waiting: Any = None
        self.done = False
        self.error: BaseException | None = None
        self.finished = threading.Event()

    def poll(self) -> bool:
        """True once the operation is done; raises its error if it failed."""
        if self.error is not None:
            raise self.error
        return self.done


def _on_peer(w: Any) -> bool:
    """Whether wait `w` is for another rank (an MPI request, a list of them, or a Poll)."""
    return isinstance(w, (MPI.Request, list, Poll))


def _mpi_ready(w: Any) -> bool:
    if w is None:
        return True
    if isinstance(w, list):
        return bool(MPI.Request.Testall(w))
    return bool(w.Test())


_POKE = np.zeros(1, np.int8)
# how long the calling thread runs an operation itself while it waits for another rank, before
# handing it to the proxy (Proxy.wait)
_INLINE_S = 2e-3
_NEVER = 1 << 62
# the longest an idle proxy sleeps before it looks at its queue again unasked
_IDLE_S = 0.05
# from this size, queueing an operation behind others hands the interpreter to the proxy
# (Proxy.submit). On the H200, 32 back-to-back 256 MiB receives on the default stream:
# 1502 -> 1685 GB/s with it; at 64 KiB - 16 MiB it made each operation 30-70 us slower
_YIELD_BYTES = 64 << 20
# the steps of direct operations (what the proxy waited for, ...), stamped while stamp.marks is
# a list (the probe direct_profile.py in docs/lab-notes/benchmarks-2026-11.md sets and reads it)
stamp = Stamps()


class Mark:
    """A point on a stream (the proxy's, or a prepared call's: Proxy.mark): its event and its
    number in the order of marks. Work on one stream completes in order, so once mark n is
    known reached every earlier one is, and while it is not, no later one is: the proxy asks
    the GPU about one mark per pass instead of about every operation in flight."""

    __slots__ = ("event", "n")

    def __init__(self, event: Any, n: int) -> None:
        self.event, self.n = event, n

    def synchronize(self) -> None:
        """Block the host until the stream has passed this mark."""
        self.event.synchronize()


class Proxy:
    """The thread that progresses every operation of one communicator: collectives one at a
    time in issue order, point-to-point operations side by side with them.

    It never spins holding the interpreter lock. It advances every operation that can move;
    when none can, it blocks on the oldest GPU work waited for (a synchronize: GPU work finishes
    on its own), or, when all wait for other processes, in MPI_Waitany over every request they
    wait for plus a message to itself that an operation queued meanwhile sends to wake it. With
    nothing to do it sleeps on a condition that queueing an operation signals.
    """

    def __init__(self, device: int, cupy: Any, svc: MPI.Intracomm) -> None:
        self.cupy, self.device, self.svc = cupy, device, svc
        self.rank = svc.Get_rank()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._in_mpi = False  # blocked in MPI_Waitany: a new operation must send the message
        self._inline = False  # the calling thread runs an operation itself (see wait)
        self._unwoken = False  # a blocking call's operation was queued without waking it
        self._marks = 0  # marks put on the proxy's stream so far
        self._reached = 0  # every mark up to this one is complete
        self._busy = _NEVER  # in this pass: a mark known not reached (later ones are not either)
        self._new: deque[tuple[Task, bool]] = deque()
        self._colls: deque[Task] = deque()
        self._p2p: list[Task] = []
        self._stop = False
        self._pokes: list[MPI.Request] = []
        self._wake_buf = np.zeros(1, np.int8)
        self._wake = svc.Irecv(self._wake_buf, self.rank, tags.DIRECT_WAKE)
        self.stream: Any = None
        self._thread = threading.Thread(target=self._loop, name="hetcomm-direct-proxy", daemon=True)
        self._started = threading.Event()
        self._thread.start()
        self._started.wait()

    def submit(self, task: Task, collective: bool, nbytes: int = 0, blocking: bool = False) -> None:
        """Queue `task` for the proxy. For a blocking call (`blocking`) that finds the proxy
        with nothing to do, the proxy is left asleep: the calling thread is about to run the
        operation itself (wait), and a proxy woken for nothing would take the interpreter
        from it in the middle of the operation, once per call."""
        with self._lock:
            self._new.append((task, collective))
            busy = self._colls or self._p2p or len(self._new) > 1
            if blocking and not busy and not self._inline:
                self._unwoken = True
            else:
                self._wake_up()
        if busy and nbytes >= _YIELD_BYTES:
            # large operations issued back to back: let the proxy have the interpreter now, so
            # that it starts the earlier ones' GPU work while this thread issues the next (else
            # it waits for the interpreter's switch interval and the GPU idles). Not for small
            # ones, whose GPU work is shorter than the two thread switches this costs, and not
            # when the proxy is idle: then a blocking call runs the operation itself (wait)
            time.sleep(0)

    def claim(self) -> bool:
        """Let the calling thread run an operation of its own start to end (a prepared call,
        direct/prepared.py): True where nothing is queued or in flight, and the proxy then
        holds off new operations until release(); False where operations issued before are
        not done (the call then queues behind them)."""
        with self._lock:
            if self._inline or self._new or self._colls or self._p2p:
                return False
            self._inline = True
            return True

    def release(self) -> None:
        """End what claim() began; operations queued meanwhile go to the proxy."""
        with self._lock:
            self._inline = False
            if self._new:
                self._wake_up()

    def _wake_up(self) -> None:
        """Have the proxy look at its queue (call with the lock held)."""
        self._unwoken = False
        if self._in_mpi:
            self._poke()
        else:
            self._idle.notify()

    def _poke(self) -> None:
        """Wake the thread out of MPI_Waitany (call with the lock held)."""
        self._pokes = [r for r in self._pokes if not r.Test()]
        self._pokes.append(self.svc.Isend(_POKE, self.rank, tags.DIRECT_WAKE))

    def mark(self, stream: Any) -> Mark:
        """A new mark at the end of `stream` (recorded by whichever thread runs the operation:
        the proxy, or the calling thread while the proxy is idle). The proxy's stream, or a
        caller's where a prepared call holds the proxy (direct/collectives.py): that call
        waits for its marks before it lets go, so every mark before a later one of the proxy's
        stream is reached once that one is."""
        event = self.cupy.cuda.Event(disable_timing=True)
        event.record(stream)
        self._marks += 1
        return Mark(event, self._marks)

    def _gpu_done(self, w: Any) -> bool:
        if w.__class__ is not Mark:
            return bool(w.done)  # an event on the caller's stream
        if w.n <= self._reached:
            return True
        if w.n >= self._busy or not w.event.done:
            self._busy = min(self._busy, w.n)
            return False
        self._reached = w.n
        return True

    def _advance(self, task: Task) -> bool:
        """Run `task` until it waits for something not yet complete (an MPI request, or GPU work
        still running); True once it ended."""
        try:
            while True:
                w = task.waiting
                if w is not None:
                    if isinstance(w, (MPI.Request, list)):
                        if not _mpi_ready(w):
                            return False
                    elif isinstance(w, Poll):
                        if not w.Test():
                            return False
                    elif not self._gpu_done(w):  # the proxy synchronizes it when idle
                        return False
                if stamp.marks is not None:
                    stamp("start" if w is None else "peer" if _on_peer(w) else "gpu")
                task.waiting = next(task.gen)
        except StopIteration:
            task.done = True
        except BaseException as exc:
            task.error = exc
        task.finished.set()
        task.fire()
        return True

    def _synchronize(self, w: Any) -> None:
        """Wait for GPU work (our own or the caller's: it finishes on its own)."""
        w.synchronize()
        if w.__class__ is Mark:
            self._reached = max(self._reached, w.n)

    def wait(self, task: Task, collective: bool, seconds: float) -> bool:
        """Wait up to `seconds` for `task`; the Work's waiter.

        When the proxy has nothing else to do and has not picked `task` up yet, the calling
        thread, which would only sleep, runs it itself: a blocking operation then pays no
        hand-off to the proxy thread and back. Issue order is kept, since nothing else is in
        flight. If it is still waiting on another rank after a short while, it goes back to the
        proxy, so the wait stays bounded and the calling thread does not spin.
        """
        with self._lock:
            alone = (
                task.here
                and not self._inline
                and not self._colls
                and not self._p2p
                and len(self._new) == 1
                and self._new[0][0] is task
            )
            if alone:
                self._new.popleft()
                self._inline = True
                task.here = False  # once: if it goes back to the proxy, it stays there
        if not alone:
            with self._lock:
                if self._unwoken:
                    self._wake_up()
            return task.finished.wait(seconds)
        ended = False
        stamp("inline")
        try:
            ended = on_device(
                self.device, self._drive, task, time.monotonic() + min(seconds, _INLINE_S)
            )
        finally:
            with self._lock:
                self._inline = False
                if not ended:
                    self._new.appendleft((task, collective))
                if self._new:  # this one, back to the proxy, or others queued meanwhile
                    self._wake_up()
        return ended

    def _drive(self, task: Task, until: float) -> bool:
        """Advance `task` on this thread until it ends (True) or `until` passes (False)."""
        while True:
            self._busy = _NEVER
            if self._advance(task):
                return True
            w = task.waiting
            if not _on_peer(w):
                self._synchronize(w)
            elif time.monotonic() > until:
                return False
            elif isinstance(w, Poll):
                os.sched_yield()  # lets this process's other threads run between looks

    def _loop(self) -> None:
        self.cupy.cuda.Device(self.device).use()
        self.stream = self.cupy.cuda.Stream(non_blocking=True)
        self._started.set()
        while True:
            with self._lock:
                if self._stop:
                    return
                while self._new and not self._inline:
                    task, collective = self._new.popleft()
                    (self._colls.append if collective else self._p2p.append)(task)
            moved = False
            self._busy = _NEVER
            while self._colls and self._advance(self._colls[0]):
                self._colls.popleft()
                moved = True
            ended = [t for t in self._p2p if self._advance(t)]
            if ended:
                self._p2p = [t for t in self._p2p if t not in ended]
                moved = True
            if moved:
                continue
            active = ([self._colls[0]] if self._colls else []) + self._p2p
            gpu = next((t.waiting for t in active if not _on_peer(t.waiting)), None)
            if gpu is not None:
                # every other operation waits for GPU work or for another rank: the GPU work
                # finishes on its own, so waiting for it blocks nobody for long. Operations
                # that launched their GPU work and wait for it no longer hold back the ones
                # behind them (back-to-back copies queue on the stream together)
                self._synchronize(gpu)
                continue
            if any(isinstance(t.waiting, Poll) for t in active):
                # words no MPI call can wait for: wait as a host's ranks wait for a word
                # (flags.wait: yielding the core between looks, then napping), until an
                # operation can move or one is queued (which ends a nap at once)
                flags.wait(partial(self._movable, active), math.inf, sleep=self._nap)
                continue
            waiting: list[MPI.Request] = [self._wake]
            for t in active:
                w = t.waiting
                waiting.extend(w if isinstance(w, list) else [w])
            with self._lock:
                if (self._new and not self._inline) or self._stop:
                    continue
                if len(waiting) == 1:  # nothing in flight: sleep until an operation comes
                    # (bounded: an operation left unwoken and never waited for still runs)
                    self._idle.wait(_IDLE_S)
                    continue
                self._in_mpi = True
            woke = MPI.Request.Waitany(waiting)
            with self._lock:
                self._in_mpi = False
            if woke == 0:
                self._wake = self.svc.Irecv(self._wake_buf, self.rank, tags.DIRECT_WAKE)

    def _movable(self, active: list[Task]) -> bool:
        """Whether one of `active` can move (what it waits for is over), an operation was
        queued, or the proxy is to stop."""
        if (self._new and not self._inline) or self._stop:
            return True
        for t in active:
            w = t.waiting
            if w.Test() if isinstance(w, Poll) else _mpi_ready(w):
                return True
        return False

    def _nap(self, seconds: float) -> None:
        """Sleep up to `seconds`, or until an operation is queued or the proxy is stopped."""
        with self._lock:
            if not (self._new and not self._inline) and not self._stop:
                self._idle.wait(seconds)

    def stop(self) -> None:
        """Stop the proxy thread and join it (up to 5 s), then settle its wake-up messages."""
        with self._lock:
            self._stop = True
            self._poke()
            self._idle.notify()
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            # the last wake-up receive is still posted: a message of our own completes it
            if not self._wake.Test():
                self.svc.Send(_POKE, self.rank, tags.DIRECT_WAKE)
                self._wake.Wait()
            MPI.Request.Waitall(self._pokes)
