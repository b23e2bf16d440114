"""Job: the completion handle of a call queued on a transport's own thread."""

from __future__ import annotations

import threading
import time

import pytest

from hetcomm.transports.base import Job


def test_wait_times_out_until_set_then_returns_at_once() -> None:
    job = Job(lambda: None)
    t0 = time.monotonic()
    assert job.wait(0.05) is False and not job.is_set()
    assert time.monotonic() - t0 >= 0.04
    job.run()
    assert job.is_set() and job.wait(0) is True and job.wait() is True
    job.check()  # no error


def test_every_waiter_wakes_when_another_thread_runs_it() -> None:
    ran: list[int] = []
    job = Job(lambda: ran.append(1))
    woke: list[bool] = []
    waiters = [threading.Thread(target=lambda: woke.append(job.wait(10))) for _ in range(4)]
    for t in waiters:
        t.start()
    time.sleep(0.02)
    assert not woke  # all still blocked
    runner = threading.Thread(target=job.run)
    runner.start()
    for t in [runner, *waiters]:
        t.join(10)
    assert ran == [1] and woke == [True] * 4


def test_error_is_kept_for_the_waiting_thread_and_set_is_idempotent() -> None:
    def boom() -> None:
        raise ValueError("lane call failed")

    job = Job(boom)
    job.call_only()
    assert not job.is_set() and isinstance(job.error, ValueError)
    job.set()
    job.set()  # a second set neither raises nor unbalances the lock
    assert job.wait(0) is True
    with pytest.raises(ValueError, match="lane call failed"):
        job.check()
