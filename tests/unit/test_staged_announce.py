"""Who announces a chunk staged into a shared slot (Channel.announce_soon): the thread at
hand when the chunk's copy has ended or is short, else the channel's signaller thread. Driven on
the CPU with stand-in events and links."""

from __future__ import annotations

import queue

import pytest

from hetcomm.transports.local import Region
from hetcomm.transports.staged import links
from hetcomm.transports.staged.channel import Channel
from hetcomm.transports.staged.ops import _Op
from hetcomm.transports.staged.rails import INLINE_COPY_BYTES

CHUNK = 8 << 20  # longer than INLINE_COPY_BYTES: never waited for inline for its size alone


class Event:
    def __init__(self, done: bool) -> None:
        self.done, self.waits = done, 0

    def synchronize(self) -> None:
        assert self.done, "waited for a copy that has not ended, on the announcing thread"
        self.waits += 1


class Link:
    def __init__(self) -> None:
        self.sent: list[tuple[int, ...]] = []

    def send(self, *fields: int) -> None:
        self.sent.append(fields)


class FakeChannel(Channel):
    """A channel with no rails and no board: only its signaller's queue, which nothing
    serves."""

    def __init__(self) -> None:
        self.signaller: queue.Queue = queue.Queue()
        self.board_out = None

    def signals(self) -> queue.Queue:
        return self.signaller


def _setup(nbytes: int, ready: object = None) -> tuple[FakeChannel, FakeChannel, Link, _Op]:
    ch = FakeChannel()
    op = _Op(
        1,
        Region(2 * nbytes, None, 0x1000),
        [(0, nbytes), (nbytes, nbytes)],
        remote=7,
        ready=ready,
        left=2,
    )
    return ch, ch, Link(), op


def test_ended_copy_is_announced_at_once() -> None:
    rails, ch, link, op = _setup(CHUNK)
    event = Event(done=True)
    rails.announce_soon(event, link, 3, op, 1, CHUNK, CHUNK)
    assert link.sent == [(links.SLOT, 3, 7, 1, CHUNK, CHUNK)]
    assert ch.signaller.empty()
    assert op.left == 1 and op.seen == {1}


def test_running_long_copy_goes_to_the_signaller() -> None:
    rails, ch, link, op = _setup(CHUNK)
    event = Event(done=False)
    rails.announce_soon(event, link, 3, op, 0, 0, CHUNK)
    assert link.sent == [] and op.left == 2
    assert ch.signaller.get_nowait() == (event, link, 3, op, 0, 0, CHUNK)


def test_host_bytes_are_announced_at_once() -> None:
    rails, ch, link, op = _setup(CHUNK)
    rails.announce_soon(None, link, 0, op, 0, 0, CHUNK)
    assert link.sent == [(links.SLOT, 0, 7, 0, 0, CHUNK)] and ch.signaller.empty()


class ShortCopy(Event):
    """A short copy still running when asked, ended once waited for."""

    def synchronize(self) -> None:
        self.done = True
        self.waits += 1


@pytest.mark.parametrize("caller_done", [True, False])
def test_short_copy_waits_here_only_when_the_callers_work_is_done(caller_done: bool) -> None:
    """A short copy is waited for here (a few microseconds) unless it waits for the caller's
    queued work, which could take long."""
    n = INLINE_COPY_BYTES
    rails, ch, link, op = _setup(n, ready=Event(done=caller_done))
    event = ShortCopy(done=False)
    rails.announce_soon(event, link, 2, op, 0, 0, n)
    if caller_done:
        assert link.sent == [(links.SLOT, 2, 7, 0, 0, n)] and event.waits == 1
    else:
        assert link.sent == [] and ch.signaller.get_nowait()[0] is event
