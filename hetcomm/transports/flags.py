"""Waiting for a word of shared memory that another rank of the host writes.

Ranks of one host hand each other small messages, completions and barriers through counters in
a shared segment (`shm.SharedSlots`), each counter written by one rank only and read by the
others. A waiter polls its word on its own thread: first yielding the core between reads
(`sched_yield`, about 0.5 us, which returns at once where no other thread waits for the
core), then by naps that grow to 1 ms (one nap costs 55 us or more through a VM's timer
slack), so that a long wait holds no core. It does not spin first: where a host runs more
ranks than it has cores (4 ranks on the 2-core CPU VM) the writer may need this very core,
and 64 reads before the first yield (each a Python call of a microsecond or two) made a staged
8-byte one-way message 109 us against 42 us yielding at once; on 2 ranks the two were alike
(14-15 us; 2026-12-01, `hetcomm bench --latency --transport staged --op sendrecv`). MPI does
the same for oversubscribed ranks (Open MPI's yield-when-idle).
A nap may end early where the writer can say it wrote (`wait`'s `sleep`: a staged ring's wake
pipe, `EagerIn.doze`).

A reader may trust the data written before a counter once it sees the counter only where the
CPU makes stores visible in program order (x86-64's total store order) and the writer's
interpreter makes the stores in that order (numpy copies return before the next statement).
`unsupported()` says why a machine is not such a one; callers then take their MPI path.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable

YIELD_SECONDS = 2e-3  # yielding between reads this long, then napping
NAP_MAX = 1e-3  # the longest nap
CHECK_SECONDS = 0.05  # how often `check` runs while napping

_ORDERED = ("x86_64", "amd64", "i686", "i386")


def unsupported() -> str | None:
    """Why counters in shared memory cannot order this host's messages, or None."""
    machine = platform.machine().lower()
    if machine in _ORDERED:
        return None
    return f"{machine or 'this CPU'} may reorder stores (flags need x86-64's store order)"


def wait(
    ready: Callable[[], bool],
    deadline: float,
    check: Callable[[], None] | None = None,
    yield_s: float = YIELD_SECONDS,
    sleep: Callable[[float], object] = time.sleep,
) -> bool:
    """True once `ready()` holds; False when `time.monotonic()` passes `deadline` first.

    `check` (it may raise, e.g. when the writer's process has died) runs every
    CHECK_SECONDS once the wait has gone on past its yielding; `yield_s`: how long it yields
    before it naps (longer where the writer is known to take longer); `sleep(seconds)`: a
    nap, which may end early when the writer says it wrote (staged's rings: `EagerIn.doze`).
    """
    if ready():
        return True
    now = time.monotonic()
    yield_until = min(deadline, now + yield_s)
    while now < yield_until:
        os.sched_yield()
        if ready():
            return True
        now = time.monotonic()
    nap = 2e-5
    next_check = now + CHECK_SECONDS
    while now < deadline:
        sleep(min(nap, deadline - now))
        if ready():
            return True
        nap = min(nap * 2, NAP_MAX)
        now = time.monotonic()
        if check is not None and now >= next_check:
            check()
            next_check = now + CHECK_SECONDS
    return ready()
