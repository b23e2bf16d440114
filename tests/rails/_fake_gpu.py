"""A stand-in for hetcomm.kernels.device on the CPU, for the staged shm rail's flag-ordered path.

"Device" memory is host memory. Each stream is a thread that runs what is queued on it in order
and never blocks the thread that queued it, as a GPU stream does: copies by ctypes.memmove, flag
waits by polling the 32-bit word until it reaches the value, flag writes by storing it, events
by setting a threading.Event. Every copy is done a little late (STREAM_DELAY_S), so that a
missing wait shows as wrong bytes. `install()` puts it in place of the real device layer;
`errors` lists what went wrong inside a stream (a flag wait that never ended).
"""

from __future__ import annotations

import contextlib
import ctypes
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from hetcomm.arrays import Buffer

STREAM_DELAY_S = 200e-6
WAIT_LIMIT_S = 20.0
errors: list[str] = []


def _addr(arr: np.ndarray) -> int:
    return int(arr.__array_interface__["data"][0])


def _word(address: int) -> ctypes.c_uint32:
    return ctypes.c_uint32.from_address(address)


class Stream:
    def __init__(self) -> None:
        self._queue: queue.Queue[Callable[[], None]] = queue.Queue()
        threading.Thread(target=self._run, daemon=True, name="fake-stream").start()

    def _run(self) -> None:
        while True:
            work = self._queue.get()
            try:
                work()
            except Exception as exc:  # a stream that stopped would hang everything after it
                errors.append(f"{type(exc).__name__}: {exc}")

    def put(self, work: Callable[[], None]) -> None:
        self._queue.put(work)


class Event:
    def __init__(self) -> None:
        self._set = threading.Event()

    def set(self) -> None:
        self._set.set()

    @property
    def done(self) -> bool:
        return self._set.is_set()

    def synchronize(self) -> None:
        if not self._set.wait(WAIT_LIMIT_S):
            raise RuntimeError("a fake stream never reached this event")


def _wait_word(address: int, value: int) -> None:
    end = time.monotonic() + WAIT_LIMIT_S
    while _word(address).value < value:
        if time.monotonic() > end:
            raise RuntimeError(
                f"flag wait for {value} never ended (flag is {_word(address).value})"
            )
        time.sleep(20e-6)


def _copy(dst: int, src: int, n: int) -> None:
    time.sleep(STREAM_DELAY_S)
    if n:
        ctypes.memmove(dst, src, n)


class Flags:
    """Stands for kernels.device.StreamFlags: the device address of host memory is itself."""

    def device_pointer(self, host_ptr: int) -> int:
        return host_ptr


class FakeDevice:
    """Stands for kernels.device.StagingDevice."""

    def __init__(self, chunk_bytes: int, slots: int) -> None:
        self.device = 0
        self._outbound = Stream()
        self._local = threading.local()

    def _stream(self) -> Stream:
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = Stream()
        return stream

    def ready_event(self, buf: Any) -> Event:
        event = Event()
        event.set()
        return event

    def prepare(self, dtype: str, op: str) -> None:
        pass

    def copy_to_slot_flagged(
        self,
        dst: np.ndarray,
        src: Any,
        ready: Any,
        free_word: int,
        free_value: int,
        ready_word: int,
        ready_value: int,
    ) -> None:
        d, s, n = _addr(dst), src.dev, src.nbytes

        def run() -> None:
            if free_value:
                _wait_word(free_word, free_value)
            _copy(d, s, n)
            _word(ready_word).value = ready_value

        self._outbound.put(run)

    def copy_from_slot_flagged(
        self,
        dst: Any,
        src: np.ndarray,
        ready: Any,
        ready_word: int,
        ready_value: int,
        free_word: int,
        free_value: int,
    ) -> None:
        d, s, n = dst.dev, _addr(src), dst.nbytes

        def run() -> None:
            _wait_word(ready_word, ready_value)
            _copy(d, s, n)
            _word(free_word).value = free_value

        self._stream().put(run)

    def mark(self, outbound: bool) -> Event:
        event = Event()
        (self._outbound if outbound else self._stream()).put(event.set)
        return event

    def _queued_copy(self, stream: Stream, d: int, s: int, n: int) -> Event:
        event = Event()

        def run() -> None:
            _copy(d, s, n)
            event.set()

        stream.put(run)
        return event

    def copy_to_host_async(self, dst: np.ndarray, src: Any, ready: Any) -> Event:
        return self._queued_copy(self._outbound, _addr(dst), src.dev, src.nbytes)

    def copy_from_host_async(self, dst: Any, src: np.ndarray, ready: Any) -> Event:
        return self._queued_copy(self._stream(), dst.dev, _addr(src), dst.nbytes)

    def copy_to_host(self, dst: np.ndarray, src: Any, ready: Any) -> None:
        self._queued_copy(self._stream(), _addr(dst), src.dev, src.nbytes).synchronize()

    def copy_from_host(self, dst: Any, src: np.ndarray, ready: Any) -> None:
        self._queued_copy(self._stream(), dst.dev, _addr(src), dst.nbytes).synchronize()

    @contextlib.contextmanager
    def bounce(self, nbytes: int) -> Iterator[np.ndarray]:
        yield np.empty(nbytes, np.uint8)

    def close(self) -> None:
        pass


def install() -> None:
    """Put the stand-in in place of hetcomm.kernels.device's GPU parts, in this process."""
    from hetcomm.kernels import device

    device.unavailable = lambda: None
    device.StagingDevice = FakeDevice  # type: ignore[misc,assignment]
    device.host_register = lambda ptr, nbytes, index: None
    device.host_unregister = lambda ptr: None
    device._FLAGS[:] = [Flags()]  # type: ignore[list-item]


def device_buffer(arr: np.ndarray) -> Buffer:
    """A Buffer that says its bytes (those of the uint8 array `arr`) are on a GPU."""
    return Buffer(arr, "fake", "uint8", arr.shape, "cuda:0", 0, _addr(arr), True, False, None)
