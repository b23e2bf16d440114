"""kernels.device.on_device with a stand-in cupy: the call runs as it is where its device is
current already, and inside the device's context (then restored) where it is not."""

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
