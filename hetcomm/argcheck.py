"""Per-call argument checks of the communicator, and the packing of non-contiguous host
arrays into contiguous copies (written back when the operation is done)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .arrays import Buffer
from .errors import InvalidArgument
from .work import Work


def check_timeout(timeout: Any, op: str) -> float:
    """`timeout` as seconds, or InvalidArgument naming `op` and what arrived."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise InvalidArgument(
            f"{op}: timeout must be a positive number of seconds, got {timeout!r}"
        )
    return float(timeout)


def same(b: Buffer, ref: Buffer, what: str, count_ok: bool, expected: str) -> None:
    """`b` has `ref`'s dtype and memory, and the right count; else InvalidArgument."""
    if b.dtype != ref.dtype:
        raise InvalidArgument(f"{what}: expected dtype {ref.dtype} like x, got {b.dtype}")
    if b.on_device != ref.on_device or b.device_index != ref.device_index:
        raise InvalidArgument(
            f"{what}: expected memory where x lives ({ref.describe()}), got {b.describe()}"
        )
    if not count_ok:
        raise InvalidArgument(f"{what}: expected {expected}, got {b.count} (shape {list(b.shape)})")


def writable(b: Buffer, what: str) -> None:
    """InvalidArgument when the operation would write a read-only array."""
    if b.readonly:
        raise InvalidArgument(f"{what}: the array is read-only but this operation writes it")


def contiguous_in(b: Buffer, copy: bool = False) -> Buffer:
    """`b` itself when contiguous, else (or when `copy`) a packed copy: inputs only."""
    if b.contiguous and not copy:
        return b
    if b.host is None:
        if b.contiguous:
            return _device_copy(b)
        raise InvalidArgument(
            f"{b.describe()}: non-contiguous device arrays are not packed yet; pass a "
            "contiguous array (.contiguous() / cupy.ascontiguousarray)"
        )
    packed = np.array(b.host, order="C", copy=True).reshape(-1)
    return host_buffer(b, packed)


def _device_copy(b: Buffer) -> Buffer:
    """A copy of contiguous device input `b` (an input the output overlaps: in-place
    all_gather, reduce_scatter, all_to_all), made on the caller's stream, so that work queued
    there before the call comes first and the operation, ordered after that stream, reads it."""
    import cupy

    from .kernels.device import caller_stream

    with cupy.cuda.Device(b.device_index):
        stream = caller_stream(b)
        copy = cupy.empty(b.nbytes, dtype=cupy.uint8)
        cupy.cuda.runtime.memcpyAsync(copy.data.ptr, b.ptr, b.nbytes, 3, stream.ptr)  # D2D
    return Buffer(
        obj=copy,
        kind=b.kind,
        dtype=b.dtype,
        shape=b.shape,
        device=b.device,
        device_index=b.device_index,
        ptr=copy.data.ptr,
        contiguous=True,
        readonly=False,
        host=None,
    )


def contiguous_out(b: Buffer, steps: list[Callable[[], None]]) -> Buffer:
    """`b` itself when contiguous; else a packed copy whose result is written back when done."""
    if b.contiguous:
        return b
    if b.host is None:
        raise InvalidArgument(
            f"{b.describe()}: non-contiguous device arrays are not packed yet; pass a "
            "contiguous array (.contiguous() / cupy.ascontiguousarray)"
        )
    target = b.host
    packed = np.array(target, order="C", copy=True).reshape(-1)
    steps.append(lambda: np.copyto(target, packed.reshape(target.shape)))
    return host_buffer(b, packed)


def host_buffer(like: Buffer, flat: np.ndarray) -> Buffer:
    """A Buffer like `like` over the packed host copy `flat`."""
    return Buffer(
        obj=like.obj,
        kind=like.kind,
        dtype=like.dtype,
        shape=like.shape,
        device="cpu",
        device_index=None,
        ptr=flat.__array_interface__["data"][0],
        contiguous=True,
        readonly=False,
        host=flat,
    )


def then(work: Work, steps: list[Callable[[], None]]) -> Work:
    """`work`, with `steps` run after its own finishing steps (unpacking)."""
    if steps:
        work._finish = [*work._finish, *steps]
    return work
