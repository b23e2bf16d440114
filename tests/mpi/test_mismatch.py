"""The default check: ranks that call different collectives, or the same one with different
arguments, get MismatchError on every rank before any byte moves, with their buffers as they
were; the communicator stays usable. And a wait that times out names the ranks it waits for.

Runs on whichever transport the run's --hetcomm-transport picks (scripts/test runs this folder
on auto and on staged's rails)."""

from __future__ import annotations

import time

import numpy as np
import pytest

import hetcomm
from hetcomm import ReduceOp


def _each_rank_sees_mismatch(comm, errors, what, call, *arrays, fields=()):
    """`call()` must raise MismatchError naming every field in `fields`, and leave `arrays`
    (this rank's buffers) as they were."""
    before = [a.copy() for a in arrays]
    try:
        call()
    except hetcomm.MismatchError as exc:
        for field in fields:
            errors.expect(f"{field} differs" in str(exc), f"{what}: {field} not named: {exc}")
        errors.expect(f"group '{comm.name}'" in str(exc), f"{what}: group not named: {exc}")
    except Exception as exc:
        errors.append(f"{what}: {type(exc).__name__} instead of MismatchError: {exc}")
    else:
        errors.append(f"{what}: no MismatchError")
    for a, b in zip(arrays, before):
        errors.expect(np.array_equal(a, b), f"{what}: a buffer was written")


def _still_works(comm, errors, what):
    x = np.full(5, comm.rank + 1, np.int64)
    if errors.run(f"{what}: all_reduce afterwards", comm.all_reduce, x):
        want = comm.size * (comm.size + 1) // 2
        errors.expect((x == want).all(), f"{what}: all_reduce afterwards gave {x}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("async_op", [False, True], ids=["blocking", "async"])
def test_mismatched_collectives_raise_on_every_rank(hetcomm_make_comm, errors, async_op):
    comm = hetcomm_make_comm(name="mismatch", timeout=30)
    odd = comm.rank == 1

    def run(call):
        work = call()
        if async_op:
            work.wait()

    # count: 2048 elements on rank 1, 1024 elsewhere (MPI alone truncates or corrupts)
    x = np.random.default_rng(comm.rank).standard_normal(2048 if odd else 1024)
    _each_rank_sees_mismatch(
        comm,
        errors,
        "count",
        lambda: run(lambda: comm.all_reduce(x, async_op=async_op)),
        x,
        fields=("count",),
    )
    # dtype: float32 on rank 1
    y = np.ones(64, np.float32 if odd else np.float64)
    _each_rank_sees_mismatch(
        comm,
        errors,
        "dtype",
        lambda: run(lambda: comm.all_reduce(y, async_op=async_op)),
        y,
        fields=("dtype",),
    )
    # reduce op
    z = np.arange(16, dtype=np.int32) + comm.rank
    _each_rank_sees_mismatch(
        comm,
        errors,
        "reduce op",
        lambda: run(
            lambda: comm.all_reduce(z, ReduceOp.MAX if odd else ReduceOp.SUM, async_op=async_op)
        ),
        z,
        fields=("reduce op",),
    )
    # kind of operation: broadcast on rank 1, all_reduce elsewhere
    w = np.full(32, comm.rank, np.int64)
    _each_rank_sees_mismatch(
        comm,
        errors,
        "operation",
        lambda: run(
            lambda: (
                comm.broadcast(w, 0, async_op=async_op)
                if odd
                else comm.all_reduce(w, async_op=async_op)
            )
        ),
        w,
        fields=("operation",),
    )
    # root of a broadcast
    v = np.full(8, comm.rank, np.int16)
    _each_rank_sees_mismatch(
        comm,
        errors,
        "root",
        lambda: run(lambda: comm.broadcast(v, 1 if odd else 0, async_op=async_op)),
        v,
        fields=("root",),
    )
    # out-of-place forms: all_gather with another count on rank 1
    n = 3 if odd else 2
    xg = np.full(n, comm.rank, np.float64)
    out = np.full(n * comm.size, -1.0)
    _each_rank_sees_mismatch(
        comm,
        errors,
        "all_gather count",
        lambda: run(lambda: comm.all_gather(out, xg, async_op=async_op)),
        xg,
        out,
        fields=("count",),
    )
    _still_works(comm, errors, "after the mismatches")
    errors.verify()


def _readonly(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("async_op", [False, True], ids=["blocking", "async"])
def test_a_call_refused_on_one_rank_is_named_on_every_rank(hetcomm_make_comm, errors, async_op):
    """Rank 1 passes invalid arguments (a read-only output, unknown reduce ops, a bad
    timeout, a root out of range) where the others call validly: rank 1 raises
    InvalidArgument saying why, and every other rank MismatchError naming rank 1 at once
    (not a CommTimeout after waiting for it), with every buffer as it was; the communicator
    stays usable. Where every rank refuses, each raises its InvalidArgument."""
    comm = hetcomm_make_comm(name="refused", timeout=20)
    r, n = comm.rank, comm.size
    bad = r == 1
    rng = np.random.default_rng()
    x = rng.standard_normal(n * 8)
    out = np.zeros(n * 8)
    block = np.zeros(8)
    ro = _readonly(np.zeros(n * 8))
    ro_block = _readonly(np.zeros(8))
    calls = {
        "all_reduce": lambda a: comm.all_reduce(x, out=ro if bad else out, async_op=a),
        "all_reduce op": lambda a: comm.all_reduce(
            x, "nope" if bad else "sum", out=out, async_op=a
        ),
        "reduce": lambda a: comm.reduce(x.copy(), 0, "nope" if bad else "max", async_op=a),
        "broadcast": lambda a: comm.broadcast(out, n + 3 if bad else 0, async_op=a),
        "all_gather": lambda a: comm.all_gather(ro if bad else out, x[:8], async_op=a),
        "reduce_scatter": lambda a: comm.reduce_scatter(ro_block if bad else block, x, async_op=a),
        "all_to_all": lambda a: comm.all_to_all(ro if bad else out, x, async_op=a),
        "barrier": lambda a: comm.barrier(timeout=-1 if bad else None, async_op=a),
        "all_reduce_coalesced": lambda a: comm.all_reduce_coalesced(
            [ro_block if bad else block, out], async_op=a
        ),
    }
    kept = [a.copy() for a in (x, out, block)]
    for what, call in calls.items():
        start = time.monotonic()
        try:
            work = call(async_op and not bad)
            if work is not None:
                work.wait()
        except hetcomm.InvalidArgument as exc:
            errors.expect(bad, f"{what}: rank {r} refused a valid call: {exc}")
        except hetcomm.MismatchError as exc:
            errors.expect(not bad, f"{what}: the refusing rank got MismatchError: {exc}")
            errors.expect("ranks [1] refused" in str(exc), f"{what}: rank 1 not named: {exc}")
        except Exception as exc:
            errors.append(f"{what}: {type(exc).__name__}: {exc}")
        else:
            errors.append(f"{what}: rank {r} raised nothing")
        errors.expect(time.monotonic() - start < 10, f"{what}: took until near the timeout")
        for a, b in zip((x, out, block), kept):
            errors.expect(np.array_equal(a, b), f"{what}: a buffer was written")
    # every rank refuses: each says why, and nobody waits for anybody
    try:
        comm.all_reduce(x, out=ro)
        errors.append("a read-only out went through")
    except hetcomm.InvalidArgument as exc:
        errors.expect("read-only" in str(exc), f"unclear refusal: {exc}")
    _still_works(comm, errors, "after the refusals")
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_the_same_signature_repeated_is_checked_every_time(hetcomm_make_comm, errors):
    """A route is resolved once per signature, but the check runs on every call: ranks that
    agree for a while and then diverge are caught at the first call that differs."""
    comm = hetcomm_make_comm(name="diverge", timeout=30)
    x = np.ones(8, np.float32)
    for i in range(5):
        errors.run(f"round {i}", comm.all_reduce, x)
    errors.expect((x == comm.size**5).all(), f"agreeing rounds gave {x}")
    y = np.ones(8 if comm.rank else 4, np.float32)
    _each_rank_sees_mismatch(comm, errors, "divergent round", lambda: comm.all_reduce(y), y)
    _still_works(comm, errors, "after divergence")
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_the_check_can_be_switched_off(hetcomm_make_comm, errors):
    """With check=False (the same on every rank) agreeing calls still give right results."""
    comm = hetcomm_make_comm(name="unchecked", check=False)
    for form in ("in place", "out of place"):
        x = np.full(16, comm.rank + 1.0)
        out = np.empty_like(x) if form == "out of place" else None
        errors.run(form, comm.all_reduce, x, out=out)
        got = x if out is None else out
        errors.expect((got == comm.size * (comm.size + 1) / 2).all(), f"{form}: {got}")
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_a_timeout_names_the_ranks_that_have_not_arrived(hetcomm_make_comm, errors):
    """Rank 1 never calls: every other rank's CommTimeout names it (and only it)."""
    comm = hetcomm_make_comm(name="late", timeout=3)
    x = np.ones(4)
    if comm.rank != 1:
        try:
            comm.all_reduce(x)
        except hetcomm.CommTimeout as exc:
            errors.expect(exc.missing == (1,), f"missing ranks {exc.missing}: {exc}")
            errors.expect("ranks not arrived: [1]" in str(exc), f"message: {exc}")
            errors.expect("timed out" in str(exc), f"message: {exc}")
        except Exception as exc:
            errors.append(f"{type(exc).__name__} instead of CommTimeout: {exc}")
        else:
            errors.append("no CommTimeout")
        errors.expect(np.array_equal(x, np.ones(4)), "x was written")
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_an_asynchronous_collective_starts_while_its_caller_blocks_elsewhere(
    hetcomm_make_comm, errors
):
    """Rank 0 issues an asynchronous all_reduce, then blocks in a large send to rank 1, which
    first runs the all_reduce (blocking) and only then receives: the all_reduce, held back
    until its check completes, must start without rank 0 polling it (legal MPI, and it ran
    before the check existed)."""
    comm = hetcomm_make_comm(name="deferred", timeout=30)
    x = np.full(16, comm.rank + 1.0)
    big = np.zeros(1 << 20)  # 8 MiB: past the eager limit, the send waits for its receive
    want = comm.size * (comm.size + 1) / 2
    if comm.rank == 0:

        def go():
            work = comm.all_reduce(x, async_op=True)
            comm.send(np.ones_like(big), 1, tag=9)
            work.wait()

        errors.run("rank 0", go)
    else:
        errors.run("all_reduce", comm.all_reduce, x)
        if comm.rank == 1:
            errors.run("recv", comm.recv, big, 0, tag=9)
            errors.expect((big == 1).all(), "the large message")
    errors.expect((x == want).all(), f"all_reduce gave {x[:3]}")
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_a_deferred_collective_is_waited_for_on_its_own_signal(
    hetcomm_make_comm, hetcomm_shared_seed, errors, monkeypatch
):
    """Rank 0 calls an asynchronous all_reduce while rank 1 still sleeps: its check cannot
    complete, so the operation is deferred. Waiting for it, rank 0 must start it once rank 1
    arrives and then wait on the started operation's own signal (its Work's block), not nap
    in the caller's Work: napping cost 1.6-2.7x at 1 MiB on the 2-core VM. The result is the
    float64 sum of every rank's random array."""
    comm = hetcomm_make_comm(name="deferred-wait", timeout=30)
    n = 1 << 19  # 4 MiB: the mpi transport runs it on its lane, whose Work has a waiter

    def mine(rank: int) -> np.ndarray:
        return np.random.default_rng([hetcomm_shared_seed, rank]).standard_normal(n)

    x = mine(comm.rank)
    want = sum(mine(r) for r in range(comm.size))
    blocked: list[hetcomm.Work] = []
    block = hetcomm.Work.block

    def spy(work, seconds):
        blocked.append(work)
        return block(work, seconds)

    comm.barrier()
    if comm.rank == 0:
        work = comm.all_reduce(x, async_op=True)
        errors.expect(bool(comm._deferred), "the all_reduce was not deferred")
        monkeypatch.setattr(hetcomm.Work, "block", spy)
        errors.run("wait", work.wait)
        monkeypatch.undo()
        inner = [w for w in blocked if w is not work]
        errors.expect(
            bool(inner) and all(w.op == "all_reduce" for w in inner),
            f"the wait never blocked on the started operation ({len(blocked)} blocks)",
        )
    else:
        # mid-way through a 0.1 s slice of rank 0's wait: at a slice's end the wait's own loop
        # may start the operation and run it on its thread without blocking on it
        time.sleep(0.25)
        errors.run("all_reduce", comm.all_reduce, x)
    errors.expect(np.allclose(x, want, rtol=1e-12, atol=1e-9), "all_reduce gave wrong values")
    errors.verify()
