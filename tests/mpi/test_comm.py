"""The communicator itself: barrier, split, dup, close, async Work, timeouts, debug mode and
simulated vendors and hosts."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from _data import compare

import hetcomm
from hetcomm import ReduceOp


def world_sum(comm, values):
    """sum over the ranks of `values(rank)`, computed locally."""
    return sum(values(r) for r in range(comm.size))


# ---- barrier ----------------------------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
def test_barrier_waits_for_every_rank(comm, errors):
    """No rank leaves the barrier before the last one (rank 0, late by 0.2 s) entered it."""
    if comm.rank == 0:
        time.sleep(0.2)
    entered = time.time()
    comm.barrier()
    left = time.time()
    work = comm.barrier(async_op=True, timeout=30)
    errors.expect(isinstance(work, hetcomm.Work), f"async barrier returned {work!r}")
    work.wait()
    times = comm.mpi.allgather((entered, left))
    last_in = max(t[0] for t in times)
    first_out = min(t[1] for t in times)
    errors.expect(first_out >= last_in, f"a rank left at {first_out} before {last_in}")
    errors.verify()


# ---- split and dup ----------------------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
def test_split_by_parity_ordered_by_key(comm, errors):
    color = comm.rank % 2
    sub = comm.split(color, key=-comm.rank)  # reversed order inside each half
    try:
        members = sorted((r for r in range(comm.size) if r % 2 == color), reverse=True)
        got = sub.mpi.allgather(comm.rank)
        errors.expect(got == members, f"members {got}, expected {members}")
        errors.expect(
            sub.size == len(members) and sub.rank == members.index(comm.rank),
            f"rank {sub.rank} of {sub.size}",
        )
        errors.expect(sub.name == f"{comm.name}.{color}", f"default name {sub.name!r}")
        errors.expect(
            [t.world_rank for t in sub.topology] == members,
            f"topology world ranks {[t.world_rank for t in sub.topology]}",
        )
        x = np.array([comm.rank, 1], dtype=np.int64)
        sub.all_reduce(x)
        errors += compare(x, np.array([sum(members), len(members)]), "all_reduce on the split")
    finally:
        sub.close()
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_split_leaves_out_none_and_negative_colors(comm, errors):
    """color None or negative: the rank gets None; the others form the group (named)."""
    color = None if comm.rank == 0 else (-1 if comm.rank == 1 else 7)
    sub = comm.split(color, name="rest")
    if comm.rank in (0, 1):
        errors.expect(sub is None, f"rank {comm.rank} got {sub!r}")
    else:
        assert sub is not None
        errors.expect(
            sub.name == "rest" and sub.size == comm.size - 2, f"{sub.name!r} of size {sub.size}"
        )
        x = np.ones(2, dtype=np.int32)
        sub.all_reduce(x)
        errors.expect((x == comm.size - 2).all(), f"sum of ones {x}")
        sub.close()
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_dup_has_same_members_and_name(comm, errors):
    twin = comm.dup()
    named = comm.dup(name="other")
    try:
        errors.expect(
            (twin.rank, twin.size, twin.name) == (comm.rank, comm.size, comm.name),
            f"dup is {twin!r}",
        )
        errors.expect(named.name == "other", f"named dup is {named.name!r}")
        x = np.array([comm.rank], dtype=np.int64)
        twin.all_reduce(x)
        errors.expect(int(x[0]) == world_sum(comm, lambda r: r), f"sum of ranks {x}")
    finally:
        twin.close()
        named.close()
    x = np.ones(1)
    comm.all_reduce(x)  # closing the dups leaves the parent working
    errors.expect(x[0] == comm.size, f"parent after the dups closed: {x}")
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_close_and_with(comm, errors):
    with comm.dup(name="scoped") as scoped:
        scoped.barrier()
        errors.expect(not scoped.closed, "closed inside its with block")
    errors.expect(scoped.closed, "still open after its with block")
    scoped.close()  # idempotent
    for call in (scoped.barrier, lambda: scoped.all_reduce(np.ones(2)), scoped.dup):
        try:
            call()
        except hetcomm.CommAborted as exc:
            errors.expect("closed" in str(exc) and "scoped" in str(exc), f"message {exc}")
        else:
            errors.append("a closed communicator accepted a call")
    errors.verify()


# ---- async Work -------------------------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
def test_async_all_reduce_wait_in_reverse_order(comm, errors):
    size = comm.size
    arrays = [
        np.full(7, comm.rank + 1, dtype=np.float32),
        np.full((3, 2), comm.rank, dtype=np.int64),
        torch.full((5,), float(comm.rank), dtype=torch.float64),
        np.arange(12, dtype=np.int32).reshape(4, 3).T,
    ]
    ops = [ReduceOp.SUM, ReduceOp.MAX, ReduceOp.SUM, ReduceOp.PROD]
    expected = [
        np.full(7, size * (size + 1) / 2),
        np.full((3, 2), size - 1),
        np.full(5, size * (size - 1) / 2),
        np.arange(12, dtype=np.int64).reshape(4, 3).T ** size,
    ]
    works = [comm.all_reduce(a, op, async_op=True) for a, op in zip(arrays, ops)]
    for w in works:
        errors.expect(isinstance(w, hetcomm.Work), f"async all_reduce returned {w!r}")
        errors.expect(w.exception() is None, f"exception() {w.exception()!r} while in flight")
    for w in reversed(works):
        w.wait(timeout=60)
    for i, (w, a, want) in enumerate(zip(works, arrays, expected)):
        errors.expect(w.test() and w.is_completed(), f"work {i} not complete after wait")
        errors.expect(w.exception() is None, f"work {i} exception {w.exception()!r}")
        got = a.numpy() if isinstance(a, torch.Tensor) else a
        errors += compare(got.astype(np.float64), np.asarray(want, dtype=np.float64), f"array {i}")
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_async_test_becomes_true(comm, errors):
    """Polling test() alone drives every kind of operation to completion."""
    size, rank = comm.size, comm.rank
    x = np.full(4, rank, dtype=np.int64)
    root_x = np.full(3, 10 + rank, dtype=np.int16)
    gathered = np.zeros((size, 2), dtype=np.int32)
    scattered = np.zeros(2, dtype=np.float32)
    exchanged = np.zeros(size, dtype=np.int64)
    received = np.zeros(3, dtype=np.uint8)
    works = [
        comm.all_reduce(x, async_op=True),
        comm.broadcast(root_x, size - 1, async_op=True),
        comm.all_gather(gathered, np.full(2, rank, dtype=np.int32), async_op=True),
        comm.reduce_scatter(scattered, np.ones(2 * size, dtype=np.float32), async_op=True),
        comm.all_to_all(exchanged, np.arange(size, dtype=np.int64) + 100 * rank, async_op=True),
        comm.send(np.full(3, rank, dtype=np.uint8), (rank + 1) % size, async_op=True),
        comm.recv(received, (rank - 1) % size, async_op=True),
        comm.barrier(async_op=True),
    ]
    deadline = time.monotonic() + 60
    pending = list(works)
    while pending and time.monotonic() < deadline:
        pending = [w for w in pending if not w.test()]
    errors.expect(not pending, f"still pending after 60 s: {pending}")
    errors.expect(all(w.exception() is None for w in works), "an operation failed")
    if not pending:
        errors += compare(x, np.full(4, size * (size - 1) // 2), "all_reduce")
        errors += compare(root_x, np.full(3, 10 + size - 1), "broadcast")
        errors += compare(gathered, np.repeat(np.arange(size), 2).reshape(size, 2), "all_gather")
        errors += compare(scattered, np.full(2, float(size), dtype=np.float32), "reduce_scatter")
        errors += compare(exchanged, np.arange(size) * 100 + rank, "all_to_all")
        errors += compare(received, np.full(3, (rank - 1) % size), "recv")
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_async_non_contiguous_result_lands_on_wait(comm, errors):
    base = np.full(10, -1.0)
    view = base[::2]
    view[:] = comm.rank
    work = comm.all_reduce(view, async_op=True)
    work.wait()
    errors += compare(view, np.full(5, comm.size * (comm.size - 1) / 2), "strided result")
    errors += compare(base[1::2], np.full(5, -1.0), "gaps of the strided view")
    errors.verify()


# ---- timeout ----------------------------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
def test_recv_timeout_aborts_the_communicator(comm, errors):
    """A recv that nobody answers times out naming the group and the op; the communicator is
    aborted and refuses every later call at once. Only rank 0 uses the dedicated dup."""
    lonely = comm.dup(name="lonely")
    try:
        if comm.rank == 0:
            x = np.zeros(4, dtype=np.float32)
            start = time.monotonic()
            try:
                lonely.recv(x, src=1, tag=7, timeout=0.5)
            except hetcomm.CommTimeout as exc:
                msg = str(exc)
                errors.expect("lonely" in msg and "recv" in msg, f"message {msg!r}")
                errors.expect(
                    exc.group == "lonely" and exc.op == "recv",
                    f"group {exc.group!r}, op {exc.op!r}",
                )
                waited = time.monotonic() - start
                errors.expect(0.4 <= waited < 10, f"timed out after {waited:.2f} s")
            else:
                errors.append("recv with nobody sending returned")
            calls = {
                "recv": lambda: lonely.recv(x, src=1, tag=7),
                "all_reduce": lambda: lonely.all_reduce(x),
                "barrier": lonely.barrier,
                "send": lambda: lonely.send(x, 1),
                "dup": lonely.dup,
            }
            for name, call in calls.items():
                start = time.monotonic()
                try:
                    call()
                except hetcomm.CommAborted as exc:
                    errors.expect("lonely" in str(exc), f"{name}: message {exc}")
                    errors.expect(time.monotonic() - start < 0.5, f"{name}: not at once")
                else:
                    errors.append(f"{name} on an aborted communicator returned")
    finally:
        lonely.close()
    errors.verify()


# ---- debug mode -------------------------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
def test_debug_mode_names_mismatched_count_and_root(make_comm, errors):
    dbg = make_comm(debug=True)
    n = 4 if dbg.rank == 0 else 5
    x = np.ones(n, dtype=np.float32)
    try:
        dbg.all_reduce(x)
    except hetcomm.MismatchError as exc:
        errors.expect("count" in str(exc), f"message {exc}")
    else:
        errors.append("all_reduce with different counts did not raise MismatchError")
    errors += compare(x, np.ones(n), "x after the mismatch")

    y = np.full(3, dbg.rank, dtype=np.int32)
    try:
        dbg.broadcast(y, root=0 if dbg.rank == 0 else 1)
    except hetcomm.MismatchError as exc:
        errors.expect("root" in str(exc), f"message {exc}")
    else:
        errors.append("broadcast with different roots did not raise MismatchError")
    errors += compare(y, np.full(3, dbg.rank), "y after the mismatch")

    # the ranks are still in step: a matching call works
    z = np.ones(5, dtype=np.float32)
    dbg.all_reduce(z)
    errors += compare(z, np.full(5, dbg.size, dtype=np.float32), "matching all_reduce after")
    errors.verify()


# ---- simulated vendors and hosts --------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
def test_simulated_vendors_and_hosts(make_comm, errors):
    vendors, hosts = ("nvidia", "amd"), ("a", "b")
    sim = make_comm(vendors=vendors, hosts=hosts)
    topo = sim.topology
    errors.expect(len(topo) == sim.size, f"topology has {len(topo)} ranks")
    for r in range(sim.size):
        info = topo[r]
        errors.expect(
            info.vendor == vendors[r % 2] and info.host == hosts[r % 2],
            f"rank {r}: {info.vendor} on {info.host}",
        )
        on_host = [q for q in range(sim.size) if q % 2 == r % 2]
        errors.expect(
            (info.local_rank, info.local_size) == (on_host.index(r), len(on_host)),
            f"rank {r}: local {info.local_rank}/{info.local_size}",
        )
    errors.expect(topo.vendors() == sorted(set(vendors[: sim.size])), f"{topo.vendors()}")
    errors.expect(topo.hosts() == sorted(set(hosts[: sim.size])), f"{topo.hosts()}")

    x = np.arange(6, dtype=np.float64) * (sim.rank + 1)
    sim.all_reduce(x)
    errors += compare(x, np.arange(6) * world_sum(sim, lambda r: r + 1), "host all_reduce")
    t = torch.full((3,), sim.rank, dtype=torch.int32)
    sim.all_reduce(t, ReduceOp.MAX)
    errors += compare(t.numpy(), np.full(3, sim.size - 1), "torch all_reduce")

    text = str(sim.plan)
    host_lines = [line for line in text.splitlines() if line.strip().startswith("host")]
    errors.expect(bool(host_lines) and all("mpi" in line for line in host_lines), f"plan:\n{text}")
    transport, _ = sim.plan.lookup("all_reduce", "host", "small")
    errors.expect(transport == "mpi", f"all_reduce on small host buffers -> {transport}")
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_make_comm_takes_a_name(make_comm, errors):
    """make_comm(name=...) names the communicator (hetcomm/testing.py pops `name` for init)."""
    try:
        named = make_comm(name="custom")
    except TypeError as exc:
        errors.append(f"make_comm(name=...) raised TypeError: {exc}")
    else:
        errors.expect(named.name == "custom", f"named {named.name!r}")
    errors.verify()
