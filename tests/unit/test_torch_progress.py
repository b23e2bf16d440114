"""hetcomm.torch's operations in flight without MPI: who completes a torch future.

An operation whose Works a transport's own thread ends (a Signal, as a lane's job or the direct
proxy's task carry) is completed by that thread the moment it ends, and its future settled by
the progress thread, woken at once (the future's callbacks are user code: never on a transport's
thread); the progress thread polls only what nobody ends (MPI requests), and fails the first
kind once past its deadline.
"""

from __future__ import annotations

import threading
import time

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("this torch has no torch.distributed", allow_module_level=True)

from hetcomm.errors import CommTimeout  # noqa: E402
from hetcomm.torch.work import _PROGRESS, _Pending  # noqa: E402
from hetcomm.work import Signal  # noqa: E402


class _Ended:
    """A hetcomm Work stand-in: done once `end()` has run; notes which threads poll it and
    which one saw it complete; waits like a transport's (raising CommTimeout) where it never
    ends."""

    def __init__(self, signal: Signal | None) -> None:
        self.signal = signal
        self.source = None
        self.ended = False
        self.polled_by: set[str] = set()
        self.completed_by: str | None = None

    def end(self) -> None:
        self.ended = True
        if self.signal is not None:
            self.signal.fire()

    def test(self) -> bool:
        name = threading.current_thread().name
        self.polled_by.add(name)
        if self.ended and self.completed_by is None:
            self.completed_by = name
        return self.ended

    def wait(self, timeout: float | None = None) -> None:
        if not self.ended:
            raise CommTimeout("unit", "all_reduce", 1, timeout or 0.0, [1], "rank 1 never came")


def _issued(works: list[_Ended], limit: float, key: int) -> tuple[_Pending, list[str]]:
    """A torch operation of `works`, handed to the progress machinery as the group does, and
    the names of the threads that ran its future's callback (one, just after the future is
    marked done: wait for it, not for done())."""
    result = [torch.zeros(3)]
    pending = _Pending(f"unit {key}", list(works), [], result, limit)
    where: list[str] = []
    pending.future.then(lambda f: where.append(threading.current_thread().name))
    _PROGRESS.add(key, pending)
    return pending, where


def _until(check, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not check() and time.monotonic() < deadline:
        time.sleep(0.001)
    return check()


def test_the_thread_that_ends_the_operation_completes_it() -> None:
    works = [_Ended(Signal()), _Ended(Signal())]
    pending, where = _issued(works, 30.0, 7001)
    time.sleep(0.05)  # the progress thread would have polled a Work without a signal by now
    assert not pending.future.done()
    for i, work in enumerate(works):
        ender = threading.Thread(target=work.end, name=f"unit-ender-{i}")
        ender.start()
        ender.join()
        if i == 0:
            assert not pending.done  # the second Work has not ended
    assert pending.done  # completed by the second ender, before it returned
    assert [w.completed_by for w in works] == ["unit-ender-0", "unit-ender-1"]
    for work in works:
        assert "hetcomm-torch-progress" not in work.polled_by, work.polled_by
    # its future's callbacks (user code) ran on the progress thread, never on an ender
    assert _until(pending.future.done)
    assert _until(lambda: where) and where == ["hetcomm-torch-progress"]
    assert pending.error is None and pending.future.value()[0] is pending.result[0]


def test_a_blocking_wait_in_a_future_callback_does_not_hold_the_ending_thread() -> None:
    """A callback that waits for something the ending thread does next (as a blocking call
    in a comm hook waits for a transport's thread) completes: it does not run there."""
    later = _Ended(Signal())
    first = _Ended(Signal())
    pending, _ = _issued([first], 30.0, 7006)
    chained = pending.future.then(lambda f: _until(lambda: later.ended, 5.0))

    def ender() -> None:
        first.end()  # a callback run here would wait 5 s for the next line
        later.end()

    thread = threading.Thread(target=ender, name="unit-ender")
    start = time.monotonic()
    thread.start()
    assert _until(chained.done, 10.0)
    assert chained.value() is True and time.monotonic() - start < 4.0


def test_a_signal_fired_before_it_is_handed_over_completes_it_at_once() -> None:
    work = _Ended(Signal())
    work.end()
    pending, _ = _issued([work], 30.0, 7002)
    assert pending.done and work.completed_by == threading.current_thread().name
    assert _until(pending.future.done) and pending.error is None


def test_an_operation_without_a_signal_is_polled() -> None:
    work = _Ended(None)
    pending, where = _issued([work], 30.0, 7003)
    time.sleep(0.01)
    work.ended = True  # as an MPI request completes: nobody is told
    assert _until(pending.future.done)
    assert _until(lambda: where) and where == ["hetcomm-torch-progress"]


def test_one_that_never_ends_fails_at_its_deadline() -> None:
    """The Work's transport thread never ends it: the progress thread, which left it alone,
    fails it with the timeout once past its deadline (not before), as torch's words say."""
    work = _Ended(Signal())
    start = time.monotonic()
    pending, where = _issued([work], 0.3, 7004)
    time.sleep(0.1)
    assert not pending.future.done()
    assert "hetcomm-torch-progress" not in work.polled_by
    assert _until(pending.future.done, 10.0)
    waited = time.monotonic() - start
    assert 0.3 <= waited < 5.0, waited
    assert _until(lambda: where) and where == ["hetcomm-torch-progress"]
    assert isinstance(pending.error, RuntimeError) and "Timed out" in str(pending.error)
    assert isinstance(pending.error.__cause__, CommTimeout)


def test_a_wait_completes_it_beside_its_signal() -> None:
    """A thread that waits drives it; the signal fired meanwhile finds it taken and leaves it."""
    work = _Ended(Signal())
    pending, _ = _issued([work], 30.0, 7005)
    threading.Timer(0.02, work.end).start()
    pending.wait(5.0)
    assert pending.done and pending.error is None
    assert _until(lambda: not _PROGRESS._queues.get(7005))  # off its group's queue
