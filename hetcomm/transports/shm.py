"""Shared-memory segments: slots in a /dev/shm file that the ranks of one host all map."""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
from collections.abc import Callable

import numpy as np


class SegmentError(ConnectionError):
    """A shared segment could not be made, mapped, or gave no slot back in time."""


class SharedSlots:
    """Slots in a shared host segment (a /dev/shm file mapped by two ranks of one host).

    The sending rank creates it; the receiving rank maps it by name. On GPU machines both
    register it with the GPU runtime, so one GPU writes the pages and the other reads them.
    """

    def __init__(self, name: str, slots: int, slot_bytes: int, create: bool) -> None:
        self.name, self.slots, self.slot_bytes = name, slots, slot_bytes
        self.path = os.path.join("/dev/shm", name)
        size = slots * slot_bytes
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:
                try:
                    # reserve the pages now: a full /dev/shm then fails here, with a reason,
                    # instead of killing the process with SIGBUS at the first write
                    os.posix_fallocate(fd, 0, size)
                except OSError as exc:
                    os.close(fd)
                    fd = -1
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self.path)
                    raise SegmentError(
                        f"cannot reserve {size >> 20} MiB in /dev/shm for shared "
                        f"slots ({exc}); free some or set HETCOMM_RAILS"
                    ) from exc
            self._map = mmap.mmap(fd, size)
        finally:
            if fd >= 0:
                os.close(fd)
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        self.ptr = self.array.__array_interface__["data"][0]
        self._registered = False
        self._register_lock = threading.Lock()
        self._free: list[int] = list(range(slots))
        self._cond = threading.Condition()

    def view(self, slot: int, nbytes: int) -> np.ndarray:
        """The first `nbytes` of slot `slot`, as a uint8 array."""
        start = slot * self.slot_bytes
        return self.array[start : start + nbytes]

    def register_with_gpu(self, device_index: int) -> None:
        """Pin and map the pages for the GPU (cudaHostRegister), once, from the context of
        the device that copies through them."""
        if self._registered:  # set only once registered: the lock is for the first call
            return
        with self._register_lock:
            if self._registered:
                return
            from ..kernels import device

            device.host_register(self.ptr, self.slots * self.slot_bytes, device_index)
            self._registered = True

    def acquire(self, deadline: float, alive: Callable[[], bool]) -> int:
        """A free slot; waits until `deadline` while `alive()` says the peer still is."""
        with self._cond:
            while not self._free:
                if time.monotonic() >= deadline or not alive():
                    raise SegmentError(f"no shared slot came back in time ({self.name})")
                self._cond.wait(0.05)
            return self._free.pop()

    def try_acquire(self, count: int) -> list[int]:
        """Up to `count` free slots, taken without waiting."""
        with self._cond:
            return [self._free.pop() for _ in range(min(count, len(self._free)))]

    def release(self, slot: int) -> None:
        """Hand slot `slot` back to the free list."""
        with self._cond:
            self._free.append(slot)
            self._cond.notify()

    def unlink(self) -> None:
        """Remove the /dev/shm name; mappings stay (unlinked once both sides have mapped it)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def close(self) -> None:
        """Unregister from the GPU runtime and unmap."""
        if self._registered:
            from ..kernels import device

            with contextlib.suppress(Exception):
                device.host_unregister(self.ptr)
            self._registered = False
        self.array = np.empty(0, np.uint8)
        with contextlib.suppress(BufferError, ValueError):
            self._map.close()
