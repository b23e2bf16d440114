"""sendrecv and `with comm.group():`: the ring (every rank sends right and receives left at
once) with messages too large for MPI's eager sends, which deadlocks as plain blocking calls."""

from __future__ import annotations

import time

import numpy as np
import pytest

import hetcomm

# 4 MiB of float64: past every MPI eager limit, so that a blocking send waits for its receive
N = 1 << 19


def _ring(comm):
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    return right, left


def _mine(seed: int, rank: int) -> np.ndarray:
    return np.random.default_rng([seed, rank]).standard_normal(N)


def _refused(errors, what, call) -> None:
    """`call()` must raise InvalidArgument."""
    try:
        call()
    except hetcomm.InvalidArgument:
        pass
    except Exception as exc:
        errors.append(f"{what}: {type(exc).__name__} instead of InvalidArgument: {exc}")
    else:
        errors.append(f"{what}: not refused")


@pytest.mark.mpi(min_size=2)
def test_sendrecv_ring(hetcomm_comm, hetcomm_shared_seed, errors):
    comm = hetcomm_comm
    right, left = _ring(comm)
    x = _mine(hetcomm_shared_seed, comm.rank)
    out = np.zeros(N + 2)  # sentinels on both sides
    out[0] = out[-1] = -7.0
    keep = x.copy()
    if errors.run("sendrecv", comm.sendrecv, x, right, out[1:-1], left, tag=3, timeout=60):
        errors.expect(
            np.array_equal(out[1:-1], _mine(hetcomm_shared_seed, left)), "wrong data received"
        )
        errors.expect(out[0] == -7.0 and out[-1] == -7.0, "wrote outside the output")
        errors.expect(np.array_equal(x, keep), "the send buffer changed")
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_group_block_halo_exchange(hetcomm_comm, hetcomm_shared_seed, errors):
    """Each rank sends to both neighbours and receives from both, blocking calls inside one
    block, in an order that would deadlock outside it (sends first)."""
    comm = hetcomm_comm
    right, left = _ring(comm)
    x = _mine(hetcomm_shared_seed, comm.rank)
    from_left, from_right = np.zeros(N), np.zeros(N)

    def exchange():
        with comm.group():
            comm.send(x, right, tag=1)
            comm.send(x, left, tag=2)
            comm.recv(from_left, left, tag=1)
            comm.recv(from_right, right, tag=2)

    if errors.run("group", exchange):
        errors.expect(np.array_equal(from_left, _mine(hetcomm_shared_seed, left)), "from the left")
        errors.expect(
            np.array_equal(from_right, _mine(hetcomm_shared_seed, right)), "from the right"
        )
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_group_block_with_asynchronous_calls(hetcomm_comm, hetcomm_shared_seed, errors):
    comm = hetcomm_comm
    right, left = _ring(comm)
    x = _mine(hetcomm_shared_seed, comm.rank)
    got = np.zeros(N)
    works = []

    def block():
        with comm.group():
            works.append(comm.send(x, right, async_op=True))
            works.append(comm.recv(got, left, async_op=True))
        for w in works:
            w.wait(timeout=60)

    if errors.run("group async", block):
        errors.expect(np.array_equal(got, _mine(hetcomm_shared_seed, left)), "wrong data received")
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_group_block_refusals(hetcomm_comm, errors):
    """Collectives and nested blocks are refused inside a block; an exception inside drops the
    queued calls (nothing moved), and the communicator goes on working."""
    comm = hetcomm_comm
    x = np.ones(4)

    def collective_inside():
        with comm.group():
            comm.all_reduce(x)

    def nested():
        with comm.group(), comm.group():
            pass

    for what, call in (("collective", collective_inside), ("nested", nested)):
        _refused(errors, what, call)
    got = np.full(4, 5.0)
    work = None
    try:
        with comm.group():
            work = comm.recv(got, (comm.rank + 1) % comm.size, async_op=True)
            raise KeyError("inside")
    except KeyError:
        pass
    errors.expect(np.array_equal(got, np.full(4, 5.0)), "a dropped receive wrote")
    try:
        assert work is not None
        work.wait(timeout=5)
        errors.append("the dropped receive's Work completed")
    except hetcomm.InvalidArgument:
        pass
    y = np.ones(3)
    if errors.run("all_reduce afterwards", comm.all_reduce, y):
        errors.expect((y == comm.size).all(), f"all_reduce afterwards gave {y}")
    errors.verify()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("form", ["sendrecv", "group"])
def test_a_wait_blocks_on_the_calls_it_follows(
    hetcomm_comm, hetcomm_shared_seed, errors, monkeypatch, form
):
    """The Work of an asynchronous sendrecv (one over its send and receive) and that of an
    asynchronous call in a group block (one over the call the block's end makes) wait on
    the Works they follow: their waits block on those Works' own signals (Work.block) and
    drive them, where they once napped between polls. The ranks after 0 call 0.2 s late, so
    that rank 0's wait has to wait."""
    comm = hetcomm_comm
    right, left = _ring(comm)
    x = _mine(hetcomm_shared_seed, comm.rank)
    got = np.zeros(N + 2)
    got[0] = got[-1] = -7.0
    blocked: list[hetcomm.Work] = []
    block = hetcomm.Work.block

    def spy(work, seconds):
        blocked.append(work)
        return block(work, seconds)

    works: list[hetcomm.Work] = []

    def exchange():
        if form == "sendrecv":
            works.append(comm.sendrecv(x, right, got[1:-1], left, tag=5, async_op=True))
            return
        with comm.group():
            sent = comm.send(x, right, tag=5, async_op=True)
            received = comm.recv(got[1:-1], left, tag=5, async_op=True)
        works.extend([received, sent])

    comm.barrier()
    if comm.rank:
        time.sleep(0.2)
    errors.run("exchange", exchange)
    monkeypatch.setattr(hetcomm.Work, "block", spy)
    for w in works:
        errors.run("wait", w.wait, 60)
    monkeypatch.undo()
    if comm.rank == 0:
        followed = [w for w in blocked if all(w is not outer for outer in works)]
        errors.expect(
            bool(followed), f"no wait blocked on a call it follows ({len(blocked)} blocks)"
        )
    errors.expect(np.array_equal(got[1:-1], _mine(hetcomm_shared_seed, left)), "wrong data")
    errors.expect(got[0] == -7.0 and got[-1] == -7.0, "wrote outside the output")
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_sendrecv_refusals_move_nothing(hetcomm_comm, hetcomm_shared_seed, errors):
    """A sendrecv whose send or receive is refused (a rank out of range, a bad tag, a
    read-only output) raises InvalidArgument on the calling rank before either call starts:
    no receive is left posted to take the peer's next message, nothing is sent, and the
    output is untouched; the exchange made next, on every rank, gets the right data."""
    comm = hetcomm_comm
    right, left = _ring(comm)
    x = _mine(hetcomm_shared_seed, comm.rank)[:64]
    got = np.full(64, -3.0)
    frozen = np.zeros(64)
    frozen.flags.writeable = False
    bad = [
        ("dst", lambda: comm.sendrecv(x, comm.size, got, left)),
        ("tag", lambda: comm.sendrecv(x, right, got, left, tag=-1)),
        ("recv_tag", lambda: comm.sendrecv(x, right, got, left, recv_tag=-1)),
        ("src", lambda: comm.sendrecv(x, right, got, comm.size + 3)),
        ("out", lambda: comm.sendrecv(x, right, frozen, left)),
        ("x", lambda: comm.sendrecv(object(), right, got, left)),
    ]
    for what, call in bad:
        _refused(errors, what, call)
        errors.expect((got == -3.0).all(), f"{what}: the output was written")
    comm.barrier()
    if errors.run("sendrecv afterwards", comm.sendrecv, x, right, got, left, timeout=15):
        want = _mine(hetcomm_shared_seed, left)[:64]
        errors.expect(np.array_equal(got, want), "sendrecv afterwards: wrong data")
    errors.verify()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("async_op", [False, True], ids=["blocking", "async"])
def test_a_repeated_sendrecv_takes_its_prepared_calls(
    hetcomm_comm, hetcomm_shared_seed, errors, monkeypatch, async_op
):
    """A sendrecv of host arrays, repeated, is served by the transport's own calls where it
    has them (mpi, staged), with no group block (else by the block's two calls): blocking, by
    its exchange of the pair; asynchronous, by the receive's and the send's prepared starts.
    Each result right when the signature changes between calls (count, dtype, tags, a timeout
    of its own, sizes from 8 B to past MPI's eager limit), the output's neighbours untouched
    and the input unchanged."""
    from hetcomm import grouping

    blocks = []  # the group blocks run: the path taken where a prepared call is missing
    run = grouping.run
    monkeypatch.setattr(
        grouping, "run", lambda comm, items: (blocks.append(items), run(comm, items))
    )
    comm = hetcomm_comm
    right, left = _ring(comm)
    rng = np.random.default_rng([hetcomm_shared_seed, 77])  # the same draws on every rank
    shapes = [(1, "float64"), (1, "float64"), (1000, "int32"), (1000, "int32"), (N, "float32")]
    for call, (count, dtype) in enumerate(shapes * 2):
        tag, rtag = call % 3, call % 3  # a tag of its own per call, the same on both ends
        timeout = 30.0 if call % 2 else None
        stack = rng.standard_normal((comm.size, count)) * 100
        x = stack[comm.rank].astype(dtype)
        keep = x.copy()
        out = np.full(count + 2, -7, dtype)
        what = f"call {call} ({count} x {dtype})"
        got = out[1:-1]
        opts = {"recv_tag": rtag, "timeout": timeout, "async_op": async_op}
        if errors.run(what, _sendrecv, comm, x, right, got, left, tag, **opts):
            errors.expect(np.array_equal(out[1:-1], stack[left].astype(dtype)), f"{what}: data")
            errors.expect(out[0] == -7 and out[-1] == -7, f"{what}: wrote outside the output")
            errors.expect(np.array_equal(x, keep), f"{what}: the input changed")
    routes = comm.routes()
    pairs = [r for r in routes if r["op"] == "sendrecv"]
    paired = sum(r["runs"] for r in pairs if r["prepared"])
    errors.expect(not (async_op and paired), f"async: {paired} calls took the blocking exchange")
    prepared = paired == 10
    for op, path in (
        ("recv", "prepared_async" if async_op else "prepared"),
        ("send", "prepared_async"),
    ):
        mine = [r for r in routes if r["op"] == op]
        errors.expect(len(mine) == 3, f"{op}: {len(mine)} routes for 3 signatures")
        served = sum(r["runs"] if r[path] else r["uses"] for r in mine)
        errors.expect(paired + served == 10, f"{op}: {paired} exchanges + {served} calls of 10")
        prepared = prepared or all(r[path] for r in mine)
    if prepared:
        errors.expect(not blocks, f"{len(blocks)} of 10 calls made a group block")
    errors.verify()


def _sendrecv(comm, *args, **opts):
    """comm.sendrecv, its Work waited for where it made one (an asynchronous call)."""
    work = comm.sendrecv(*args, **opts)
    if work is not None:
        work.wait()
