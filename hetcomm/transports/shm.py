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

    # After the slots, one page (or more) of 32-bit flags, each on a 64-byte line of its own:
    # READY[s] counts the sender's device copies into slot s that have ended, FREE[s] the
    # receiver's device copies out of it; the GPUs write and wait for them (staged_rails).
    READY, FREE = 0, 1
    FLAG_STRIDE = 64

    def __init__(self, name: str, slots: int, slot_bytes: int, create: bool) -> None:
        self.name, self.slots, self.slot_bytes = name, slots, slot_bytes
        self.path = os.path.join("/dev/shm", name)
        self.flag_base = slots * slot_bytes
        flag_bytes = -(-2 * slots * self.FLAG_STRIDE // 4096) * 4096
        size = self.size = self.flag_base + flag_bytes
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
        self.flags = np.frombuffer(
            self._map, dtype=np.uint32, count=flag_bytes // 4, offset=self.flag_base
        )
        self._registered = False
        self.dev_ptr = 0  # the segment's device address, once registered
        self._register_lock = threading.Lock()
        self._free: list[int] = list(range(slots))
        self._cond = threading.Condition()

    def view(self, slot: int, nbytes: int) -> np.ndarray:
        start = slot * self.slot_bytes
        return self.array[start : start + nbytes]

    def register_with_gpu(self, device_index: int) -> None:
        """Pin and map the pages for the GPU (cudaHostRegister), once, from the context of
        the device that copies through them."""
        with self._register_lock:
            if self._registered:
                return
            from ...kernels import device

            device.host_register(self.ptr, self.size, device_index)
            flags = device.stream_flags()
            self.dev_ptr = flags.device_pointer(self.ptr) if flags is not None else self.ptr
            self._registered = True

    def flag_address(self, which: int, slot: int) -> int:
        """Device address of flag READY or FREE of `slot` (after register_with_gpu)."""
        return self.dev_ptr + self.flag_offset(which, slot)

    def flag_offset(self, which: int, slot: int) -> int:
        """Byte offset from `ptr` of flag READY or FREE of `slot`."""
        return self.flag_base + (which * self.slots + slot) * self.FLAG_STRIDE

    def flag(self, which: int, slot: int) -> int:
        """The current value of a flag, read from the shared page."""
        return int(self.flags[(which * self.slots + slot) * self.FLAG_STRIDE // 4])

    def wait_flag(
        self, which: int, slot: int, value: int, deadline: float, alive: Callable[[], bool]
    ) -> None:
        """Wait on this thread until flag READY or FREE of `slot` reaches `value` (a device
        copy queued by either rank has ended); RailError past `deadline` or once not alive()."""
        while self.flag(which, slot) < value:
            if time.monotonic() > deadline or not alive():
                raise SegmentError(
                    f"{('READY', 'FREE')[which]} flag of shared slot {slot} of "
                    f"{self.name} never reached {value}"
                )
            time.sleep(20e-6)

    def release_waits(self) -> None:
        """Set every flag to its largest value, so that no stream of either rank waits on this
        segment any longer (its channel is failing or closing: what follows is not used)."""
        self.flags[:] = 0xFFFFFFFF

    def acquire(self, deadline: float, alive: Callable[[], bool]) -> int:
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
        with self._cond:
            self._free.append(slot)
            self._cond.notify()

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def close(self) -> None:
        if self._registered:
            from ...kernels import device

            with contextlib.suppress(Exception):
                device.host_unregister(self.ptr)
            self._registered = False
        self.array = np.empty(0, np.uint8)
        self.flags = np.empty(0, np.uint32)
        with contextlib.suppress(BufferError, ValueError):
            self._map.close()
