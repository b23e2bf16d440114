"""work.BusyPoll: a poll waited for without sleeping, that calls its poll no more once done;
Work.block: the transport's waiter, for callers that poll a Work themselves."""

from __future__ import annotations

import time

import pytest

from hetcomm.work import BusyPoll, Work


class _Request:
    """Completes at its `at`-th Test; a Test after completion is an error (as _Receive's poll,
    which would read an empty status)."""

    def __init__(self, at: int) -> None:
        self.at, self.calls, self.done = at, 0, False

    def test(self) -> bool:
        assert not self.done, "polled again after it completed"
        self.calls += 1
        self.done = self.calls >= self.at
        return self.done


def test_the_poll_is_not_called_again_once_done():
    request = _Request(3)
    busy = BusyPoll(request.test)
    assert not busy() and not busy()
    assert busy() and busy() and busy()
    assert request.calls == 3


def test_wait_polls_until_done_without_sleeping():
    request = _Request(500)
    busy = BusyPoll(request.test)
    t0 = time.monotonic()
    assert busy.wait(5.0)
    assert time.monotonic() - t0 < 1.0  # 500 polls, yields between them: no naps
    assert busy() and request.calls == 500


def test_wait_gives_up_after_its_seconds():
    busy = BusyPoll(lambda: False)
    t0 = time.monotonic()
    assert not busy.wait(0.05)
    assert 0.05 <= time.monotonic() - t0 < 1.0


class _Owner:
    """The communicator a Work reports to: its name, its settings, and abort. The Works made
    here are not observed (`observed = False`): the first observed one in a process decides
    whether it traces, from its communicator's config."""

    name = "t"

    class config:
        timeout, stall = 30.0, 30.0

    def _abort(self, exc: BaseException) -> None:
        self.aborted = exc

    def late(self, op: str, seq: int) -> tuple[None, str]:
        return None, ""


def test_block_hands_the_time_to_the_waiter():
    request = _Request(200)
    busy = BusyPoll(request.test)
    work = Work(_Owner(), "recv", 1, busy, waiter=busy.wait)  # type: ignore[arg-type]
    work.observed = False
    assert work.block(5.0) and busy.done
    assert work.test()
    assert not work.block(5.0)  # complete: nothing to wait for
    bare = Work(_Owner(), "recv", 2, lambda: False)  # type: ignore[arg-type]
    bare.observed = False
    t0 = time.monotonic()
    assert not bare.block(5.0) and time.monotonic() - t0 < 1.0  # no waiter: returns at once


def test_a_failure_met_in_the_waiter_is_the_operations_error():
    """A waiter that polls and meets the operation's failure (a receive of another size) makes
    it the Work's error, raised by the next test() and by wait(), as a failing poll is."""
    from hetcomm.errors import MismatchError

    def poll() -> bool:
        raise MismatchError("the sender has 20 bytes, this receive takes 16")

    for how in ("block", "wait"):
        work = Work(_Owner(), "recv", 3, lambda: False, waiter=lambda s: poll())  # type: ignore[arg-type]
        work.observed = False
        if how == "block":
            assert work.block(1.0)
            with pytest.raises(MismatchError, match="20 bytes"):
                work.test()
        else:
            with pytest.raises(MismatchError, match="20 bytes"):
                work.wait(5.0)
        assert isinstance(work.exception(), MismatchError)
