"""Collectives of one host's ranks in one shared segment (hetcomm.transports.hostcoll).

First the segment's own collectives, called directly: every op x several dtypes x every
reduce op x counts around its thresholds (none, one, fewer than the ranks, odd, the size where
reductions turn from whole to sharded, the sizes where the segment grows), against numpy
references from fresh random inputs, the same bits on every rank, nothing written outside the
output (sentinels), the input left as it was. Then waits that name late and dead ranks. Then
the staged transport through a Communicator: the calling thread's prepared calls, the driver
threads' general path, both mixed on one rank and across ranks, and nothing left in /dev/shm.
Skipped where the ranks are not on one host (simulated hosts).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
from _data import compare, draw, reference

from hetcomm import CommTimeout, ReduceOp, introspect
from hetcomm.arrays import Buffer, as_buffer
from hetcomm.transports import hostcoll, hostseg, tags
from hetcomm.transports.staged import collectives, segment
from hetcomm.transports.staged.transport import StagedTransport

_SENTINEL = 0xA5
_PAD = 64
DTYPES = ("bool", "int8", "int32", "uint8", "int64", "float16", "bfloat16", "float32", "float64")


def _one_host(comm) -> None:
    why = hostcoll.unavailable(comm.topology)
    if why is not None:
        pytest.skip(f"no shared segment for this group: {why}")


def _counts(dtype: str, size: int) -> list[int]:
    """Counts around the segment's thresholds for `dtype` (0, 1, fewer than the ranks, odd,
    the whole/sharded reduction boundary, past the first segment's halves)."""
    item = 1 if dtype == "bool" else np.dtype(_storage(dtype)).itemsize
    edge = hostcoll.REDUNDANT_MAX // item
    return [0, 1, max(1, size - 1), 7, edge, edge + 1, hostseg.INITIAL_BYTES // item + 3]


def _storage(dtype: str) -> str:
    return "uint16" if dtype == "bfloat16" else dtype


def as_bytes(values: np.ndarray, dtype: str) -> np.ndarray:
    """The bytes of `values` (logical) in `dtype`, flat."""
    if dtype == "bfloat16":
        t = torch.from_numpy(np.ascontiguousarray(values, np.float64)).to(torch.bfloat16)
        return t.view(torch.int16).numpy().reshape(-1).view(np.uint8).copy()
    return np.ascontiguousarray(values, dtype).reshape(-1).view(np.uint8).copy()


def from_bytes(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Logical values (bool, int64, float64) of bytes holding `dtype`."""
    if dtype == "bfloat16":
        t = torch.from_numpy(raw.view(np.int16).copy()).view(torch.bfloat16)
        return t.to(torch.float64).numpy()
    a = raw.view(dtype)
    return a.copy() if dtype == "bool" else a.astype(np.int64 if a.dtype.kind in "iu" else float)


class Out:
    """An output of `nbytes` between sentinel bytes."""

    def __init__(self, nbytes: int) -> None:
        self.backing = np.full(nbytes + 2 * _PAD, _SENTINEL, np.uint8)
        self.array = self.backing[_PAD : _PAD + nbytes]

    def intact(self) -> bool:
        return bool(
            (self.backing[:_PAD] == _SENTINEL).all() and (self.backing[-_PAD:] == _SENTINEL).all()
        )


@pytest.fixture
def group(hetcomm_comm):
    """A HostGroup of the test's communicator, over an MPI communicator of its own."""
    _one_host(hetcomm_comm)
    svc = hetcomm_comm.mpi.Dup()
    g = hostcoll.HostGroup(hetcomm_comm.rank, hetcomm_comm.size, svc, tags.HOSTCOLL)
    yield g
    g.close()
    svc.Free()


def _do(g: hostcoll.HostGroup, nbytes: int, fn, *args) -> None:
    deadline = time.monotonic() + 60
    assert g.run(g.ticket(), deadline, nbytes, fn, *args, deadline)


def _same_bits(comm, raw: np.ndarray, what: str) -> list[str]:
    every = comm.mpi.allgather(raw.tobytes())
    return [] if len(set(every)) == 1 else [f"{what}: the ranks got different bits"]


def _ops(dtype: str) -> list[ReduceOp]:
    return [op for op in ReduceOp if not (dtype == "bool" and op is ReduceOp.AVG)]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reductions(hetcomm_comm, group, rng, errors, dtype):
    n, r = hetcomm_comm.size, hetcomm_comm.rank
    counts = _counts(dtype, n)
    for count in counts:
        # every reduce op at the small counts and just past the whole/sharded boundary
        every_op = count <= 7 or count == counts[5]
        for op in _ops(dtype) if every_op else [ReduceOp.SUM, ReduceOp.MAX]:
            case = f"{dtype} {op} count {count}"
            stack = draw(rng, dtype, (count,), n)
            mine = as_bytes(stack[r], dtype)
            nbytes = mine.nbytes
            want = reference(stack, op, dtype)

            x, out = mine.copy(), Out(nbytes)
            _do(group, nbytes, group.all_reduce, x, out.array, nbytes, dtype, op)
            errors += compare(
                from_bytes(out.array, dtype),
                want,
                f"all_reduce {case}",
                stack=stack,
                op=op,
                dtype=dtype,
            )
            errors.expect(
                out.intact() and np.array_equal(x, mine), f"all_reduce {case}: wrote outside out"
            )
            errors += _same_bits(hetcomm_comm, out.array, f"all_reduce {case}")

            x = mine.copy()  # in place
            _do(group, nbytes, group.all_reduce, x, x, nbytes, dtype, op)
            errors += compare(
                from_bytes(x, dtype),
                want,
                f"all_reduce in place {case}",
                stack=stack,
                op=op,
                dtype=dtype,
            )

            root = count % n
            x, out = mine.copy(), Out(nbytes)
            at_root = out.array if r == root else None
            _do(group, nbytes, group.reduce, x, at_root, nbytes, dtype, op, root)
            if r == root:
                errors += compare(
                    from_bytes(out.array, dtype),
                    want,
                    f"reduce {case}",
                    stack=stack,
                    op=op,
                    dtype=dtype,
                )
            errors.expect(
                out.intact() and (r == root or (out.array == _SENTINEL).all()),
                f"reduce {case}: wrote outside the root's out",
            )

            # reduce_scatter: n blocks of `count` elements each
            big = draw(rng, dtype, (n * count,), n)
            x = as_bytes(big[r], dtype)
            out = Out(x.nbytes // n)
            _do(group, x.nbytes, group.reduce_scatter, x, out.array, x.nbytes, dtype, op)
            part = reference(big, op, dtype)[r * count : (r + 1) * count]
            errors += compare(
                from_bytes(out.array, dtype),
                part,
                f"reduce_scatter {case}",
                stack=big[:, r * count : (r + 1) * count],
                op=op,
                dtype=dtype,
            )
            errors.expect(out.intact(), f"reduce_scatter {case}: wrote outside out")
    errors.verify()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", ["bool", "int16", "float32", "bfloat16"])
def test_moves(hetcomm_comm, group, rng, errors, dtype):
    n, r = hetcomm_comm.size, hetcomm_comm.rank
    for count in _counts(dtype, n):
        case = f"{dtype} count {count}"
        stack = draw(rng, dtype, (count,), n)
        mine = as_bytes(stack[r], dtype)
        nbytes = mine.nbytes
        every = [as_bytes(stack[q], dtype) for q in range(n)]

        x, out = mine.copy(), Out(n * nbytes)
        _do(group, nbytes, group.all_gather, x, out.array, nbytes)
        errors.expect(
            np.array_equal(out.array, np.concatenate(every)) and out.intact(), f"all_gather {case}"
        )

        for root in sorted({0, n - 1}):
            out = Out(nbytes)
            src = mine.copy() if r == root else None
            dst = None if r == root else out.array
            _do(group, nbytes, group.broadcast, src, dst, nbytes, root)
            ok = (
                np.array_equal(out.array, every[root])
                if r != root
                else (out.array == _SENTINEL).all()
            )
            errors.expect(bool(ok) and out.intact(), f"broadcast root {root} {case}")

        # all_to_all: block j of rank q's input is draw(...)[q, j]
        blocks = draw(rng, dtype, (n, count), n)
        x = as_bytes(blocks[r], dtype)
        out = Out(x.nbytes)
        _do(group, x.nbytes, group.all_to_all, x, out.array, x.nbytes)
        want = np.concatenate([as_bytes(blocks[q][r], dtype) for q in range(n)])
        errors.expect(np.array_equal(out.array, want) and out.intact(), f"all_to_all {case}")
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_a_late_rank_is_named(hetcomm_comm, group, errors):
    """Rank 0 skips a barrier: every other rank's wait ends at its deadline with Late naming
    rank 0, not before."""
    _do(group, 64, group.barrier)  # the segment is made
    if hetcomm_comm.rank != 0:
        t0 = time.monotonic()
        try:
            _do_deadline(group, 0.5)
            errors.append("the barrier completed without rank 0")
        except hostcoll.Late as exc:
            waited = time.monotonic() - t0
            errors.expect(exc.ranks == [0], f"Late names {exc.ranks}, expected [0]")
            errors.expect(0.5 <= waited < 5, f"Late after {waited:.2f} s, expected 0.5 s")
    errors.verify()


def _do_deadline(g: hostcoll.HostGroup, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    g.run(g.ticket(), deadline, 64, g.barrier, deadline)


@pytest.mark.mpi(min_size=2)
def test_a_dead_rank_is_named_before_the_deadline(hetcomm_comm, group, errors):
    """The others see rank 0 as a process that has ended (its pid, as recorded at setup, is
    replaced by that of a child that has exited): their wait for it ends with Dead naming it,
    long before the deadline."""
    _do(group, 64, group.barrier)
    if hetcomm_comm.rank != 0:
        child = subprocess.Popen([sys.executable, "-c", "pass"])
        child.wait()
        group._pids[0] = (child.pid, 0)
        t0 = time.monotonic()
        try:
            _do_deadline(group, 30)
            errors.append("the barrier completed without rank 0")
        except hostcoll.Dead as exc:
            errors.expect(exc.ranks == [0], f"Dead names {exc.ranks}, expected [0]")
            errors.expect(time.monotonic() - t0 < 5, "Dead came late")
    errors.verify()


# ---- the staged transport -----------------------------------------------------------------------


@pytest.fixture
def staged(hetcomm_make_comm, monkeypatch):
    """A Communicator on the staged transport whose blocking host collectives take the
    segment's prepared calls (installed here where StagedTransport has no `prepare` yet)."""
    if getattr(StagedTransport, "prepare", None) is None:
        monkeypatch.setattr(
            StagedTransport,
            "prepare",
            lambda self, *args: segment.prepare(self, *args),
            raising=False,
        )
    comm = hetcomm_make_comm(transport="staged", timeout=60)
    _one_host(comm)
    if comm.config.rails.strip().lower() == "mpi":
        pytest.skip(
            "HETCOMM_RAILS=mpi asks staged for MPI messages: its collectives take no segment"
        )
    return comm


def _routes(comm, op):
    return [r for r in comm.routes() if r["op"] == op]


@pytest.mark.mpi(min_size=2)
def test_staged_blocking_and_async_calls_meet_in_the_segment(staged, rng, errors):
    """Blocking host collectives run on the calling thread (prepared, counted); asynchronous
    ones begin on the issuing thread (HostGroup.start) and end in a poll or wait, through the
    segment too; ranks that take either path for the same call still agree, and calls of both
    kinds in flight keep their order (a blocking call ends the one begun before it)."""
    n, r = staged.size, staged.rank
    for rnd in range(3):
        stack = draw(rng, "float64", (1000,), n)
        x = stack[r].copy()
        if (r + rnd) % 2:
            staged.all_reduce(x)
        else:
            staged.all_reduce(x, async_op=True).wait()
        errors += compare(
            x, stack.sum(0), f"round {rnd}", stack=stack, op=ReduceOp.SUM, dtype="float64"
        )
    # an asynchronous all_reduce, then a blocking all_gather, then the first's wait
    a = draw(rng, "int64", (300,), n)
    xa = a[r].copy()
    work = staged.all_reduce(xa, ReduceOp.MAX, async_op=True)
    g = np.full(5, r, np.int32)
    out = np.empty(5 * n, np.int32)
    staged.all_gather(out, g)
    work.wait()
    errors.expect(np.array_equal(xa, a.max(0)), "the asynchronous all_reduce")
    errors.expect(np.array_equal(out, np.repeat(np.arange(n, dtype=np.int32), 5)), "all_gather")
    runs = sum(rt["runs"] for rt in _routes(staged, "all_reduce"))
    errors.expect(runs >= 1, f"no all_reduce took the prepared call ({staged.routes()})")
    paths = introspect.transports(staged)["staged"].paths
    errors.expect(paths["issuing thread"] >= 2, f"no asynchronous call began here: {paths}")
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_staged_async_collectives_waited_for_run_on_the_waiting_thread(staged, rng, errors):
    """Every driver thread busy: asynchronous collectives waited for at once still complete,
    right: those that synchronise once begin on the issuing thread, the others (a reduction
    over REDUNDANT_MAX) are run by the waiting thread (Work.drive), as blocking calls would
    be; the drivers, freed, run what is queued after them."""
    n, r = staged.size, staged.rank
    staged.all_reduce(np.ones(1000))  # the transport and its segment made
    drivers = introspect.transports(staged)["staged"]._driver
    gate = threading.Event()
    release = threading.Timer(20.0, gate.set)  # a failing steal ends here, not in a hang
    release.start()
    until = time.monotonic() + 60
    blockers = [drivers.submit(lambda by: gate.wait(), until) for _ in drivers._threads]
    try:
        t0 = time.monotonic()
        staged_t = introspect.transports(staged)["staged"]
        begun, queued = staged_t.paths["issuing thread"], drivers.submitted
        # (each above what rides in the check's records: hetcomm.carried)
        for count, dtype in ((50, "float64"), (1000, "int32"), (5000, "float64")):
            stack = draw(rng, dtype, (count,), n)
            x = stack[r].astype(dtype)
            staged.all_reduce(x, async_op=True).wait()
            errors += compare(
                x.astype(float), stack.sum(0), f"{count} {dtype}", stack=stack, dtype=dtype
            )
            out = np.full(count * n + 1, -1, dtype)
            staged.all_gather(out[:-1], stack[r].astype(dtype), async_op=True).wait()
            want = stack.reshape(-1).astype(dtype)
            errors.expect(np.array_equal(out[:-1], want), f"all_gather {count}")
            errors.expect(out[-1] == -1, "all_gather wrote past its output")
        errors.expect(not gate.is_set(), "the collectives waited for the busy drivers")
        begun = staged_t.paths["issuing thread"] - begun
        errors.expect(begun == 5, f"{begun} of 5 begun on the issuing thread")
        errors.expect(drivers.submitted - queued == 1, "the large all_reduce was not queued")
        errors.expect(time.monotonic() - t0 < 15, "the collectives took as long as the drivers")
    finally:
        gate.set()
        release.cancel()
    errors.expect(all(b.wait(10) for b in blockers), "the drivers did not come back")
    x = np.full(3, float(r + 1))
    work = staged.all_reduce(x, async_op=True)
    work.wait()
    errors.expect(np.array_equal(x, np.full(3, n * (n + 1) / 2)), "after the drivers came back")
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_staged_every_async_collective_begun_on_the_issuing_thread(staged, rng, errors):
    """Every collective, asynchronous, several in flight, on host arrays the segment takes:
    each begins on the issuing thread where the one before has ended (here at least the
    first; the others on a driver), all end in order (a later one ends the earlier ones
    first), right against numpy, nothing written beside their outputs. Then each alone,
    waited for at once: every one begins on the issuing thread."""
    n, r = staged.size, staged.rank
    staged.all_reduce(np.ones(1000))  # the segment made
    paths = introspect.transports(staged)["staged"].paths
    begun = paths["issuing thread"]
    count = 48 * n  # above what rides in the check's records (hetcomm.carried)
    stack = draw(rng, "float64", (count,), n)
    mine = stack[r].copy()
    pad = np.full(1, -7.0)

    def padded(size: int) -> np.ndarray:
        return np.concatenate([np.full(size, -1.0), pad])

    x_ar = mine.copy()
    o_ar, o_ag, o_rs, o_aa = padded(count), padded(count * n), padded(count // n), padded(count)
    x_bc = mine.copy() if r == 0 else np.zeros(count)
    x_rd = mine.copy()
    works = [
        staged.all_reduce(x_ar, ReduceOp.MAX, async_op=True),
        staged.all_reduce(mine, out=o_ar[:-1], async_op=True),
        staged.broadcast(x_bc, 0, async_op=True),
        staged.reduce(x_rd, n - 1, async_op=True),
        staged.all_gather(o_ag[:-1], mine, async_op=True),
        staged.reduce_scatter(o_rs[:-1], mine, async_op=True),
        staged.all_to_all(o_aa[:-1], mine, async_op=True),
    ]
    for w in reversed(works):  # the last waited for first: it ends every earlier one
        w.wait()
    errors.expect(np.array_equal(x_ar, stack.max(0)), "all_reduce MAX")
    errors += compare(o_ar[:-1], stack.sum(0), "all_reduce out", stack=stack, dtype="float64")
    errors.expect(np.array_equal(x_bc, stack[0]), "broadcast")
    if r == n - 1:
        errors += compare(x_rd, stack.sum(0), "reduce", stack=stack, dtype="float64")
    else:
        errors.expect(np.array_equal(x_rd, mine), "reduce changed a non-root's input")
    errors.expect(np.array_equal(o_ag[:-1], stack.reshape(-1)), "all_gather")
    part = count // n
    block = stack[:, r * part : (r + 1) * part]
    errors += compare(o_rs[:-1], block.sum(0), "reduce_scatter", stack=block, dtype="float64")
    want_aa = block.reshape(-1)
    errors.expect(np.array_equal(o_aa[:-1], want_aa), "all_to_all")
    for o in (o_ar, o_ag, o_rs, o_aa):
        errors.expect(o[-1] == -7.0, "wrote past an output")
    errors.expect(np.array_equal(mine, stack[r]), "an input changed")
    began = paths["issuing thread"] - begun
    errors.expect(began >= 1, "none begun on the issuing thread")
    begun = paths["issuing thread"]
    for w in works:
        w.wait()  # done already: their Works say so again
    ones = [
        lambda: staged.all_reduce(x_ar, async_op=True),
        lambda: staged.broadcast(x_bc, 0, async_op=True),
        lambda: staged.reduce(x_rd, 0, async_op=True),
        lambda: staged.all_gather(o_ag[:-1], mine, async_op=True),
        lambda: staged.reduce_scatter(o_rs[:-1], mine, async_op=True),
        lambda: staged.all_to_all(o_aa[:-1], mine, async_op=True),
    ]
    for one in ones:
        one().wait()
    began = paths["issuing thread"] - begun
    errors.expect(began == len(ones), f"{began} of {len(ones)} begun on the issuing thread")
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_staged_async_collective_nobody_polls_holds_no_rank_back(staged, errors):
    """Rank 0 begins an asynchronous all_reduce and blocks in a receive that rank 1 sends only
    once its own all_reduce has ended: rank 0's arrival, published when it began, is all the
    others need; rank 0's result lands when it waits."""
    n, r = staged.size, staged.rank
    staged.all_reduce(np.ones(1000))  # the segment made
    x = np.full(4, float(r + 1))
    got = np.zeros(1)
    work = staged.all_reduce(x, async_op=True)
    if r == 0:
        staged.recv(got, 1, tag=5)
        errors.expect(got[0] == 42.0, f"received {got[0]}")
        work.wait()
    else:
        work.wait()
        if r == 1:
            staged.send(np.full(1, 42.0), 0, tag=5)
    errors.expect(np.array_equal(x, np.full(4, n * (n + 1) / 2)), "the all_reduce")
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_staged_large_and_small_sizes(staged, rng, errors):
    """Sizes over the segment's limit take the rings; sizes under it the segment (which
    grows on the way), all right, every rank with the same bits."""
    n, r = staged.size, staged.rank
    for count in (3, 70_000, segment.SEGMENT_MAX_BYTES // 4 + 1, 1 << 16):
        stack = draw(rng, "float32", (count,), n)
        x = stack[r].astype(np.float32)
        staged.all_reduce(x)
        errors += compare(
            x.astype(float),
            stack.sum(0),
            f"count {count}",
            stack=stack,
            op=ReduceOp.SUM,
            dtype="float32",
        )
        errors += _same_bits(staged, x.view(np.uint8), f"count {count}")
    errors.verify()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("how", ["blocking", "async"])
def test_staged_timeout_names_the_missing_rank(staged, errors, how):
    """A rank that never comes: the others' all_reduce (check off, so the segment is what
    waits), blocking or begun asynchronously on the calling thread and waited for, raises
    CommTimeout naming it, and the communicator is aborted."""
    staged.all_reduce(np.ones(1000))  # the segment made (too large to travel in the check)
    creator = staged.mpi.bcast(os.getpid(), root=0)
    staged._checking = False
    staged._transports.live["staged"].timeout = 1.0  # read when a signature's call is prepared
    if staged.rank != 0:
        t0 = time.monotonic()
        try:
            if how == "blocking":
                staged.all_reduce(np.ones(1001))
            else:
                staged.all_reduce(np.ones(1001), async_op=True).wait()
            errors.append("all_reduce completed without rank 0")
        except CommTimeout as exc:
            errors.expect(exc.missing == (0,), f"CommTimeout names {exc.missing}")
            took = time.monotonic() - t0
            errors.expect(took < 10, f"the transport's 1 s timeout took {took:.1f} s")
            errors.expect(staged._aborted is not None, "the communicator was not aborted")
    staged.mpi.Barrier()
    left = [f for f in os.listdir("/dev/shm") if f.startswith(f"hetcomm-hc-{creator}-")]
    errors.expect(not left, f"segments left in /dev/shm: {left}")
    errors.verify()


class HostMemoryGpu:
    """A stand-in for the staging device whose "device memory" is host memory: its copies are
    memmoves, counted, so that the staged bodies' device plumbing (copy into this rank's half,
    a pinned result buffer copied back) runs without a GPU."""

    device = 0

    def __init__(self) -> None:
        self.d2h = self.h2d = 0

    def copy_to_host(self, dst, src, ready) -> None:
        ctypes.memmove(dst.ctypes.data, src.dev, src.nbytes)
        self.d2h += 1

    def copy_from_host(self, dst, src, ready) -> None:
        ctypes.memmove(dst.dev, src.ctypes.data, dst.nbytes)
        self.h2d += 1

    @contextlib.contextmanager
    def bounce(self, nbytes):
        yield np.full(nbytes, _SENTINEL, np.uint8)


def _device(a: np.ndarray) -> Buffer:
    """`a` described as device memory (no host view): the staged bodies see a pointer only."""
    b = as_buffer(a)
    return Buffer(
        obj=a,
        kind="cuda",
        dtype=b.dtype,
        shape=b.shape,
        device="cuda",
        device_index=0,
        ptr=a.ctypes.data,
        contiguous=True,
        readonly=False,
        host=None,
    )


@pytest.mark.mpi(min_size=2)
def test_staged_device_bodies_copy_through_the_segment(staged, rng, errors, monkeypatch):
    """The staged bodies of device collectives: the input copied into this rank's half, the
    segment registered with the device, the result copied back; every op right."""
    n, r = staged.size, staged.rank
    staged.all_reduce(np.ones(3))  # the transport made
    t = staged._transports.live["staged"]
    gpu = HostMemoryGpu()
    registered = []
    monkeypatch.setattr(t, "gpu", gpu)
    monkeypatch.setattr(hostcoll.HostGroup, "register_with_gpu", lambda g, d: registered.append(d))
    seq = 1000

    def run(body) -> None:
        body(time.monotonic() + 60, None)

    count = 37
    stack = draw(rng, "float32", (n * count,), n).astype(np.float32)
    x = stack[r].copy()
    out = np.zeros_like(x)
    run(collectives.all_reduce(t, _device(x), _device(out), ReduceOp.SUM, seq))
    errors += compare(
        out.astype(float),
        stack.astype(float).sum(0),
        "all_reduce",
        stack=stack.astype(float),
        op=ReduceOp.SUM,
        dtype="float32",
    )
    errors.expect(np.array_equal(x, stack[r]), "all_reduce changed x")

    y = stack[r].copy()
    run(collectives.reduce(t, _device(y), ReduceOp.MAX, n - 1, seq + 1))
    want = stack.max(0) if r == n - 1 else stack[r]
    errors.expect(np.array_equal(y, want), "reduce")

    b = stack[r].copy()
    run(collectives.broadcast(t, _device(b), 0, seq + 2))
    errors.expect(np.array_equal(b, stack[0]), "broadcast")

    mine = stack[r].copy()  # kept alive while the bodies read it through its pointer
    g = np.zeros(n * n * count, np.float32)
    run(collectives.all_gather(t, _device(g), _device(mine), seq + 3))
    errors.expect(np.array_equal(g, stack.reshape(-1)), "all_gather")

    part = np.zeros(count, np.float32)
    run(collectives.reduce_scatter(t, _device(part), _device(mine), ReduceOp.SUM, seq + 4))
    sums = stack.astype(float).sum(0)[r * count : (r + 1) * count]
    errors += compare(
        part.astype(float),
        sums,
        "reduce_scatter",
        stack=stack[:, r * count : (r + 1) * count].astype(float),
        op=ReduceOp.SUM,
        dtype="float32",
    )

    a2a = np.zeros(n * count, np.float32)
    run(collectives.all_to_all(t, _device(a2a), _device(mine), seq + 5))
    want = np.concatenate([stack[q][r * count : (r + 1) * count] for q in range(n)])
    errors.expect(np.array_equal(a2a, want), "all_to_all")

    # one copy in per op (the broadcast's at its root only), one back where a result lands here
    errors.expect(gpu.d2h == 5 + (r == 0), f"{gpu.d2h} copies into the segment")
    errors.expect(gpu.h2d == 5 + (r == n - 1) - (r == 0), f"{gpu.h2d} copies back")
    errors.expect(registered and set(registered) == {0}, f"registered with {registered}")
    errors.verify()
