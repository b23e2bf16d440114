"""kernels.device with a stand-in cupy: on_device runs the call as it is where its device is
current already, and inside the device's context (then restored) where it is not;
external_stream wraps a caller's stream once per (handle, device), on that device, through
CuPy's stream protocol where CuPy has it and its ExternalStream where not."""

from __future__ import annotations

import sys
import types

import pytest
from hetcomm.kernels import device as device_kernels


@pytest.fixture
def fake_cupy(monkeypatch):
    state = {"current": 0, "entered": 0}

    class Device:
        def __init__(self, index: int) -> None:
            self.index = index

        def __enter__(self) -> None:
            state["entered"] += 1
            self.prev, state["current"] = state["current"], self.index

        def __exit__(self, *exc: object) -> None:
            state["current"] = self.prev

    runtime = types.SimpleNamespace(getDevice=lambda: state["current"])
    cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime, Device=Device))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    return state


def test_the_current_device_runs_without_entering_a_context(fake_cupy) -> None:
    assert device_kernels.on_device(0, lambda a, b: (a + b, fake_cupy["current"]), 2, 3) == (5, 0)
    assert fake_cupy["entered"] == 0


def test_another_device_runs_inside_its_context_and_is_restored(fake_cupy) -> None:
    assert device_kernels.on_device(1, lambda: fake_cupy["current"]) == 1
    assert fake_cupy["entered"] == 1 and fake_cupy["current"] == 0


class _Wrapped:
    def __init__(self, ptr: int, device_id: int, how: str) -> None:
        self.ptr, self.device_id, self.how = ptr, device_id, how


def _with_streams(monkeypatch, fake_cupy, protocol: bool) -> None:
    cupy = sys.modules["cupy"]

    def from_external(obj):
        version, ptr = obj.__cuda_stream__()
        assert version == 0
        return _Wrapped(ptr, fake_cupy["current"], "protocol")  # the current device's, as CuPy

    def external(ptr, device_id=-1):
        return _Wrapped(ptr, device_id, "ExternalStream")

    stream = types.SimpleNamespace(from_external=from_external) if protocol else object()
    monkeypatch.setattr(cupy.cuda, "Stream", stream, raising=False)
    monkeypatch.setattr(cupy.cuda, "ExternalStream", external, raising=False)
    monkeypatch.setattr(device_kernels, "_EXTERNAL", {})


@pytest.mark.parametrize("protocol", [True, False], ids=["from_external", "ExternalStream"])
def test_a_callers_stream_is_wrapped_once_per_handle_and_device(
    monkeypatch, fake_cupy, protocol: bool
) -> None:
    _with_streams(monkeypatch, fake_cupy, protocol)
    how = "protocol" if protocol else "ExternalStream"
    on_1 = device_kernels.external_stream(0x1000, 1)
    assert (on_1.ptr, on_1.device_id, on_1.how) == (0x1000, 1, how)
    assert fake_cupy["current"] == 0  # the device made current for it, then restored
    assert device_kernels.external_stream(0x1000, 1) is on_1
    # the legacy stream's handle is the same on every device: one object per device
    legacy_0, legacy_1 = (device_kernels.external_stream(0, d) for d in (0, 1))
    assert legacy_0 is not legacy_1
    assert (legacy_0.device_id, legacy_1.device_id) == (0, 1)
    # no device named: the current one's
    assert device_kernels.external_stream(0) is legacy_0
