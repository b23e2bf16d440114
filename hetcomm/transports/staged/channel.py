"""A staged channel: everything joining this rank to one peer. Its rails' links and their
threads, the shm rail's shared slots (and the ones its sends hold early), the queues of its
signaller and completer threads. StagedTransport (staged.py) opens and closes them."""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..shm import SharedSlots
from . import links
from .ops import _STOP, _Op
from .schedule import rail_key, rail_windows

if TYPE_CHECKING:
    from .transport import StagedTransport

SHM_LANES = 2  # threads feeding one shm rail, so that one stages while the other signals


class Channel:
    """The rails to one peer, their threads and the shm rail's shared slots."""

    def __init__(self, owner: StagedTransport, peer: int, specs: list[links.RailSpec]) -> None:
        self.owner, self.peer, self.specs = owner, peer, specs
        self.queue: queue.Queue[Any] = queue.Queue()
        self.links: list[links.Link] = []
        self.shm_out: SharedSlots | None = None
        self.shm_in: SharedSlots | None = None
        self.threads: list[threading.Thread] = []
        self.dead: list[str] = []
        self.uses_mpi = any(s.kind == "mpi" for s in specs)
        # tcp rail index -> chunks it may hold unacknowledged (tuned rail weights), else no limit
        keys = [rail_key(s) for s in specs]
        self.windows = {
            s.index: w
            for s, w in zip(specs, rail_windows(keys, owner.rail_weights))
            if w is not None and s.kind == "tcp"
        }
        self._signals: queue.Queue[Any] | None = None
        self._completions: queue.Queue[Any] | None = None
        self._lock = threading.Lock()  # the two queues' creation, and `early`
        self.early = 0  # shared slots held by sends still waiting for their clear-to-send

    def start(self) -> None:
        """Start a sender thread per lane and a receiver per link (and the mpi rail's sender)."""
        for link in self.links:
            lanes = SHM_LANES if link.spec.kind == "shm" else 1
            for _ in range(lanes):
                self._thread(self.owner._send_loop, self, link)
            self._thread(self.owner._recv_loop, self, link)
        if self.uses_mpi:
            self._thread(self.owner._send_loop, self, None)
            self.owner._start_mpi_rail()

    def _thread(self, fn: Callable[..., None], *args: Any) -> None:
        t = threading.Thread(
            target=fn, args=args, daemon=True, name=f"hetcomm-rail-{self.owner.rank}-{self.peer}"
        )
        t.start()
        self.threads.append(t)

    def alive(self) -> bool:
        """Whether any rail to the peer still works."""
        return self.uses_mpi or any(link.alive for link in self.links)

    def signals(self) -> queue.Queue[Any]:
        """The queue of the signaller thread (device chunks going out over shm: each announced
        once its copy into a slot has finished), started once."""
        with self._lock:
            if self._signals is None:
                self._signals = queue.Queue()
                self._thread(self.owner._serve, self._signals, self.owner._announce)
            return self._signals

    def completions(self) -> queue.Queue[Any]:
        """The queue of the completer thread (device chunks coming in over shm: each slot handed
        back once its copy out has finished), started once."""
        with self._lock:
            if self._completions is None:
                self._completions = queue.Queue()
                self._thread(self.owner._serve, self._completions, self.owner._hand_back)
            return self._completions

    # ---- early chunks: slots a send fills before its clear-to-send comes ---------------------

    def hold_early(self, wanted: int) -> list[int]:
        """Up to `wanted` free shared slots, taken without waiting, for a send's early chunks;
        none once the sends that wait for their clear-to-send hold half the slots, so the sends
        already cleared always have the other half to go on with."""
        assert self.shm_out is not None
        with self._lock:
            room = min(wanted, self.shm_out.slots // 2 - self.early)
            slots = self.shm_out.try_acquire(room) if room > 0 else []
            self.early += len(slots)
        return slots

    def take_early(self, op: _Op) -> list[tuple[int, Any, tuple[int, int]]]:
        """The early chunks of `op`, taken (by whoever gets them first) and no longer counted
        against the channel's half of the slots."""
        with self._lock:
            early, op.early = op.early, []
            self.early -= len(early)
        return early

    def drop_early(self, op: _Op) -> None:
        """Give back the slots of a send's early chunks that never went (their copies end
        first)."""
        assert self.shm_out is not None
        for slot, event, _ in self.take_early(op):
            if event is not None:
                with contextlib.suppress(Exception):
                    event.synchronize()
            self.shm_out.release(slot)

    # ---- the end ---------------------------------------------------------------------------

    def stop(self) -> None:
        """Tell the channel's threads to end."""
        self.queue.put(_STOP)
        for q in (self._signals, self._completions):
            if q is not None:
                q.put(_STOP)

    def release(self) -> None:
        """Close the links and the shared segments, unlinking their names (once both ranks have
        mapped a segment its name is gone already)."""
        for link in self.links:
            link.close()
        for seg in (self.shm_out, self.shm_in):
            if seg is not None:
                seg.unlink()
                seg.close()

    def describe(self) -> str:
        """The channel's rails, for logs and errors."""
        return ", ".join(str(s) for s in self.specs)
