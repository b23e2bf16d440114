"""kernels.device.StagingDevice with a stand-in cupy of two devices: whatever it queues on
the GPU it queues with the transport's device current, and the calling thread's current
device is the one it had before the call, whichever that was (a blocking call moves its
message on the caller's own thread, whose current device is the caller's choice)."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
from hetcomm.kernels import device as device_kernels

TRANSPORT, CALLER = 0, 1  # the transport's device, and the one the caller made current


class _Runtime:
    """The runtime calls StagingDevice makes; each records the device current at the call."""

    def __init__(self) -> None:
        self.current = TRANSPORT
        self.calls: list[tuple[str, int]] = []

    def getDevice(self) -> int:
        return self.current

    def setDevice(self, device: int) -> None:
        self.current = device

    def _called(self, name: str) -> None:
        self.calls.append((name, self.current))

    def memcpyAsync(self, *args: object) -> None:
        self._called("memcpyAsync")

    def memsetAsync(self, *args: object) -> None:
        self._called("memsetAsync")

    def hostRegister(self, *args: object) -> None:
        self._called("hostRegister")


@pytest.fixture
def cupy(monkeypatch):
    rt = _Runtime()

    class Stream:
        def __init__(self, non_blocking: bool = False, ptr: int = 0x5000) -> None:
            self.ptr = ptr
            self.device = rt.current
            rt._called("Stream")

        @classmethod
        def from_external(cls, obj):
            return cls(ptr=obj.__cuda_stream__()[1])

        def wait_event(self, event) -> None:
            rt._called("wait_event")

        def synchronize(self) -> None:
            pass

    class Event:
        def __init__(self, block: bool = False, disable_timing: bool = False) -> None:
            rt._called("Event")

        def record(self, stream) -> None:
            self.stream = stream
            rt._called("record")

        def synchronize(self) -> None:
            pass

    class Device:
        def __init__(self, index: int | None = None) -> None:
            self.id = rt.current if index is None else index

        def __enter__(self) -> None:
            self.prev = rt.current
            rt.current = self.id

        def __exit__(self, *exc: object) -> None:
            rt.current = self.prev

    def alloc(nbytes: int):
        rt._called("alloc")
        return types.SimpleNamespace(ptr=0x9000)

    fake = types.SimpleNamespace(
        cuda=types.SimpleNamespace(
            runtime=rt, Device=Device, Stream=Stream, Event=Event, alloc=alloc
        )
    )
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(device_kernels, "_EXTERNAL", {})
    return rt


def _region(nbytes: int, dev: int = 0x7000):
    return types.SimpleNamespace(nbytes=nbytes, dev=dev, host=None)


def test_every_call_queues_on_its_device_and_leaves_the_callers_current(cupy) -> None:
    gpu = device_kernels.StagingDevice(1 << 20, 4)  # made with the transport's device current
    cupy.current = CALLER
    slot = np.zeros(64, np.uint8)
    calls = {
        "ready_on": lambda: gpu.ready_on(0x1234),
        "as_event": lambda: gpu.as_event(gpu.on_stream(0x1234)),
        "on_stream then a copy on it": lambda: gpu.copy_to_address(
            slot.ctypes.data, _region(64), gpu.on_stream(0x1234)
        ),
        "a copy after an event": lambda: gpu.copy_from_host(
            _region(64), slot, gpu.ready_on(0x1234)
        ),
        "a copy between device regions": lambda: gpu.copy_device(
            _region(64, 0x7100), _region(64), None
        ),
        "an outbound copy": lambda: gpu.copy_to_host_async(slot, _region(64), None),
        "a copy in": lambda: gpu.copy_from_host_async(_region(64), slot, None),
        "after_all": lambda: gpu.after_all([object(), object()]),
        "zero": lambda: gpu.zero(0x7000, 64),
        "alloc": lambda: gpu.alloc(64),
    }
    for what, call in calls.items():
        cupy.calls.clear()
        call()
        assert cupy.calls, what
        wrong = [name for name, device in cupy.calls if device != TRANSPORT]
        assert not wrong, f"{what}: {wrong} made with device {CALLER} current"
        assert cupy.current == CALLER, f"{what} left device {cupy.current} current"


def test_where_the_device_is_current_already_nothing_switches(cupy, monkeypatch) -> None:
    gpu = device_kernels.StagingDevice(1 << 20, 4)
    switches = []
    monkeypatch.setattr(cupy, "setDevice", switches.append)
    gpu.copy_to_address(0x8000, _region(64), gpu.on_stream(0x1234))
    gpu.copy_from_host_async(_region(64), np.zeros(64, np.uint8), gpu.ready_on(0x1234))
    assert switches == []


def test_host_register_leaves_the_callers_current(cupy) -> None:
    cupy.current = CALLER
    device_kernels.host_register(0x4000, 4096, TRANSPORT)
    assert cupy.calls == [("hostRegister", TRANSPORT)]
    assert cupy.current == CALLER


def test_as_event_records_on_the_callers_stream_and_passes_events_through(cupy) -> None:
    gpu = device_kernels.StagingDevice(1 << 20, 4)
    on = gpu.on_stream(0x1234)
    assert on.stream.ptr == 0x1234
    cupy.calls.clear()
    event = gpu.as_event(on)
    assert [name for name, _ in cupy.calls] == ["Event", "record"]
    assert event.stream is on.stream  # the caller's stream, no other
    assert gpu.as_event(event) is event and gpu.as_event(None) is None
