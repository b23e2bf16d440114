"""Waiting on a shared word: it sees another thread's write, honours its deadline, runs check."""

import threading
import time

import numpy as np
import pytest

from hetcomm.transports import flags


def test_sees_a_write_made_later_by_another_thread():
    word = np.zeros(1, np.uint64)
    timer = threading.Timer(0.02, lambda: word.__setitem__(0, 7))
    timer.start()
    try:
        assert flags.wait(lambda: word[0] == 7, time.monotonic() + 5)
    finally:
        timer.cancel()


def test_returns_false_at_its_deadline():
    t0 = time.monotonic()
    assert not flags.wait(lambda: False, t0 + 0.1)
    assert 0.1 <= time.monotonic() - t0 < 1.0


def test_check_runs_while_napping_and_may_raise():
    calls = []

    def check():
        calls.append(1)
        if len(calls) == 2:
            raise ConnectionError("writer gone")

    with pytest.raises(ConnectionError, match="writer gone"):
        flags.wait(lambda: False, time.monotonic() + 5, check)
    assert len(calls) == 2


def test_this_machine_is_described():
    why = flags.unsupported()
    assert why is None or "store order" in why
