"""Large host messages between ranks of one host, in one copy: the receiver reads the sender's
array from its memory (PULL markers, eager.py; the read, cma.py).

A message larger than a ring slot, from a host array, to a rank that can read this one's
memory: the sender publishes a PULL marker (its array's address and size) in the pair's ring
and waits until the receiver frees it; the receive that takes the marker reads the bytes
straight into its own array, writes the count it took and frees the slot. No clear-to-send,
no rail, no thread: both ends run on their calling threads, and the wait of each is a wait on
one word of shared memory. Open MPI's shared-memory transport moves such messages the same
way (its single-copy CMA path).

A receive posted without anyone waiting on it (asynchronous) must still take its marker, or
a sender blocked on it could wait for ever on a rank that blocks somewhere else meanwhile (a
ring of ranks that each post an asynchronous receive, then send): the transport's `Watcher`
thread looks at the rings with such receives until they have landed, as MPI's progress would
in any call.
"""

from __future__ import annotations

import errno
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import CommTimeout, HetcommError, MismatchError, PeerLost
from ...work import Work
from .. import flags
from .eager import NOT_READ, EagerOut, Found, Posted

if TYPE_CHECKING:
    from ..local import Region
    from .channel import Channel
    from .transport import StagedTransport

log = logging.getLogger("hetcomm")

# the copy rate a sender's wait expects of the receiver's read, for how long it yields the
# core between looks before it naps (flags.wait): a 16 MiB read takes 1.2-1.4 ms on the CPU VM
READ_RATE = 2e9
YIELD_MAX_S = 0.02
# the Watcher: how old a receive nobody waits on is before it lands it, and how long it stays
# awake (looking every GRACE_S) after its last receive
GRACE_S = 1e-3
WARM_S = 0.05
# and how often it lands what has come for any posted receive, small ones included, which
# only a thread that polls a receive from the same peer lands otherwise
SWEEP_S = 0.02


def lends(out: EagerOut | None, region: Region) -> bool:
    """Whether a message larger than a slot goes as a PULL marker: a host array, to a
    receiver that can read this process's memory."""
    return out is not None and region.host is not None and out.readable


def yield_for(nbytes: int) -> float:
    """How long a wait for the receiver's read of `nbytes` yields before it naps (at most
    YIELD_MAX_S: a longer wait naps rather than hold a core)."""
    return max(flags.YIELD_SECONDS, min(2 * nbytes / READ_RATE, YIELD_MAX_S))


def never_received(peer: int, tag: int, k: int) -> str:
    """Why a lent message timed out: its receiver never took its marker."""
    return f"rank {peer} never posted the matching receive of the message (tag {tag}, its #{k})"


def withdrawn(peer: int, when: str) -> HetcommError:
    """The error of a receive whose PULL message its sender withdrew (its send failed)."""
    return HetcommError(f"rank {peer} withdrew its message {when} (its send failed)")


def lent_back(out: EagerOut, slot: int, pub: int, nbytes: int, rank: int, peer: int) -> bool:
    """True once the receiver has freed the PULL message `pub` of `slot` (the slot is then
    released); raises what the receiver found: MismatchError where its receive takes another
    size, HetcommError where it could not read the message."""
    taken = out.collect(slot, pub)
    if taken is None:
        return False
    if taken == nbytes:
        return True
    if taken == NOT_READ:
        raise HetcommError(f"rank {peer} could not read this rank's message from its memory")
    raise MismatchError(f"rank {rank} sends {nbytes} bytes, rank {peer} receives {taken}")


def give_up(out: EagerOut, slot: int, pub: int, nbytes: int, rank: int, peer: int) -> bool:
    """Withdraw a PULL message whose send fails (its array may change once this returns);
    True where the receiver had taken it whole after all (the send succeeded)."""
    out.withdraw(slot, pub)
    if out.returned(slot, pub):
        return lent_back(out, slot, pub, nbytes, rank, peer)
    out.release(slot)
    return False


def wait_lent(
    out: EagerOut,
    slot: int,
    pub: int,
    nbytes: int,
    rank: int,
    peer: int,
    deadline: float,
    check: Callable[[], None],
) -> bool:
    """Wait on this thread until the receiver has read the PULL message (True), or until
    `deadline` (False: withdrawn). `check` as flags.wait's; where it raises, the message is
    withdrawn first."""
    try:
        done = flags.wait(lambda: out.returned(slot, pub), deadline, check, yield_for(nbytes))
    except BaseException:
        if not give_up(out, slot, pub, nbytes, rank, peer):
            raise
        return True
    if done:
        return lent_back(out, slot, pub, nbytes, rank, peer)
    return give_up(out, slot, pub, nbytes, rank, peer)


def read_into(t: StagedTransport, ch: Channel, found: Found, region: Region, ready: Any) -> int:
    """Read the PULL message `found` of `ch`'s ring into `region` (sizes equal); the STATUS
    to free it with. Device regions: read into host memory, then copied up after `ready`."""
    inbox, peer, n = ch.eager_in, ch.peer, found.nbytes
    assert inbox is not None
    if region.host is not None:
        dst = region.host
    else:
        dst = np.empty(n, np.uint8)
    try:
        whole = inbox.pull(found, dst.ctypes.data) if n else True
    except OSError as exc:
        if exc.errno == errno.ESRCH:
            raise PeerLost(f"rank {peer}: its process is gone ({exc})", [peer]) from None
        raise HetcommError(f"reading the message of rank {peer}: {exc}") from None
    if not whole:
        raise withdrawn(peer, "while this receive read it")
    if region.host is None and n:
        t.gpu.copy_from_host(region, dst, ready)
    t.paths["recv pull"] += 1
    return n


def send_work(
    t: StagedTransport,
    ch: Channel,
    slot: int,
    pub: int,
    region: Region,
    tag: int,
    k: int,
    seq: int,
    deadline: float,
) -> Work:
    """The Work of asynchronous send `k` of `tag`, lent as a PULL message of `region`: done
    when the receiver has read it (its waiter waits on the slot's word); CommTimeout naming
    the receiver at `deadline`, the message withdrawn then. The Work holds `region`, so the
    array the receiver reads lives until then, whatever the caller keeps."""
    out = ch.eager_out
    assert out is not None
    peer, nbytes = ch.peer, region.nbytes

    def poll() -> bool:
        if lent_back(out, slot, pub, nbytes, t.rank, peer):
            return True
        if time.monotonic() < deadline and not t.closed:
            return False
        if give_up(out, slot, pub, nbytes, t.rank, peer):
            return True
        if t.closed:
            raise HetcommError("the staged transport was closed")
        raise CommTimeout(t.comm.name, "send", seq, t.timeout, [peer], never_received(peer, tag, k))

    work = Work(
        t.comm,
        "send",
        seq,
        poll,
        waiter=lambda seconds: flags.wait(
            lambda: out.returned(slot, pub), time.monotonic() + seconds, None, yield_for(nbytes)
        ),
    )
    work.info = {"transport": "staged", "bytes": nbytes, "stages": 1}
    work._keep = (region,)  # the array the receiver reads, until it has
    return work


class Watcher:
    """The thread that lands posted receives of large messages while nobody waits on them
    (`watch`), started on first use.

    A receive is its to land once it is GRACE_S old and no thread waits on it (a waiting thread
    looks at the ring itself, and a second thread looking beside it only takes the interpreter
    from it). For WARM_S after a receive is posted it stays awake, looking every GRACE_S, so
    that the next receive need not wake it: waking it at every receive cost a non-blocking
    1 MiB receive that was then waited on ~20 us (CPU VM, 2 ranks: 127 us one way against 101
    us blocking, 108 us unwoken).

    Every SWEEP_S, while it runs (`start`: the first receive posted on a ring that was not
    there yet starts it), it also lands whatever has come for any posted receive. A ring's
    messages are otherwise landed only by a thread that polls or waits on a receive from the
    same peer; a rank whose threads all wait on something else (a receive from another peer,
    a send waiting for a slot in a third rank's ring) would leave the ring full, and its
    sender, waiting for a slot, may be what the others wait on: 4 ranks that posted every
    send and receive asynchronously and then waited in another order stalled so (2026-12-06).
    MPI's progress rule asks the same of any wait.
    """

    def __init__(self, t: StagedTransport, progress: Callable[[Channel], None]) -> None:
        self._t, self._progress = t, progress
        self._lock = threading.Lock()
        self._posted: list[tuple[Channel, Posted, float]] = []  # (channel, receive, when)
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._posted_at = 0.0  # when the latest receive was posted
        self._awake = False  # it looks again within GRACE_S, unwoken (else it sleeps)

    def watch(self, ch: Channel, rec: Posted) -> None:
        """Land `rec` (posted on `ch`'s ring) once its marker is there, unless a thread
        waiting on it does first."""
        now = time.monotonic()
        with self._lock:
            self._posted.append((ch, rec, now))
            self._posted_at = now
            self._start()
            awake = self._awake
        if not awake:
            self._wake.set()

    def start(self) -> None:
        """Have the thread run (it sweeps every posted receive from then on)."""
        if self._thread is None:
            with self._lock:
                self._start()

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, daemon=True, name=f"hetcomm-watch-{self._t.rank}"
            )
            self._thread.start()

    def resume(self) -> None:
        """A wait on a watched receive ended before the receive did: look at it now."""
        self._wake.set()

    def stop(self) -> None:
        """End the thread (the transport has closed)."""
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def _run(self) -> None:
        t = self._t
        next_sweep = time.monotonic() + SWEEP_S
        while not t.closed:
            self._wake.clear()  # before looking: a receive posted after the look wakes it
            now = time.monotonic()
            if now >= next_sweep:
                self._sweep()
                next_sweep = now + SWEEP_S
            with self._lock:
                self._posted = [p for p in self._posted if not p[1].done]
                posted = [
                    (ch, rec)
                    for ch, rec, when in self._posted
                    if not rec.waited and now - when >= GRACE_S
                ]
                self._awake = awake = now < self._posted_at + WARM_S
            if not posted:
                self._wake.wait(GRACE_S if awake else SWEEP_S)
                continue
            channels = list({id(ch): ch for ch, _ in posted}.values())
            try:
                look = functools.partial(self._look, channels, posted)
                # one ring watched (the common case): its naps wake when the peer publishes
                inbox = channels[0].eager_in if len(channels) == 1 else None
                sleep = inbox.doze if inbox is not None else time.sleep
                flags.wait(look, time.monotonic() + flags.CHECK_SECONDS, sleep=sleep)
            except Exception:
                # landing fails a receive by its `error`, so this is a fault of the look
                # itself: logged, and looked at again later rather than not at all
                log.exception("staged: the watcher's look at the rings failed")
                time.sleep(flags.CHECK_SECONDS)

    def _sweep(self) -> None:
        """Land what has come for the posted receives of every ring."""
        try:
            for ch in list(self._t._channels.values()):
                if ch.eager_in is not None and ch.eager_in.posted:
                    self._progress(ch)
        except Exception:
            log.exception("staged: the watcher's sweep of the rings failed")

    def _look(self, channels: list[Channel], posted: list[tuple[Channel, Posted]]) -> bool:
        """Land what has come for the posted receives of `channels`; True once one of
        `posted` has landed or is waited on, a receive was added, or the transport closed.
        Looked at before the rings too: a thread whose wait on one of them paused between
        two slices of Work.wait (waking this thread) is waiting again by the time this
        thread wakes, and lands its own receive."""
        if self._over(posted):
            return True
        for ch in channels:
            self._progress(ch)
        return self._over(posted)

    def _over(self, posted: list[tuple[Channel, Posted]]) -> bool:
        return (
            self._t.closed
            or self._wake.is_set()
            or any(rec.done or rec.waited for _, rec in posted)
        )
