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
from hetcomm.testing import mapped_files

# ---- barrier ----------------------------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
def test_barrier_waits_for_every_rank(hetcomm_comm, errors):
    """No rank leaves the barrier before the last one (rank 0, late by 0.2 s) entered it
    (with 0.05 s to spare for clocks of different hosts)."""
    if hetcomm_comm.rank == 0:
        time.sleep(0.2)
    entered = time.time()
    hetcomm_comm.barrier()
    left = time.time()
    work = hetcomm_comm.barrier(async_op=True, timeout=30)
    errors.expect(isinstance(work, hetcomm.Work), f"async barrier returned {work!r}")
    work.wait()
    times = hetcomm_comm.mpi.allgather((entered, left))
    last_in = max(t[0] for t in times)
    first_out = min(t[1] for t in times)
    errors.expect(first_out > last_in - 0.05, f"a rank left at {first_out} before {last_in}")
    errors.verify()


# ---- split and dup ----------------------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
def test_split_by_parity_ordered_by_key(hetcomm_comm, errors):
    color = hetcomm_comm.rank % 2
    sub = hetcomm_comm.split(color, key=-hetcomm_comm.rank)  # reversed order inside each half
    try:
        members = sorted((r for r in range(hetcomm_comm.size) if r % 2 == color), reverse=True)
        got = sub.mpi.allgather(hetcomm_comm.rank)
        errors.expect(got == members, f"members {got}, expected {members}")
        errors.expect(
            sub.size == len(members) and sub.rank == members.index(hetcomm_comm.rank),
            f"rank {sub.rank} of {sub.size}",
        )
        errors.expect(sub.name == f"{hetcomm_comm.name}.{color}", f"default name {sub.name!r}")
        errors.expect(
            [t.world_rank for t in sub.topology] == members,
            f"topology world ranks {[t.world_rank for t in sub.topology]}",
        )
        x = np.array([hetcomm_comm.rank, 1], dtype=np.int64)
        sub.all_reduce(x)
        errors += compare(x, np.array([sum(members), len(members)]), "all_reduce on the split")
    finally:
        sub.close()
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_split_leaves_out_none_and_negative_colors(hetcomm_comm, errors):
    """color None or negative: the rank gets None; the others form the group (named)."""
    color = None if hetcomm_comm.rank == 0 else (-1 if hetcomm_comm.rank == 1 else 7)
    sub = hetcomm_comm.split(color, name="rest")
    if hetcomm_comm.rank in (0, 1):
        errors.expect(sub is None, f"rank {hetcomm_comm.rank} got {sub!r}")
    else:
        assert sub is not None
        errors.expect(
            sub.name == "rest" and sub.size == hetcomm_comm.size - 2,
            f"{sub.name!r} of size {sub.size}",
        )
        x = np.ones(2, dtype=np.int32)
        sub.all_reduce(x)
        errors.expect((x == hetcomm_comm.size - 2).all(), f"sum of ones {x}")
        sub.close()
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_split_with_a_config_of_its_own(hetcomm_comm, errors):
    """`config=` gives the new communicator its own configuration (here a timeout); without
    it the parent's is inherited; a config that is not a Config is refused before the split."""
    own = hetcomm_comm.config.with_options(timeout=42.0)
    sub = hetcomm_comm.split(0, config=own)
    plain = hetcomm_comm.split(0)
    try:
        assert sub is not None and plain is not None
        errors.expect(sub.config.timeout == 42.0, f"split's timeout {sub.config.timeout}")
        errors.expect(plain.config is hetcomm_comm.config, "the parent's config not inherited")
        x = np.ones(2)
        sub.all_reduce(x)
        errors.expect((x == hetcomm_comm.size).all(), f"all_reduce on the split: {x}")
    finally:
        for c in (sub, plain):
            if c is not None:
                c.close()
    with pytest.raises(hetcomm.InvalidArgument, match=r"config must be a hetcomm\.Config"):
        hetcomm_comm.split(0, config={"timeout": 1})
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_dup_has_same_members_and_name(hetcomm_comm, errors):
    twin = hetcomm_comm.dup()
    named = hetcomm_comm.dup(name="other")
    try:
        errors.expect(
            (twin.rank, twin.size, twin.name)
            == (hetcomm_comm.rank, hetcomm_comm.size, hetcomm_comm.name),
            f"dup is {twin!r}",
        )
        errors.expect(named.name == "other", f"named dup is {named.name!r}")
        x = np.array([hetcomm_comm.rank], dtype=np.int64)
        twin.all_reduce(x)
        errors.expect(
            int(x[0]) == hetcomm_comm.size * (hetcomm_comm.size - 1) // 2, f"sum of ranks {x}"
        )
    finally:
        twin.close()
        named.close()
    x = np.ones(1)
    hetcomm_comm.all_reduce(x)  # closing the dups leaves the parent working
    errors.expect(x[0] == hetcomm_comm.size, f"parent after the dups closed: {x}")
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_close_and_with(hetcomm_comm, errors):
    with hetcomm_comm.dup(name="scoped") as scoped:
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


@pytest.mark.mpi(min_size=2)
def test_close_unmaps_the_communicators_shared_memory(hetcomm_comm, errors):
    """A closed communicator, still referenced, maps none of the shared segments it made (its
    arrivals table and check records, a staged pair's rings and slots): a view of one kept
    alive by the object kept the segment mapped for as long as the object lived."""
    before = set(mapped_files("/dev/shm/hetcomm"))
    scoped = hetcomm_comm.dup(name="mapped")
    r, n = scoped.rank, scoped.size
    x = np.arange(1 << 18, dtype=np.float32)  # 1 MiB: over a staged pair's rails
    scoped.all_reduce(x)
    scoped.all_reduce(x[:4], async_op=True).wait()
    for nbytes in (16, x.nbytes):  # through a staged pair's ring, then over its rails
        y = np.empty(nbytes // 4, np.float32)
        work = scoped.send(x[: nbytes // 4], (r + 1) % n, async_op=True)
        scoped.recv(y, (r - 1) % n)
        work.wait()
    made = set(mapped_files("/dev/shm/hetcomm")) - before
    scoped.close()
    left = set(mapped_files("/dev/shm/hetcomm")) & made
    errors.expect(bool(made), "the communicator made no shared segment")
    errors.expect(not left, f"still mapped after close: {sorted(left)}")
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_a_group_of_one_hosts_devices_shares_a_mailbox(hetcomm_comm, errors, monkeypatch):
    """Where every rank has a device on one host, the communicator's arrivals segment holds
    the direct transport's mailbox (direct/mailbox.py): every rank maps the same words, and
    a closed communicator maps it no more. (No GPU here: the plan's test of the ranks'
    devices is stood in for.)"""
    from hetcomm import comm as comm_mod

    seen = []

    def lanes_bytes(devices, hosts):
        seen.append((len(devices), len(set(hosts))))
        return 3 * 4096 if len(set(hosts)) == 1 else 0  # as for ranks with devices

    monkeypatch.setattr(comm_mod.mailbox, "lanes_bytes", lanes_bytes)
    before = set(mapped_files("/dev/shm/hetcomm"))
    scoped = hetcomm_comm.dup(name="lanes")
    r, n = scoped.rank, scoped.size
    one_host = len(hetcomm_comm.topology.hosts()) == 1
    errors.expect(seen == [(n, len(hetcomm_comm.topology.hosts()))], f"asked {seen}")
    lanes = scoped.lanes
    if one_host:
        errors.expect(lanes is not None and len(lanes) == 3 * 4096, f"lanes {lanes!r}")
    else:
        errors.expect(lanes is None, "a mailbox across hosts")
    if lanes is not None:
        words = lanes.cast("q")
        errors.expect(not any(words), "a new mailbox is not all zeros")
        scoped.barrier()
        words[r] = 1000 + r
        words.release()
        scoped.barrier()
        words = lanes.cast("q")
        got = list(words[:n])
        words.release()
        errors.expect(got == [1000 + p for p in range(n)], f"ranks' words {got}")
        scoped.barrier()
    made = set(mapped_files("/dev/shm/hetcomm")) - before
    scoped.close()
    left = set(mapped_files("/dev/shm/hetcomm")) & made
    errors.expect(scoped.lanes is None, "a closed communicator still offers its mailbox")
    errors.expect(not left, f"still mapped after close: {sorted(left)}")
    errors.verify()


# ---- async Work -------------------------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
def test_async_all_reduce_wait_in_reverse_order(hetcomm_comm, errors):
    size = hetcomm_comm.size
    arrays = [
        np.full(7, hetcomm_comm.rank + 1, dtype=np.float32),
        np.full((3, 2), hetcomm_comm.rank, dtype=np.int64),
        torch.full((5,), float(hetcomm_comm.rank), dtype=torch.float64),
        np.arange(12, dtype=np.int32).reshape(4, 3).T,
    ]
    ops = [ReduceOp.SUM, ReduceOp.MAX, ReduceOp.SUM, ReduceOp.PROD]
    expected = [
        np.full(7, size * (size + 1) / 2),
        np.full((3, 2), size - 1),
        np.full(5, size * (size - 1) / 2),
        np.arange(12, dtype=np.int64).reshape(4, 3).T ** size,
    ]
    works = [hetcomm_comm.all_reduce(a, op, async_op=True) for a, op in zip(arrays, ops)]
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
def test_async_test_becomes_true(hetcomm_comm, errors):
    """Polling test() alone drives every kind of operation to completion."""
    size, rank = hetcomm_comm.size, hetcomm_comm.rank
    x = np.full(4, rank, dtype=np.int64)
    root_x = np.full(3, 10 + rank, dtype=np.int16)
    gathered, mine = np.zeros((size, 2), dtype=np.int32), np.full(2, rank, dtype=np.int32)
    scattered, ones = np.zeros(2, dtype=np.float32), np.ones(2 * size, dtype=np.float32)
    exchanged, blocks = np.zeros(size, dtype=np.int64), np.arange(size) + 100 * rank
    sent, received = np.full(3, rank, dtype=np.uint8), np.zeros(3, dtype=np.uint8)
    works = [
        hetcomm_comm.all_reduce(x, async_op=True),
        hetcomm_comm.broadcast(root_x, size - 1, async_op=True),
        hetcomm_comm.all_gather(gathered, mine, async_op=True),
        hetcomm_comm.reduce_scatter(scattered, ones, async_op=True),
        hetcomm_comm.all_to_all(exchanged, blocks, async_op=True),
        hetcomm_comm.send(sent, (rank + 1) % size, async_op=True),
        hetcomm_comm.recv(received, (rank - 1) % size, async_op=True),
        hetcomm_comm.barrier(async_op=True),
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
def test_async_non_contiguous_result_lands_on_wait(hetcomm_comm, errors):
    base = np.full(10, -1.0)
    view = base[::2]
    view[:] = hetcomm_comm.rank
    work = hetcomm_comm.all_reduce(view, async_op=True)
    work.wait()
    errors += compare(
        view, np.full(5, hetcomm_comm.size * (hetcomm_comm.size - 1) / 2), "strided result"
    )
    errors += compare(base[1::2], np.full(5, -1.0), "gaps of the strided view")
    errors.verify()


def _start_with_packed_input(comm, op, n):
    """Start `op` asynchronously on an input hetcomm must pack (strided), or one in out (the
    in-place all_gather, read where it lies); returns (work, result array, expected result).
    The caller keeps every array it passed."""
    size, rank, root = comm.size, comm.rank, comm.size - 1
    base = np.full(2 * size * n, float(rank + 1))  # strided views of it need packing
    total = size * (size + 1) / 2
    if op == "all_reduce":
        out = np.zeros(n)
        return comm.all_reduce(base[: 2 * n : 2], out=out, async_op=True), out, np.full(n, total)
    if op == "reduce":  # the non-root ranks' x is packed
        x = base[: 2 * n : 2]
        work = comm.reduce(x, root, async_op=True)
        return work, x, np.full(n, total if rank == root else rank + 1.0)
    if op == "broadcast":  # the root's x is packed
        x = base[: 2 * n : 2]
        return comm.broadcast(x, root, async_op=True), x, np.full(n, root + 1.0)
    if op == "all_gather":
        out = np.zeros(size * n)
        want = np.repeat(np.arange(1.0, size + 1), n)
        return comm.all_gather(out, base[: 2 * n : 2], async_op=True), out, want
    if op == "all_gather_in_place":  # x is its block of out: read where it lies
        out = np.repeat(np.arange(1.0, size + 1), n) * (np.arange(size * n) // n == rank)
        want = np.repeat(np.arange(1.0, size + 1), n)
        return comm.all_gather(out, out[rank * n : (rank + 1) * n], async_op=True), out, want
    if op == "reduce_scatter":
        out = np.zeros(n)
        return comm.reduce_scatter(out, base[::2], async_op=True), out, np.full(n, total)
    if op == "all_to_all":
        out = np.zeros(size * n)
        want = np.repeat(np.arange(1.0, size + 1), n)
        return comm.all_to_all(out, base[::2], async_op=True), out, want
    assert op == "send_recv"
    out = np.zeros(n)
    sent = comm.send(base[: 2 * n : 2], (rank + 1) % size, async_op=True)
    comm.recv(out, (rank - 1) % size)
    return sent, out, np.full(n, (rank - 1) % size + 1.0)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(
    "op",
    [
        "all_reduce",
        "reduce",
        "broadcast",
        "all_gather",
        "all_gather_in_place",
        "reduce_scatter",
        "all_to_all",
        "send_recv",
    ],
)
def test_async_keeps_its_packed_input_alive(hetcomm_comm, errors, op):
    """hetcomm packs a strided input into a copy of its own before handing it to MPI; an async
    operation must keep that copy (and an in-place input) alive until it completes, even while
    the caller allocates (and so reuses freed memory) before waiting."""
    n = 16
    work, result, want = _start_with_packed_input(hetcomm_comm, op, n)
    junk = [
        np.full(n * k, -1e6)
        for k in (1, hetcomm_comm.size, 2 * hetcomm_comm.size)
        for _ in range(8)
    ]
    hetcomm_comm.mpi.Barrier()  # every rank has started and allocated before anyone waits
    work.wait(timeout=60)
    errors += compare(result, want, f"async {op}")
    del junk
    errors.verify()


# ---- timeout ----------------------------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
def test_recv_timeout_aborts_the_communicator(hetcomm_comm, errors):
    """A recv that nobody answers times out naming the group and the op; the communicator is
    aborted and refuses every later call at once. Only rank 0 uses the dedicated dup."""
    lonely = hetcomm_comm.dup(name="lonely")
    try:
        if hetcomm_comm.rank == 0:
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


@pytest.mark.mpi(min_size=2)
def test_async_recv_timeout_is_kept_by_its_work(hetcomm_comm, errors):
    """The Work of a timed-out async recv reports the CommTimeout from exception() and test()."""
    lonely = hetcomm_comm.dup(name="lonely-async")
    try:
        if hetcomm_comm.rank == 0:
            x = np.zeros(3)
            work = lonely.recv(x, src=1, tag=7, async_op=True, timeout=0.3)
            errors.expect(not work.test() and work.exception() is None, f"fresh work {work!r}")
            caught = None
            try:
                work.wait()
            except hetcomm.CommTimeout as exc:
                caught = exc
            errors.expect(caught is not None, "wait() did not raise CommTimeout")
            errors.expect(work.exception() is caught, f"exception() is {work.exception()!r}")
            try:
                work.test()
            except hetcomm.CommTimeout as exc:
                errors.expect(exc is caught, f"test() raised another error: {exc!r}")
            else:
                errors.append("test() of a timed-out work returned")
            errors += compare(x, np.zeros(3), "x after the timeout")
            try:
                lonely.barrier()
            except hetcomm.CommAborted:
                pass
            else:
                errors.append("barrier on the aborted communicator returned")
    finally:
        lonely.close()
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_config_timeout_is_the_default_limit(hetcomm_make_comm, errors):
    """make_comm(timeout=0.5): a call without its own timeout gives up after the configured 0.5 s
    (only rank 0 waits, in a recv that nobody answers)."""
    quick = hetcomm_make_comm(timeout=0.5)
    if quick.rank == 0:
        start = time.monotonic()
        try:
            quick.recv(np.zeros(1), src=1, tag=3)
        except hetcomm.CommTimeout as exc:
            waited = time.monotonic() - start
            errors.expect(0.4 <= waited < 10, f"timed out after {waited:.2f} s")
            errors.expect(exc.waited == 0.5, f"CommTimeout.waited {exc.waited}")
        else:
            errors.append("recv with nobody sending returned")
    errors.verify()


# ---- debug mode -------------------------------------------------------------------------------


def _expect_mismatch(errors, call, word):
    try:
        call()
    except hetcomm.MismatchError as exc:
        errors.expect(word in str(exc), f"MismatchError {exc} does not name {word!r}")
    else:
        errors.append(f"no MismatchError naming {word!r}")


@pytest.mark.mpi(min_size=2)
def test_debug_mode_names_what_differs(hetcomm_make_comm, errors):
    dbg = hetcomm_make_comm(debug=True)
    n = 4 if dbg.rank == 0 else 5
    x = np.ones(n, dtype=np.float32)
    _expect_mismatch(errors, lambda: dbg.all_reduce(x), "count")
    errors += compare(x, np.ones(n), "x after the count mismatch")

    y = np.full(3, dbg.rank, dtype=np.int32)
    _expect_mismatch(errors, lambda: dbg.broadcast(y, root=0 if dbg.rank == 0 else 1), "root")
    errors += compare(y, np.full(3, dbg.rank), "y after the root mismatch")

    z = np.ones(3, dtype=np.float32 if dbg.rank == 0 else np.float64)
    _expect_mismatch(errors, lambda: dbg.all_reduce(z), "dtype")
    _expect_mismatch(errors, lambda: dbg.reduce(z[:0], root=0), "dtype")

    # the ranks are still in step: a matching call works
    w = np.ones(5, dtype=np.float32)
    dbg.all_reduce(w)
    errors += compare(w, np.full(5, dbg.size, dtype=np.float32), "matching all_reduce after")
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_debug_mode_accepts_collectives_after_uneven_point_to_point(hetcomm_make_comm, errors):
    """send/recv are not collective: rank 0 sending a message to itself while the other ranks
    do nothing must not make the next, matching, collective look mismatched."""
    dbg = hetcomm_make_comm(debug=True)
    if dbg.rank == 0:
        x, y = np.arange(3, dtype=np.int64), np.zeros(3, dtype=np.int64)
        sent = dbg.send(x, 0, tag=1, async_op=True)
        dbg.recv(y, 0, tag=1)
        sent.wait()
        errors += compare(y, x, "received from itself")
    total = np.ones(2, dtype=np.int32)
    try:
        dbg.all_reduce(total)
    except hetcomm.MismatchError as exc:
        errors.append(f"matching all_reduce raised {exc}")
    else:
        errors += compare(total, np.full(2, dbg.size), "all_reduce after send/recv")
    errors.verify()


# ---- simulated vendors and hosts --------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
def test_simulated_vendors_and_hosts(hetcomm_make_comm, errors):
    vendors, hosts = ("nvidia", "amd"), ("a", "b")
    sim = hetcomm_make_comm(vendors=vendors, hosts=hosts)
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
    errors += compare(x, np.arange(6) * sum(range(1, sim.size + 1)), "host all_reduce")
    t = torch.full((3,), sim.rank, dtype=torch.int32)
    sim.all_reduce(t, ReduceOp.MAX)
    errors += compare(t.numpy(), np.full(3, sim.size - 1), "torch all_reduce")

    text = str(sim.plan)
    # host buffers go over MPI, unless the run forces a transport (--hetcomm-transport=staged)
    expected = sim.config.transport_for(sim.name)
    expected = "mpi" if expected == "auto" else expected
    host_lines = [line for line in text.splitlines() if line.strip().startswith("host")]
    errors.expect(
        bool(host_lines) and all(expected in line for line in host_lines), f"plan:\n{text}"
    )
    transport, _ = sim.plan.lookup("all_reduce", "host", "small")
    errors.expect(transport == expected, f"all_reduce on small host buffers -> {transport}")

    # a split keeps each member's facts and counts local ranks again, in its own rank order
    with sim.split(0, key=-sim.rank) as rev:
        parents = list(range(sim.size))[::-1]
        host_of = [hosts[p % 2] for p in parents]
        want = [
            (vendors[p % 2], h, host_of[:i].count(h), host_of.count(h))
            for i, (p, h) in enumerate(zip(parents, host_of))
        ]
        got = [(t.vendor, t.host, t.local_rank, t.local_size) for t in rev.topology]
        errors.expect(got == want, f"reversed split topology {got}, expected {want}")
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_make_comm_takes_a_name(hetcomm_make_comm, errors):
    """make_comm(name=...) names the communicator (hetcomm/testing.py pops `name` for init)."""
    try:
        named = hetcomm_make_comm(name="custom")
    except TypeError as exc:
        errors.append(f"make_comm(name=...) raised TypeError: {exc}")
    else:
        errors.expect(named.name == "custom", f"named {named.name!r}")
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_repeated_small_in_place_all_reduce(hetcomm_comm, hetcomm_shared_seed, errors):
    """The short path for small in-place numpy reductions gives what the general one gives."""
    rng = np.random.default_rng(hetcomm_shared_seed)
    ops = {ReduceOp.SUM: np.sum, ReduceOp.PROD: np.prod, ReduceOp.MIN: np.min, ReduceOp.MAX: np.max}
    for step in range(60):
        dtype = ("int32", "int64", "float32", "float64", "int8")[step % 5]
        op = list(ops)[step % 4]
        count = int(rng.integers(1, 9))
        data = rng.integers(-3, 4, size=(hetcomm_comm.size, count)).astype(dtype)
        x = data[hetcomm_comm.rank].copy()
        hetcomm_comm.all_reduce(x, op)
        want = ops[op](data.astype(np.float64), axis=0)
        errors.expect(np.array_equal(x.astype(np.float64), want), f"step {step} {dtype} {op}")
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_use_local_device_follows_the_topology(hetcomm_comm, errors, monkeypatch):
    """use_local_device makes device (node rank mod visible devices) current in CuPy and torch,
    the device the topology assigns the rank; with no GPU it changes nothing and returns None.
    The libraries are stand-ins that record what they were told."""
    import importlib.machinery
    import sys
    import types

    from mpi4py import MPI

    from hetcomm import topology

    told: dict[str, int] = {}
    fake_cupy = types.ModuleType("cupy")
    fake_cupy.__spec__ = importlib.machinery.ModuleSpec("cupy", None)
    fake_cupy.cuda = types.SimpleNamespace(
        Device=lambda i: types.SimpleNamespace(use=lambda: told.__setitem__("cupy", i))
    )
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: told.__setitem__("torch", i))
    monkeypatch.setattr(topology, "detect_vendor", lambda: ("nvidia", 3))
    index = topology.use_local_device(hetcomm_comm.mpi)
    node = hetcomm_comm.mpi.Split_type(MPI.COMM_TYPE_SHARED, key=hetcomm_comm.rank)
    want = node.Get_rank() % 3
    node.Free()
    errors.expect(
        index == want and told == {"cupy": want, "torch": want},
        f"use_local_device gave {index}, told {told}, expected {want}",
    )
    told.clear()
    monkeypatch.setattr(topology, "detect_vendor", lambda: ("cpu", 0))
    errors.expect(
        topology.use_local_device(hetcomm_comm.mpi) is None and not told, f"no GPU: told {told}"
    )
    errors.verify()
