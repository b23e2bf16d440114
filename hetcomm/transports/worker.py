"""The in-order worker: one thread running a transport's queued calls in the order issued.

Collectives must start in the same order on every rank; a transport that hands some of them to
a thread gives them all to this one, so they leave it in issue order. `pending` counts the jobs
queued or running; the issuing thread reads it under `lock` to start a small operation directly
only while the worker is idle (a direct start then cannot overtake a queued one). The thread
takes jobs from a SimpleQueue (one wake-up per job, no lock of ours to win first) and counts each
out before setting it, so that its waiter finds the worker idle.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

from .base import Job

_STOP = object()


class InOrderWorker:
    """A thread, started by the first job, that runs jobs one at a time in submission order.

    `refuse`, when given, is asked before each job: an exception it returns becomes the job's
    error instead of running it (the transport is closing: start nothing that could not be
    waited for).
    """

    def __init__(self, name: str, refuse: Callable[[], BaseException | None] | None = None) -> None:
        self.name = name
        self.lock = threading.Lock()
        self.pending = 0  # jobs queued or running; raised by the issuer, lowered by the thread
        self.submitted = 0  # jobs queued so far
        self._refuse = refuse
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def idle(self) -> bool:
        """Whether nothing is queued or running (call with `lock` held)."""
        return not self.pending

    def drained(self) -> bool:
        """Whether every job queued so far has run (takes `lock`)."""
        with self.lock:
            return not self.pending

    def submit(self, call: Callable[[], Any]) -> Job:
        """Queue `call`; its Job is set once it has returned or raised (call with `lock` held)."""
        job = Job(call)
        self.pending += 1
        self.submitted += 1
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            self._thread.start()
        self._queue.put(job)
        return job

    def stop(self, wait_s: float) -> bool:
        """Ask the thread to end after the jobs queued so far; True once it has."""
        if self._thread is None:
            return True
        self._queue.put(_STOP)
        self._thread.join(wait_s)
        return not self._thread.is_alive()

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is _STOP:
                return
            refused = self._refuse() if self._refuse is not None else None
            if refused is not None:
                job.error = refused
            else:
                job.call_only()
            with self.lock:
                self.pending -= 1
            job.set()
