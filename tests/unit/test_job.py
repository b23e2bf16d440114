"""Job: the completion handle of a call queued on a transport's own thread."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Callable

import pytest

from hetcomm.transports.base import Job
from hetcomm.transports.staged.ops import Body, _Drivers


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


def test_a_job_keeps_nothing_its_call_held_once_made() -> None:
    class Held:
        pass

    held = Held()
    ref = weakref.ref(held)
    job = Job(lambda h=held: h)
    del held
    assert ref() is not None
    job.run()
    gc.collect()
    assert ref() is None and job.is_set()


def test_a_body_runs_once_on_whichever_thread_claims_it_first() -> None:
    """staged's driver Body: a thread about to wait runs a body no driver has taken (within
    its deadline), a driver then skips it; a body a driver took is not run again."""
    threads: list[int] = []
    body = Body(lambda by: threads.append(threading.get_ident()), deadline=time.monotonic() + 5)
    assert body.run_here(time.monotonic() + 60) is True
    assert threads == [threading.get_ident()] and body.is_set()
    assert body.claim() is False  # what a driver finds
    assert body.run_here(time.monotonic() + 60) is False and len(threads) == 1

    taken = Body(lambda by: threads.append(0), deadline=time.monotonic() + 5)
    assert taken.claim() is True  # a driver took it
    assert taken.run_here(time.monotonic() + 60) is False and len(threads) == 1


def test_a_body_ends_by_its_own_deadline_or_its_waiters_whichever_comes_first() -> None:
    given: list[float] = []
    soon, late = time.monotonic() + 1, time.monotonic() + 60
    assert Body(given.append, deadline=late).run_here(soon) is True
    assert Body(given.append, deadline=soon).run_here(late) is True
    assert given == [soon, soon]


def test_the_drivers_run_what_nobody_waits_for_and_skip_what_a_waiter_took() -> None:
    drivers = _Drivers(2, "test-drivers", most=2)
    try:
        gate = threading.Event()
        blockers = [drivers.submit(lambda by: gate.wait(), time.monotonic() + 30) for _ in (0, 1)]
        ran: list[str] = []
        stolen = drivers.submit(lambda by: ran.append("stolen"), time.monotonic() + 5)
        assert stolen.run_here(time.monotonic() + 60) is True  # every driver busy: here
        left = drivers.submit(lambda by: ran.append("driver"), time.monotonic() + 5)
        gate.set()
        assert left.wait(10) and all(b.wait(10) for b in blockers)
        assert ran == ["stolen", "driver"]
    finally:
        drivers.shutdown(wait_s=2.0)


def test_the_drivers_grow_while_every_one_waits_for_a_body_queued_behind() -> None:
    """Ten bodies, each waiting for the next one queued to have run, on 2 drivers at first:
    a fixed pool would wait until the deadline; the pool grows (up to `most`) and all end."""
    drivers = _Drivers(2, "test-drivers", most=16)
    try:
        events = [threading.Event() for _ in range(11)]
        events[-1].set()

        def body(i: int) -> Callable[[float], None]:
            def run(by: float) -> None:
                assert events[i + 1].wait(max(0.0, by - time.monotonic()))
                events[i].set()

            return run

        bodies = [drivers.submit(body(i), time.monotonic() + 10) for i in range(10)]
        assert all(b.wait(15) for b in bodies)
        assert all(b.error is None for b in bodies) and all(e.is_set() for e in events)
        assert len(drivers._threads) <= 16
    finally:
        drivers.shutdown(wait_s=2.0)
