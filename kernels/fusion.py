"""Device side of tensor fusion: the table of arrays, and the pack / unpack launches."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from .device import external_stream

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fusion.cu")
DIMS = 6  # FUSION_DIMS in fusion.cu: strided arrays of up to this many (collapsed) dims
COLS = 4 + 2 * DIMS  # FUSION_COLS
THREADS = 256
_MAX_X = 1024  # blocks along one array
_MAX_Y = 65535  # block rows (arrays at once); more arrays loop inside the kernel
_ELEMENT = {1: "unsigned char", 2: "unsigned short", 4: "unsigned int", 8: "unsigned long long"}

# (address of the first element, offset in the fused buffer, count, shape, strides in elements)
Entry = tuple[int, int, int, tuple[int, ...], tuple[int, ...]]


def collapse(
    shape: Sequence[int], strides: Sequence[int]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The same element order in fewest dims: size-1 dims dropped, neighbours whose strides chain
    (outer stride = inner stride x inner extent) merged. () for an array of one element."""
    merged: list[list[int]] = []
    for n, s in zip(shape, strides):
        if n == 1:
            continue
        if merged and merged[-1][1] == s * n:
            merged[-1] = [merged[-1][0] * n, s]
        else:
            merged.append([n, s])
    return tuple(m[0] for m in merged), tuple(m[1] for m in merged)


def dense(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether collapsed `shape`/`strides` describe consecutive elements."""
    return len(shape) == 0 or (len(shape) == 1 and strides[0] == 1)


def table(entries: Sequence[Entry]) -> tuple[np.ndarray, list[Entry]]:
    """The kernels' table (one row of COLS int64 per array), and the entries it cannot hold
    (more than DIMS dims after collapsing), which are copied one by one instead. Empty arrays
    are left out: they have nothing to copy."""
    rows = np.zeros((len(entries), COLS), dtype=np.int64)
    slow: list[Entry] = []
    used = 0
    for ptr, offset, count, shape, strides in entries:
        if count == 0:
            continue
        shape, strides = collapse(shape, strides)
        if len(shape) > DIMS:
            slow.append((ptr, offset, count, shape, strides))
            continue
        row = rows[used]
        row[0], row[1], row[2] = ptr, offset, count
        if not dense(shape, strides):
            nd = len(shape)
            row[3] = nd
            row[4 : 4 + nd] = shape
            row[4 + DIMS : 4 + DIMS + nd] = strides
        used += 1
    return rows[:used], slow


def grid(rows: np.ndarray) -> tuple[int, int]:
    """(blocks along each array, block rows) for a launch over `rows`."""
    if len(rows) == 0:
        return 0, 0
    longest = int(rows[:, 2].max())
    return max(1, min(_MAX_X, -(-longest // THREADS))), min(len(rows), _MAX_Y)


def unavailable() -> str | None:
    """None when device arrays can be fused here, else why not."""
    try:
        import cupy  # noqa: F401
    except ImportError:
        return "cupy is not installed (pip install 'hetcomm[cuda]')"
    return None


class Packed:
    """A fused device buffer filled by one pack launch; `unpack()` writes it back."""

    def __init__(
        self,
        owner: DeviceFusion,
        device: int,
        streams: list[int],
        fused: Any,
        rows: Any,
        dims: tuple[int, int, int],
        slow: list[Entry],
        itemsize: int,
    ) -> None:
        self._owner, self._device, self._streams = owner, device, streams
        self._fused, self._rows, self._dims, self._slow = fused, rows, dims, slow
        self._itemsize = itemsize
        self.ptr = int(fused.data.ptr)

    def synchronize(self) -> None:
        """Block until the pack has finished (for consumers that ignore stream order)."""
        cupy = self._owner.cupy
        with cupy.cuda.Device(self._device):
            external_stream(self._streams[0], self._device).synchronize()

    def unpack(self) -> None:
        """Queue the unpack on the first array's stream; the other arrays' streams wait for it.
        The fused buffer and the table were allocated on that stream, so the memory pool hands
        them out again only to work queued after the unpack."""
        cupy = self._owner.cupy
        with cupy.cuda.Device(self._device):
            main = external_stream(self._streams[0], self._device)
            with main:
                self._owner._launch(
                    "fusion_unpack", self._rows, self._dims, self.ptr, self._itemsize, main
                )
                for entry in self._slow:
                    target, seg = self._owner._views(entry, self._fused, self._itemsize)
                    target[...] = seg
            _join(cupy, main, self._streams[1:], self._device)
        self._fused = self._rows = None


class DeviceFusion:
    """The pack and unpack kernels (compiled on first use, per device) and their launches."""

    def __init__(self) -> None:
        import cupy

        self.cupy = cupy

    def _function(self, name: str) -> Any:
        from .device import kernel

        return kernel(name, _SOURCE)

    def _launch(
        self,
        kernel: str,
        rows: Any,
        dims: tuple[int, int, int],
        fused_ptr: int,
        itemsize: int,
        stream: Any,
    ) -> None:
        count, x, y = dims  # arrays in the table, blocks along each, block rows
        if count == 0:
            return
        name = f"{kernel}<{_ELEMENT[itemsize]}>"
        self._function(name)(
            (x, y), (THREADS,), (rows, np.int32(count), np.uint64(fused_ptr)), stream=stream
        )

    def _views(self, entry: Entry, fused: Any, itemsize: int) -> tuple[Any, Any]:
        """(the array of `entry` as a cupy view, its segment of the fused buffer)."""
        cupy = self.cupy
        ptr, offset, count, shape, strides = entry
        dtype = np.dtype(f"u{itemsize}")
        lowest = sum(min(0, (n - 1) * s) for n, s in zip(shape, strides))
        highest = sum(max(0, (n - 1) * s) for n, s in zip(shape, strides))
        base = ptr + lowest * itemsize
        mem = cupy.cuda.UnownedMemory(base, (highest - lowest + 1) * itemsize, None)
        target = cupy.ndarray(
            shape,
            dtype,
            cupy.cuda.MemoryPointer(mem, -lowest * itemsize),
            strides=tuple(s * itemsize for s in strides),
        )
        seg = fused.view(dtype)[offset : offset + count].reshape(shape)
        return target, seg

    def pack(
        self,
        entries: Sequence[Entry],
        total: int,
        itemsize: int,
        device: int | None,
        streams: list[int],
    ) -> Packed:
        """Pack `entries` into a new fused buffer of `total` elements, in one launch on the
        first stream of `streams` (the arrays' streams, first array's first), after the work
        queued on every one of them."""
        cupy = self.cupy
        rows_host, slow = table(entries)
        if device is None:
            device = int(cupy.cuda.Device().id)
        dims = (len(rows_host), *grid(rows_host))
        with cupy.cuda.Device(device):
            main = external_stream(streams[0], device)
            for other in streams[1:]:
                event = cupy.cuda.Event(disable_timing=True)
                event.record(external_stream(other, device))
                main.wait_event(event)
            with main:
                fused = cupy.empty(max(total, 1) * itemsize, dtype=cupy.uint8)
                rows = cupy.asarray(rows_host) if len(rows_host) else rows_host
                self._launch("fusion_pack", rows, dims, int(fused.data.ptr), itemsize, main)
                for entry in slow:
                    target, seg = self._views(entry, fused, itemsize)
                    seg[...] = target
            return Packed(self, device, streams, fused, rows, dims, slow, itemsize)


def _join(cupy: Any, main: Any, others: Sequence[int], device: int) -> None:
    """Make each of `others` wait for the work queued on `main` so far."""
    if not others:
        return
    event = cupy.cuda.Event(disable_timing=True)
    event.record(main)
    for other in others:
        external_stream(other, device).wait_event(event)


_SHARED: DeviceFusion | None = None
_SHARED_LOCK = threading.Lock()


def shared() -> DeviceFusion:
    """The process's DeviceFusion (kernels are compiled once per process and device)."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None:
            _SHARED = DeviceFusion()
        return _SHARED
