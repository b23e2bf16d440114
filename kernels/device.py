"""Device side of staging: pinned buffers, copy streams and reduction kernels."""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from ..dtypes import BOOL_REDUCTION, HALVES, TABLE
from .host_copies import memcpy_async

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reduce.cu")
_OPS = {"sum": "Sum", "prod": "Prod", "min": "Min", "max": "Max"}
_LOGICAL_OPS = {"or": "Or", "and": "And"}
_THREADS = 256


def unavailable() -> str | None:
    """None when device staging can run here, else why not."""
    try:
        import cupy
    except ImportError:
        return "cupy is not installed (pip install 'hetcomm[cuda]')"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no GPU visible to cupy"
    except Exception as exc:
        return f"the GPU runtime is not usable ({exc})"
    return None


def host_register(ptr: int, nbytes: int, device: int) -> None:
    """Pin and map existing host pages (a shared segment) for the GPU, from `device`'s context
    (a thread that never chose a device would otherwise open a context on device 0); the
    thread's current device is as it was after."""
    import cupy

    # portable | mapped: usable from every device and addressable by kernels and copies
    on_device(device, cupy.cuda.runtime.hostRegister, ptr, nbytes, 1 | 2)


def host_unregister(ptr: int) -> None:
    """Undo host_register: the GPU runtime forgets the pages at `ptr`."""
    import cupy

    cupy.cuda.runtime.hostUnregister(ptr)


def on_device(device: int, fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) with `device` current: as it is where it is already (the usual case, on the
    path of every call: no context to enter), else inside cupy's Device context."""
    import cupy

    if cupy.cuda.runtime.getDevice() == device:
        return fn(*args)
    with cupy.cuda.Device(device):
        return fn(*args)


# the caller's stream and device, where another thread makes a call on the caller's behalf
# (an asynchronous collective started once its check has completed: hetcomm.deferred)
_CALLER = threading.local()


def current_stream(buf: Any) -> int:
    """The stream the caller's array is used on (torch's / cupy's current stream), or the
    caller's, where this thread acts for it (on_behalf_of)."""
    kind = getattr(buf, "kind", "")
    if kind == "numba":
        pinned = getattr(_CALLER, "stream", None)
        if pinned is not None:
            return int(pinned)
        handle = getattr(getattr(buf.obj, "stream", None), "handle", None)
        return int(getattr(handle, "value", handle) or 0)
    read = stream_reader(kind, buf.device_index)
    assert read is not None
    return read()


@functools.cache
def stream_reader(kind: str, device_index: int | None) -> Callable[[], int] | None:
    """What reads, at each call, the stream an array of `kind` on `device_index` is used on:
    the caller's (on_behalf_of), else torch's current stream of that device for tensors and
    cupy's current stream for any other array; None for numba's, whose stream is the array's
    own. Made once per (kind, device)."""
    if kind == "numba":
        return None
    own: Callable[[], int]
    if kind == "torch":
        import torch

        current = torch.cuda.current_stream

        def own() -> int:
            return int(current(device_index).cuda_stream)
    else:
        import cupy

        get_current = cupy.cuda.get_current_stream

        def own() -> int:
            return int(get_current().ptr)

    def read() -> int:
        pinned = getattr(_CALLER, "stream", None)
        return int(pinned) if pinned is not None else own()

    return read


def by_stream(bufs: Sequence[Any]) -> dict[int, Any]:
    """Each stream `bufs` are used on (current_stream), in their order, with the first of them
    used on it."""
    first: dict[int, Any] = {}
    for b in bufs:
        first.setdefault(current_stream(b), b)
    return first


def on_behalf_of(buf: Any, call: Callable[[], Any]) -> Callable[[], Any]:
    """`call`, to run on another thread as if on this one: with this thread's current stream
    for `buf` (cupy's and torch's are per thread) and `buf`'s device current there."""
    stream = current_stream(buf)
    index = buf.device_index

    def run() -> Any:
        import cupy

        before = getattr(_CALLER, "stream", None)
        _CALLER.stream = stream
        try:
            if index is None:
                return call()
            with cupy.cuda.Device(index):
                return call()
        finally:
            _CALLER.stream = before

    return run


_EXTERNAL: dict[tuple[int, int], Any] = {}


class _Handle:
    """A raw stream handle offered through the CUDA stream protocol (`__cuda_stream__`)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


def external_stream(ptr: int, device: int | None = None) -> Any:
    """A cupy stream object for the raw stream handle `ptr` (a caller's stream) of `device`
    (None: the current device), made once per (handle, device) and kept: making one costs
    microseconds on every operation. The device is part of the key: the legacy and per-thread
    default streams have the same handle on every device. Made through `Stream.from_external`
    where CuPy has it (14 on, where ExternalStream is deprecated), with `device` current: CuPy
    14.2 records the device as unknown (-1), later versions take the current one."""
    import cupy

    if device is None:
        device = cupy.cuda.runtime.getDevice()
    key = (ptr, device)
    found = _EXTERNAL.get(key)
    if found is None:
        from_external = getattr(cupy.cuda.Stream, "from_external", None)
        if from_external is None:
            found = cupy.cuda.ExternalStream(ptr, device)
        else:
            with cupy.cuda.Device(device):
                found = from_external(_Handle(ptr))
        _EXTERNAL[key] = found
    return found


def caller_stream(buf: Any) -> Any:
    """The stream object of the stream the caller's array is used on."""
    return external_stream(current_stream(buf), buf.device_index)


class OnStream:
    """The `ready` of a blocking call's copy that goes on the caller's own stream (a cupy
    stream object): queued there, it runs after the caller's work with no event recorded
    there and no other stream waiting on one (StagingDevice._copy)."""

    __slots__ = ("stream",)

    def __init__(self, stream: Any) -> None:
        self.stream = stream


def _on_its_device(method: Callable[..., Any]) -> Callable[..., Any]:
    """A StagingDevice method run with the transport's device current on this thread, and the
    thread's current device as it was after: the thread may be a caller's (a blocking call
    moves its message on the thread that makes it), whose current device is the caller's
    choice. Where it is current already (a rank of one device), one query and no switch."""

    @functools.wraps(method)
    def run(self: StagingDevice, *args: Any) -> Any:
        return on_device(self.device, method, self, *args)

    return run


class StagingDevice:
    """Per-transport device state: pinned bounce buffers, a copy stream per thread, kernels.
    Whatever it queues on the GPU it queues with its device current, and leaves the calling
    thread's current device as it found it (_on_its_device)."""

    def __init__(self, chunk_bytes: int, slots: int) -> None:
        import cupy

        self.cupy = cupy
        self.device = cupy.cuda.Device().id
        self.chunk_bytes = chunk_bytes
        self._pool: list[Any] = []
        self._pool_cond = threading.Condition()
        self._pool_size = 0
        self._pool_max = 2 * slots
        self._local = threading.local()
        self._outbound: Any = None
        self._outbound_lock = threading.Lock()

    # ---- streams and the caller's ordering ---------------------------------------------------

    def _stream(self) -> Any:
        """This thread's copy stream (made on the device: called with it current)."""
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = self.cupy.cuda.Stream(non_blocking=True)
        return stream

    def _outbound_stream(self) -> Any:
        """The one stream of every copy into a shared slot, whichever thread queues it: they
        finish one after the other in the order queued, so the receiver can start copying the
        first out as early as possible. On a stream per thread, two such copies shared the link
        and finished late together, and the receiver's copies waited for them (on the H200, a
        256 MiB send/recv spent 0.8 ms so). Called with the device current."""
        with self._outbound_lock:
            if self._outbound is None:
                self._outbound = self.cupy.cuda.Stream(non_blocking=True)
            return self._outbound

    def ready_event(self, buf: Any) -> Any:
        """On the calling thread: an event after the work queued on the caller's stream; every
        copy and kernel of the transfer waits for it."""
        return self.ready_on(current_stream(buf))

    def ready_on(self, stream: int) -> Any:
        """An event after the work queued so far on raw stream handle `stream` of this
        device (a caller's stream, read by the caller's thread)."""
        return self._recorded(external_stream(stream, self.device))

    @_on_its_device
    def _recorded(self, stream: Any) -> Any:
        ready = self.cupy.cuda.Event(disable_timing=True)
        ready.record(stream)
        return ready

    def on_stream(self, stream: int) -> OnStream:
        """The `ready` of a blocking call's copies (raw stream handle `stream` of this device,
        the caller's): a copy that the call's own thread, or the one that lands its message
        while it waits, queues and waits for goes on that stream itself (_copy), where an
        event recorded there and a copy stream waiting on it cost more than a 64 KiB copy;
        work that other threads and streams take up waits for an event (as_event)."""
        return OnStream(external_stream(stream, self.device))  # the stream object is kept there

    def as_event(self, ready: Any) -> Any:
        """`ready` as an event other streams can wait for: an OnStream's is recorded on its
        stream now (its call is still waiting, so nothing of the caller's has been queued
        there since it began); an event or None as it is."""
        return self._recorded(ready.stream) if ready.__class__ is OnStream else ready

    @_on_its_device
    def after_all(self, events: Sequence[Any]) -> Any:
        """On the calling thread: one event after every one of `events` (None among them:
        nothing to wait for), or None where there is none to wait for."""
        pending = [e for e in events if e is not None]
        if len(pending) <= 1:
            return pending[0] if pending else None
        stream = self._stream()
        for event in pending:
            stream.wait_event(event)
        joined = self.cupy.cuda.Event(disable_timing=True)
        joined.record(stream)
        return joined

    # ---- copies ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def bounce(self, nbytes: int) -> Iterator[np.ndarray]:
        """A pinned host buffer of at least `nbytes` (from a bounded pool, reused)."""
        need = max(nbytes, self.chunk_bytes)
        with self._pool_cond:
            while True:
                for i, mem in enumerate(self._pool):
                    if mem.size() >= need:
                        self._pool.pop(i)
                        break
                else:
                    if self._pool_size < self._pool_max:
                        self._pool_size += 1
                        mem = self.cupy.cuda.alloc_pinned_memory(need)
                    elif self._pool:
                        self._pool.pop(0)  # too small: replace it with a larger one
                        mem = self.cupy.cuda.alloc_pinned_memory(need)
                    else:
                        self._pool_cond.wait(0.05)
                        continue
                break
        try:
            yield np.frombuffer(mem, np.uint8, nbytes)
        finally:
            with self._pool_cond:
                self._pool.append(mem)
                self._pool_cond.notify()

    @_on_its_device
    def _copy(self, dst: int, src: int, nbytes: int, kind: int, ready: Any) -> None:
        """A copy on this thread's stream after `ready` (on the caller's stream where `ready`
        is an OnStream), waited for. Its end is marked by the thread's one reused event:
        nothing else holds it once the copy has been waited for (making and destroying an
        event per copy cost microseconds of every message)."""
        if nbytes == 0:
            return
        if ready.__class__ is OnStream:
            stream, ready = ready.stream, None
        else:
            stream = self._stream()
        end = getattr(self._local, "end", None)
        if end is None:
            end = self._local.end = self._end_event()
        self._queue(dst, src, nbytes, kind, ready, stream)
        end.record(stream)
        end.synchronize()

    @_on_its_device
    def _copy_async(
        self, dst: int, src: int, nbytes: int, kind: int, ready: Any, stream: Any = None
    ) -> Any:
        """Queue a copy on `stream` (default: this thread's); the returned event marks its end."""
        if nbytes == 0:
            return None
        stream = stream or self._stream()
        self._queue(dst, src, nbytes, kind, ready, stream)
        event = self._end_event()
        event.record(stream)
        return event

    def _queue(self, dst: int, src: int, nbytes: int, kind: int, ready: Any, stream: Any) -> None:
        if ready is not None:
            stream.wait_event(ready)
        memcpy_async(self.cupy.cuda.runtime, dst, src, nbytes, kind, stream.ptr)

    def _end_event(self) -> Any:
        # non-blocking: the runtime chooses how a waiter waits (spins while cores are spare),
        # waking it within microseconds; a blocking event sleeps on an interrupt (slower here)
        return self.cupy.cuda.Event(block=False, disable_timing=True)

    @_on_its_device
    def copy_to_host_async(self, dst: np.ndarray, src: Any, ready: Any) -> Any:
        """A copy into a shared slot (on the one outbound stream); the event of its end."""
        return self._copy_async(_addr(dst), src.dev, src.nbytes, 2, ready, self._outbound_stream())

    def copy_from_host_async(self, dst: Any, src: np.ndarray, ready: Any) -> Any:
        """Queue a copy of host `src` into device region `dst` after `ready`; its event."""
        return self._copy_async(dst.dev, _addr(src), dst.nbytes, 1, ready)

    def copy_to_host(self, dst: np.ndarray, src: Any, ready: Any) -> None:
        """Copy device region `src` into host `dst` after `ready`, and wait for it."""
        self.copy_to_address(_addr(dst), src, ready)

    def copy_from_host(self, dst: Any, src: np.ndarray, ready: Any) -> None:
        """Copy host `src` into device region `dst` after `ready`, and wait for it."""
        self.copy_from_address(dst, _addr(src), ready)

    def copy_to_address(self, dst: int, src: Any, ready: Any) -> None:
        """copy_to_host into the host memory at address `dst` (`src.nbytes` of it): for
        memory whose address the caller knows (a ring's slot), where reading it from an
        array costs a microsecond."""
        self._copy(dst, src.dev, src.nbytes, 2, ready)  # cudaMemcpyDeviceToHost

    def copy_from_address(self, dst: Any, src: int, ready: Any) -> None:
        """copy_from_host out of the host memory at address `src` (`dst.nbytes` of it)."""
        self._copy(dst.dev, src, dst.nbytes, 1, ready)  # cudaMemcpyHostToDevice

    def copy_device(self, dst: Any, src: Any, ready: Any) -> None:
        """Copy region `src` into region `dst`, whichever memory each is in."""
        if src.host is not None:
            self.copy_from_host(dst, src.host, ready)
        elif dst.host is not None:
            self.copy_to_host(dst.host, src, ready)
        else:
            self._copy(dst.dev, src.dev, dst.nbytes, 3, ready)  # cudaMemcpyDeviceToDevice

    @_on_its_device
    def zero(self, ptr: int, nbytes: int) -> None:
        """Zero device memory on this thread's copy stream, in order with its copies, and wait."""
        if nbytes:
            stream = self._stream()
            self.cupy.cuda.runtime.memsetAsync(ptr, 0, nbytes, stream.ptr)
            stream.synchronize()

    @_on_its_device
    def alloc(self, nbytes: int) -> tuple[Any, int]:
        """Device memory of `nbytes` (at least one) on this device: (owner, address)."""
        mem = self.cupy.cuda.alloc(max(nbytes, 1))
        return mem, int(mem.ptr)

    # ---- reductions ----------------------------------------------------------------------------

    def _kernel(self, name: str) -> Any:
        return kernel(name)

    @_on_its_device
    def _launch(self, name: str, args: tuple[Any, ...], count: int, ready: Any) -> None:
        stream = self._stream()
        if ready is not None:
            stream.wait_event(ready)
        launch_on(stream, name, args, count)
        stream.synchronize()

    @_on_its_device
    def prepare(self, dtype: str, op: str) -> None:
        """Compile (or load) the kernels a reduction needs, before any stream waits on it."""
        self._kernel(_combine_name(dtype, "sum" if op == "avg" else op))
        if op == "avg":
            self._kernel(divide_name(dtype))

    def combine(self, dst: Any, src: Any, dtype: str, op: str, ready: Any) -> None:
        """dst = op(dst, src) element-wise on the GPU."""
        count = dst.nbytes // _itemsize(dtype)
        args = (np.uint64(dst.dev), np.uint64(src.dev), np.uint64(count))
        self._launch(_combine_name(dtype, op), args, count, ready)

    def divide(self, region: Any, n: int, dtype: str, ready: Any) -> None:
        """Divide the elements of device `region` by `n` in place (AVG), after `ready`."""
        count = region.nbytes // _itemsize(dtype)
        args = (np.uint64(region.dev), np.uint64(count), np.int64(n))
        self._launch(divide_name(dtype), args, count, ready)

    def close(self) -> None:
        """Drop the pooled buffers."""
        with self._pool_cond:
            self._pool.clear()


_MODULES: dict[tuple[str, str], Any] = {}
_MODULES_LOCK = threading.Lock()


def kernel(name: str, source: str = _SOURCE) -> Any:
    """Function `name` of a CUDA C++ source for the current device, compiled on first use by
    CuPy (NVRTC or hiprtc) and looked up once per device.

    One small module per kernel (and cached on disk by CuPy): compiling every instantiation of
    a source up front takes long enough to stall a first call. The function objects are kept,
    since asking a module for one again costs tens of microseconds on every launch.
    """
    import cupy

    key = (source, name, cupy.cuda.runtime.getDevice())
    found = _FUNCTIONS.get(key)
    if found is not None:
        return found
    with _MODULES_LOCK:
        module = _MODULES.get((source, name))
        if module is None:
            with open(source) as f:
                code = f.read()
            module = _MODULES[source, name] = cupy.RawModule(
                code=code, options=("-std=c++14",), name_expressions=[name]
            )
        found = _FUNCTIONS[key] = module.get_function(name)
        return found


_FUNCTIONS: dict[tuple[str, str, int], Any] = {}


def launch_on(
    stream: Any, name: str, args: tuple[Any, ...], count: int, source: str = _SOURCE
) -> None:
    """Queue kernel `name` over `count` elements on `stream` (a cupy Stream); no waiting."""
    blocks = max(1, min(4096, (count + _THREADS - 1) // _THREADS))
    with stream:
        kernel(name, source)((blocks,), (_THREADS,), args)


def divide_on(stream: Any, ptr: int, count: int, n: int, dtype: str) -> None:
    """Queue `x /= n` on `stream` for `count` elements of `dtype` at device address `ptr`."""
    args = (np.uint64(ptr), np.uint64(count), np.int64(n))
    launch_on(stream, divide_name(dtype), args, count)


def _itemsize(dtype: str) -> int:
    return TABLE[dtype].itemsize


def kernel_op(dtype: str, op: str) -> str:
    """The reduce.cu functor of reduction `op` (sum, prod, min, max) on `dtype`: bool's
    reductions are logical (dtypes.BOOL_REDUCTION)."""
    return _LOGICAL_OPS[BOOL_REDUCTION[op]] if dtype == "bool" else _OPS[op]


def kernel_type(dtype: str) -> str:
    """The reduce.cu template arguments for `dtype`: its C type, or a half's variant."""
    ctype = TABLE[dtype].ctype
    return f"<{int(dtype == 'bfloat16')}" if ctype is None else f"<{ctype}"


def _combine_name(dtype: str, op: str) -> str:
    half = "_half" if dtype in HALVES else ""
    return f"combine{half}{kernel_type(dtype)}, {kernel_op(dtype, op)}>"


def divide_name(dtype: str) -> str:
    """The name of the divide kernel for `dtype` in the compiled module."""
    half = "_half" if dtype in HALVES else ""
    return f"divide{half}{kernel_type(dtype)}>"


def _addr(arr: np.ndarray) -> int:
    return int(arr.__array_interface__["data"][0])
