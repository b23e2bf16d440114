"""The direct transport's proxy on the CPU (a stand-in cupy, MPI.COMM_SELF): a blocking call's
operation is left to the calling thread without waking the proxy, an asynchronous one wakes it,
and an operation queued unwoken still runs if nobody waits for it."""

from __future__ import annotations

import sys
import threading
import time
import types

import numpy as np
import pytest
from mpi4py import MPI

from hetcomm.transports import flags
from hetcomm.transports.direct import proxy as direct_proxy


@pytest.fixture
def proxy(monkeypatch, request):
    # a long idle bound unless the test is about it: else the proxy's own look at its queue,
    # every _IDLE_S, could take a task that the test expects to find still queued
    monkeypatch.setattr(direct_proxy, "_IDLE_S", getattr(request, "param", 30.0))

    class Device:
        def __init__(self, index: int) -> None:
            self.index = index

        def use(self) -> None:
            pass

    cuda = types.SimpleNamespace(
        runtime=types.SimpleNamespace(getDevice=lambda: 0),
        Device=Device,
        Stream=lambda non_blocking: object(),
    )
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=cuda))
    svc = MPI.COMM_SELF.Dup()
    p = direct_proxy.Proxy(0, sys.modules["cupy"], svc)
    yield p
    p.stop()
    svc.Free()


def _task(ran_on: list[int], *waits: object) -> direct_proxy.Task:
    def gen() -> direct_proxy.Step:
        yield from waits
        ran_on.append(threading.get_ident())

    return direct_proxy.Task(gen())


def test_blocking_call_runs_on_the_calling_thread_without_waking_the_proxy(proxy) -> None:
    ran_on: list[int] = []
    task = _task(ran_on, None)
    proxy.submit(task, False, 8, blocking=True)
    time.sleep(0.01)  # a woken proxy would have taken it by now
    assert proxy._unwoken and len(proxy._new) == 1
    assert proxy.wait(task, False, 1.0)
    assert task.done and ran_on == [threading.get_ident()]
    assert not proxy._new


def test_asynchronous_call_wakes_the_proxy(proxy) -> None:
    ran_on: list[int] = []
    task = _task(ran_on, None)
    proxy.submit(task, False, 8)
    assert task.finished.wait(1.0) and task.done
    assert ran_on and ran_on[0] != threading.get_ident()


@pytest.mark.parametrize("proxy", [0.05], indirect=True)
def test_unwoken_operation_nobody_waits_for_still_runs(proxy) -> None:
    ran_on: list[int] = []
    task = _task(ran_on, None)
    proxy.submit(task, False, 8, blocking=True)
    assert task.finished.wait(1.0) and task.done  # the idle proxy looks again within _IDLE_S
    assert ran_on and ran_on[0] != threading.get_ident()


def test_operation_waiting_for_a_peer_goes_back_to_the_proxy(proxy) -> None:
    """The calling thread gives the operation up after a short while (its message is late);
    the proxy, woken then, finishes it once the message comes."""
    buf, msg = np.zeros(1, np.int64), np.array([7], np.int64)
    req = proxy.svc.Irecv(buf, 0, 5)
    ran_on: list[int] = []
    task = _task(ran_on, req)
    proxy.submit(task, False, 8, blocking=True)
    assert not proxy.wait(task, False, 1.0)  # gave up after _INLINE_S: the message is not there
    assert not task.done
    proxy.svc.Send(msg, 0, 5)
    assert task.finished.wait(1.0) and task.done and buf[0] == 7
    assert ran_on and ran_on[0] != threading.get_ident()


def test_second_call_while_one_is_queued_wakes_the_proxy(proxy) -> None:
    ran_on: list[int] = []
    first, second = _task(ran_on, None), _task(ran_on, None)
    proxy.submit(first, False, 8, blocking=True)
    proxy.submit(second, False, 8, blocking=True)  # busy: the proxy must look
    assert first.finished.wait(1.0) and second.finished.wait(1.0)
    assert len(ran_on) == 2


def test_claim_holds_the_proxy_off_and_release_hands_it_what_came_meanwhile(proxy) -> None:
    """A prepared call claims the idle proxy; while it holds it, an operation queued by
    another thread waits (issue order), and release() wakes the proxy for it. A claim is
    refused while anything is queued or in flight, and by a second claimer."""
    assert proxy.claim()
    assert not proxy.claim()  # one claimer at a time
    ran_on: list[int] = []
    task = _task(ran_on, None)
    queued = threading.Thread(target=proxy.submit, args=(task, False, 8))
    queued.start()
    queued.join()
    time.sleep(0.02)
    assert not task.done and len(proxy._new) == 1  # held off while claimed
    proxy.release()
    assert task.finished.wait(2.0) and task.done and ran_on != [threading.get_ident()]
    pending = _task([], proxy.svc.Irecv(np.zeros(1, np.int8), 0, 99))
    proxy.submit(pending, False, 8)
    time.sleep(0.02)
    assert not proxy.claim()  # an operation in flight goes first
    proxy.svc.Send(np.zeros(1, np.int8), 0, 99)
    assert pending.finished.wait(2.0)
    deadline = time.monotonic() + 2.0
    while not proxy.claim():
        assert time.monotonic() < deadline, "the proxy stayed busy after its last operation"
        time.sleep(0.001)
    proxy.release()


class _Word(direct_proxy.Poll):
    """A word another thread sets (as a peer's store into shared memory)."""

    __slots__ = ("set", "tests")

    def __init__(self) -> None:
        self.set, self.tests = False, 0

    def Test(self) -> bool:
        self.tests += 1
        return self.set


def test_an_operation_waiting_on_words_ends_once_they_are_written(proxy) -> None:
    """The proxy looks at a Poll again and again (no MPI call can wait for it), yielding and
    then napping (flags.wait); it sees the word a while after it is set, runs an operation queued
    meanwhile without waiting for its nap, and its looks thin out over a long wait."""
    word = _Word()
    ran_on: list[int] = []
    task = _task(ran_on, word)
    proxy.submit(task, False, 8)
    time.sleep(0.3)  # yielding for flags.YIELD_SECONDS, then naps growing to flags.NAP_MAX
    assert not task.done
    looks = word.tests
    time.sleep(0.2)
    # napping: at most one look per nap and a few more for the naps cut short
    assert word.tests - looks < 0.2 / flags.NAP_MAX * 1.5 + 10
    other = _task(ran_on, None)
    start = time.monotonic()
    proxy.submit(other, False, 8)
    assert other.finished.wait(1.0) and time.monotonic() - start < flags.NAP_MAX * 50
    word.set = True
    assert task.finished.wait(1.0) and task.done
    assert len(ran_on) == 2 and all(t != threading.get_ident() for t in ran_on)


def test_a_blocking_call_drives_a_wait_on_words_itself(proxy) -> None:
    """The calling thread looks at the words itself until they are written (here at its
    fifth look), as it tests MPI requests."""

    class Later(_Word):
        def Test(self) -> bool:
            return super().Test() or self.tests >= 5

    word = Later()
    ran_on: list[int] = []
    task = _task(ran_on, word)
    proxy.submit(task, False, 8, blocking=True)
    assert proxy.wait(task, False, 1.0)
    assert ran_on == [threading.get_ident()] and word.tests == 5
