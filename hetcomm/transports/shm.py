"""Shared-memory segments: slots in a /dev/shm file that the ranks of one host all map."""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
from collections.abc import Callable
from typing import Protocol

import numpy as np


class SegmentError(ConnectionError):
    """A shared segment could not be made, mapped, or gave no slot back in time."""


class Reaper(Protocol):
    """What hands back a segment's slots through its words (board.BoardOut)."""

    def reap(self) -> list[int]:
        """The slots handed back since the last call, each given once."""
        ...

    def out(self) -> bool:
        """Whether any slot is out to be handed back so."""
        ...


class SharedSlots:
    """Slots in a shared host segment (a /dev/shm file mapped by two ranks of one host).

    The sending rank creates it; the receiving rank maps it by name. On GPU machines both
    register it with the GPU runtime, so one GPU writes the pages and the other reads them.
    `words` int64 words follow the slots (a staged rail's board, board.py), as `words`.

    Where the peer hands slots back through those words, `reaper` (set by their owner) gives
    the slots handed back since it last ran; taking a slot asks it first.
    """

    def __init__(
        self, name: str, slots: int, slot_bytes: int, create: bool, words: int = 0
    ) -> None:
        self.name, self.slots, self.slot_bytes = name, slots, slot_bytes
        self.path = os.path.join("/dev/shm", name)
        # the words start on a page of their own, mapped apart: a Board that still holds them
        # after close keeps that page, not the slots, from being unmapped
        at = -(-slots * slot_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
        size = at + 8 * words if words else slots * slot_bytes
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
            self._words_map = mmap.mmap(fd, 8 * words, offset=at) if words else None
        finally:
            if fd >= 0:
                os.close(fd)
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        self.ptr = self.array.__array_interface__["data"][0]
        # one read or write of a Python int per word (a numpy element costs a microsecond)
        self.words = memoryview(self._words_map).cast("q") if self._words_map else None
        self._registered = False
        self._register_lock = threading.Lock()
        self._free: list[int] = list(range(slots))
        self._cond = threading.Condition()
        self.reaper: Reaper | None = None

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
        """A free slot; waits until `deadline` while `alive()` says the peer still is. Slots
        handed back through the words wake no one: while any is out, the wait looks again
        every millisecond."""
        with self._cond:
            self._reap()
            while not self._free:
                if time.monotonic() >= deadline or not alive():
                    raise SegmentError(f"no shared slot came back in time ({self.name})")
                reaper = self.reaper
                self._cond.wait(1e-3 if reaper is not None and reaper.out() else 0.05)
                self._reap()
            return self._free.pop()

    def try_acquire(self, count: int) -> list[int]:
        """Up to `count` free slots, taken without waiting."""
        with self._cond:
            if len(self._free) < count:
                self._reap()
            return [self._free.pop() for _ in range(min(count, len(self._free)))]

    def free_count(self) -> int:
        """How many slots are free now (those handed back through the words included)."""
        with self._cond:
            self._reap()
            return len(self._free)

    def reap(self) -> None:
        """Take back the slots handed back through the words, and wake a waiting taker."""
        with self._cond:
            if self._reap():
                self._cond.notify_all()

    def _reap(self) -> bool:
        if self.reaper is None:
            return False
        back = self.reaper.reap()
        self._free.extend(back)
        return bool(back)

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
        self.words = None
        if self._words_map is not None:
            with contextlib.suppress(BufferError, ValueError):
                self._words_map.close()  # held by a board still (board.detach): when it goes
        with contextlib.suppress(BufferError, ValueError):
            self._map.close()
