"""NCCL communicators that hetcomm made are ended only by close() or, left over, by an abort
at exit (hetcomm.transports.nccl): never by the garbage collector, whose ncclCommDestroy would
wait for the other ranks at a moment of its own choosing. Driven on the CPU with a stand-in
for CuPy's NcclCommunicator."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from typing import ClassVar

import pytest

from hetcomm.transports import nccl


class StandIn:
    """Records how it ended; its finalizer stands for CuPy's, which destroys the communicator."""

    ended: ClassVar[list[str]] = []

    def __init__(self, abort_blocks: bool = False) -> None:
        self.abort_blocks = abort_blocks
        self.how: str | None = None

    def destroy(self) -> None:
        self.how = "destroy"

    def abort(self) -> None:
        if self.abort_blocks:
            threading.Event().wait()  # an abort waiting for ranks that are gone
        self.how = "abort"

    def __del__(self) -> None:
        StandIn.ended.append(self.how or "collected")


@pytest.fixture(autouse=True)
def _empty_registry():
    saved = dict(nccl._LIVE)
    nccl._LIVE.clear()
    StandIn.ended = []
    yield
    nccl._LIVE.clear()
    nccl._LIVE.update(saved)


def test_a_dropped_communicator_is_kept_from_the_collector() -> None:
    ref = weakref.ref(nccl._keep(StandIn()))
    gc.collect()
    assert ref() is not None and StandIn.ended == []
    assert nccl.abort_left_over(limit=5) == 1
    assert ref() is None and StandIn.ended == ["abort"] and not nccl._LIVE


def test_close_ends_and_forgets() -> None:
    c = nccl._keep(StandIn())
    nccl._end(c, abort=False)
    assert c.how == "destroy" and not nccl._LIVE
    assert nccl.abort_left_over(limit=5) == 0


def test_an_abort_that_waits_is_bounded_and_never_freed() -> None:
    ref = weakref.ref(nccl._keep(StandIn(abort_blocks=True)))
    t0 = time.monotonic()
    assert nccl.abort_left_over(limit=0.2) == 1
    assert time.monotonic() - t0 < 3
    nccl._LIVE.clear()
    gc.collect()
    assert ref() is not None and StandIn.ended == []  # its abort never returned: not freed
