"""sendrecv and `with comm.group():`: the ring (every rank sends right and receives left at
once) with messages too large for MPI's eager sends, which deadlocks as plain blocking calls."""

from __future__ import annotations

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


@pytest.mark.mpi(min_size=2)
def test_sendrecv_ring(comm, shared_seed, errors):
    right, left = _ring(comm)
    x = _mine(shared_seed, comm.rank)
    out = np.zeros(N + 2)  # sentinels on both sides
    out[0] = out[-1] = -7.0
    keep = x.copy()
    if errors.run("sendrecv", comm.sendrecv, x, right, out[1:-1], left, tag=3, timeout=60):
        errors.expect(np.array_equal(out[1:-1], _mine(shared_seed, left)), "wrong data received")
        errors.expect(out[0] == -7.0 and out[-1] == -7.0, "wrote outside the output")
        errors.expect(np.array_equal(x, keep), "the send buffer changed")
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_group_block_halo_exchange(comm, shared_seed, errors):
    """Each rank sends to both neighbours and receives from both, blocking calls inside one
    block, in an order that would deadlock outside it (sends first)."""
    right, left = _ring(comm)
    x = _mine(shared_seed, comm.rank)
    from_left, from_right = np.zeros(N), np.zeros(N)

    def exchange():
        with comm.group():
            comm.send(x, right, tag=1)
            comm.send(x, left, tag=2)
            comm.recv(from_left, left, tag=1)
            comm.recv(from_right, right, tag=2)

    if errors.run("group", exchange):
        errors.expect(np.array_equal(from_left, _mine(shared_seed, left)), "from the left")
        errors.expect(np.array_equal(from_right, _mine(shared_seed, right)), "from the right")
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_group_block_with_asynchronous_calls(comm, shared_seed, errors):
    right, left = _ring(comm)
    x = _mine(shared_seed, comm.rank)
    got = np.zeros(N)
    works = []

    def block():
        with comm.group():
            works.append(comm.send(x, right, async_op=True))
            works.append(comm.recv(got, left, async_op=True))
        for w in works:
            w.wait(timeout=60)

    if errors.run("group async", block):
        errors.expect(np.array_equal(got, _mine(shared_seed, left)), "wrong data received")
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_group_block_refusals(comm, errors):
    """Collectives and nested blocks are refused inside a block; an exception inside drops the
    queued calls (nothing moved), and the communicator goes on working."""
    x = np.ones(4)

    def collective_inside():
        with comm.group():
            comm.all_reduce(x)

    def nested():
        with comm.group(), comm.group():
            pass

    for what, call in (("collective", collective_inside), ("nested", nested)):
        try:
            call()
        except hetcomm.InvalidArgument:
            pass
        except Exception as exc:
            errors.append(f"{what}: {type(exc).__name__}: {exc}")
        else:
            errors.append(f"{what}: not refused")
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
