"""The shared segment of one host's collectives (hetcomm.transports.hostcoll), on one process:
which groups may have one, turns in ticket order, and a segment that cannot be had (a full
/dev/shm)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from test_topology import rank_info

from hetcomm.ops import ReduceOp
from hetcomm.topology import Topology
from hetcomm.transports import flags, hostcoll, hostseg, shm


def test_only_groups_of_one_host_and_node_have_a_segment():
    if flags.unsupported() is not None:
        assert hostcoll.unavailable(Topology([rank_info(0, "a", "cpu")])) == flags.unsupported()
        return
    one = Topology([rank_info(0, "a", "cpu"), rank_info(1, "a", "cpu")])
    assert hostcoll.unavailable(one) is None
    two_hosts = Topology([rank_info(0, "a", "cpu"), rank_info(1, "b", "cpu")])
    assert "more than one host" in (hostcoll.unavailable(two_hosts) or "")
    two_nodes = Topology([rank_info(0, "a", "cpu"), rank_info(1, "a", "cpu", node=1)])
    assert "more than one host" in (hostcoll.unavailable(two_nodes) or "")
    assert "one rank" in (hostcoll.unavailable(Topology([rank_info(0, "a", "cpu")])) or "")


def _solo() -> hostcoll.HostGroup:
    from mpi4py import MPI

    return hostcoll.HostGroup(0, 1, MPI.COMM_SELF, 15)


def test_turns_run_in_ticket_order_whatever_thread_comes_first():
    """Turns taken by threads in any order run in ticket order, each woken when the one
    before it ends; a turn whose predecessor never ends fails at its deadline."""
    group = _solo()
    first, second, third = group.ticket(), group.ticket(), group.ticket()
    ran: list[int] = []
    deadline = time.monotonic() + 30
    threads = [
        threading.Thread(target=group.run, args=(ticket, deadline, 64, ran.append, ticket))
        for ticket in (third, second)
    ]
    for thread in threads:
        thread.start()
    time.sleep(0.05)
    assert ran == []  # the later turns wait for the first
    assert group.run(first, deadline, 64, ran.append, first)
    for thread in threads:
        thread.join(10)
    assert ran == [first, second, third]
    group.ticket()  # a turn drawn and never run
    stuck = group.ticket()
    t0 = time.monotonic()
    with pytest.raises(hostcoll.Late, match="earlier operation"):
        group.run(stuck, time.monotonic() + 0.2, 64, ran.append, stuck)
    assert 0.15 < time.monotonic() - t0 < 5 and ran == [first, second, third]
    group.close()


def test_a_segment_that_cannot_be_had_sends_larger_operations_elsewhere(monkeypatch):
    """Rank 0 cannot reserve the memory: the operation is declined with nothing moved, and
    operations larger than the segment it has are declined from then on, without asking."""
    group = _solo()
    x = np.arange(16, dtype=np.float32).view(np.uint8)
    out = np.zeros_like(x)

    def run(nbytes: int) -> bool:
        deadline = time.monotonic() + 30
        fn = group.all_reduce
        return group.run(
            group.ticket(), deadline, nbytes, fn, x, out, 64, "float32", ReduceOp.SUM, deadline
        )

    assert run(64) and np.array_equal(out, x)  # a first segment
    made = group.capacity

    def full(*args, **kwargs):
        raise shm.SegmentError("cannot reserve 4 MiB in /dev/shm (No space left on device)")

    monkeypatch.setattr(hostseg, "SharedSlots", full)
    out[:] = 0
    assert not run(made + 1) and not out.any()
    assert group.limit == made
    monkeypatch.undo()
    assert not run(made + 1)  # not retried: every rank declines alike
    assert run(64) and np.array_equal(out, x)  # the segment it has still serves
    group.close()
