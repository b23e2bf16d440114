"""How a prepared call reads its array (hetcomm.routes): device addresses for device routes."""

from __future__ import annotations

import types

import numpy as np

from hetcomm.routes import device_view, host_view


class _Tensor:
    """A CUDA tensor's surface: data_ptr() and is_contiguous()."""

    def __init__(self, ptr: int, contiguous: bool) -> None:
        self._ptr, self._contiguous = ptr, contiguous

    def data_ptr(self) -> int:
        return self._ptr

    def is_contiguous(self) -> bool:
        return self._contiguous


def _cupy_like(ptr: int, contiguous: bool) -> object:
    """A CuPy array's surface: .data.ptr and .flags.c_contiguous."""
    return types.SimpleNamespace(
        data=types.SimpleNamespace(ptr=ptr), flags=types.SimpleNamespace(c_contiguous=contiguous)
    )


def test_device_view_is_the_address_of_contiguous_arrays_only() -> None:
    assert device_view(_Tensor(0x7000, True), True) == 0x7000
    assert device_view(_Tensor(0x7000, False), False) is None
    assert device_view(_cupy_like(0x9100, True), False) == 0x9100
    assert device_view(_cupy_like(0x9100, False), True) is None


def test_host_view_takes_no_device_array() -> None:
    assert host_view(_cupy_like(0x9100, True), False) is None
    a = np.arange(4.0)
    assert host_view(a, True) is a
    assert host_view(a[::2], False) is None
