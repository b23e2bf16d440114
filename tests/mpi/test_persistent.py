"""Small all-reduces of the mpi transport through cached MPI-4 persistent requests.

A persistent all-reduce matches only the same persistent all-reduce on the other ranks: ranks
that disagree about taking one hang (or, bounded by the communicator's timeout, fail). So here
each rank calls with arrays of its own form, drawn from a generator of its own (numpy or torch,
in place or out=, contiguous or strided, blocking or asynchronous, its lane busy or idle), while
the sequence of dtypes, counts and ops is the same everywhere; every result is checked against a
float64 numpy reference of every rank's inputs, with sentinels around each array. The MPI calls
of the transport are counted: a small all-reduce of a kind MPI reduces itself never becomes an
Iallreduce or an Allreduce.
"""

from __future__ import annotations

import time
from collections import Counter
from functools import partial
from typing import Any

import numpy as np
import pytest
from _data import Placed, compare, draw, reference
from mpi4py import MPI

from hetcomm import ReduceOp, introspect
from hetcomm.transports.mpi import persistent as mpi_persistent
from hetcomm.transports.mpi.datatypes import PERSISTENT
from hetcomm.transports.mpi.schedule import LANE_BYTES
from hetcomm.transports.mpi.transport import MpiTransport

pytestmark = pytest.mark.mpi(min_size=2)

# dtypes of the sequence: bool, integers and the floats MPI has go the persistent path (but for
# the integer ops MPI gets wrong); float16, reduced by hetcomm's own kernels, does not
_DTYPES = ("bool", "int8", "uint8", "int32", "int64", "float32", "float64", "float16")
_LIMIT = 16 * 1024  # HETCOMM_PERSISTENT_MAX of these tests
_COUNTS = (1, 2, 3, 6, 8, 15, 64, 1000)  # 1000 float64: 8000 bytes, within the limit
_LARGE = LANE_BYTES // 8 + 1000  # float64 elements of an all-reduce that runs on the lane


# where this MPI has no persistent collectives (Open MPI 4.1: MPI 3.1), why; the tests of the
# cache itself skip, the sequences run on the non-persistent path
_NO_PERSISTENT = mpi_persistent.unavailable()
_needs_persistent = pytest.mark.skipif(
    _NO_PERSISTENT is not None, reason=f"no persistent collectives: {_NO_PERSISTENT}"
)


@pytest.fixture(autouse=True)
def _mpi_transport_runs(hetcomm_transport: str) -> None:
    if hetcomm_transport not in ("auto", "mpi"):
        # these tests ask for the mpi transport themselves: the same run as on 'auto'
        pytest.skip(f"covers the mpi transport: runs on auto and mpi, not {hetcomm_transport}")


class _Counting:
    """The transport's MPI communicator, counting the calls made on it by name."""

    def __init__(self, mpi: MPI.Intracomm) -> None:
        self._mpi = mpi
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._mpi, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return attr(*args, **kwargs)

        return call


def counted(comm: Any) -> tuple[MpiTransport, Counter[str]]:
    """The communicator's mpi transport, made here so that its MPI calls are counted."""
    transport = comm._transports.live["mpi"] = MpiTransport(comm)
    counting = _Counting(transport._mpi)
    transport._mpi = transport.requests._mpi = transport._prepared._mpi = counting
    return transport, counting.calls


def ops_for(dtype: str) -> list[ReduceOp]:
    return [op for op in ReduceOp if not (dtype == "bool" and op is ReduceOp.AVG)]


class Call:
    """One small all-reduce, the same on every rank but for the form this rank gives it."""

    def __init__(
        self, shared: np.random.Generator, mine: np.random.Generator, size: int, rank: int
    ) -> None:
        self.rank = rank
        self.dtype = str(shared.choice(_DTYPES))
        count = int(shared.choice(_COUNTS))
        ops = ops_for(self.dtype)
        self.op = ops[int(shared.integers(len(ops)))]
        # this rank's form: 2-D shapes allow a transposed layout, 1-D ones a strided one
        two_d = count % 3 == 0 and count > 3 and mine.random() < 0.5
        shape = (3, count // 3) if two_d else (count,)
        layout = str(mine.choice(["contiguous", "transposed" if two_d else "strided"]))
        lib = str(mine.choice(["numpy", "torch"]))
        self.form = str(mine.choice(["in place", "in place", "out=", "out=x"]))
        self.async_op = bool(mine.random() < 0.3)
        self.stack = draw(shared, self.dtype, shape, size)
        self.x = Placed(self.stack[rank], self.dtype, lib, layout)
        self.out = (
            Placed(draw(mine, self.dtype, shape, 1)[0], self.dtype, lib, layout)
            if self.form == "out="
            else None
        )
        self.what = f"{self.op} of {lib} {self.dtype}{list(shape)} {layout} {self.form}" + (
            " async" if self.async_op else ""
        )

    def start(self, comm: Any) -> Any:
        out = {"out=": self.out.array if self.out else None, "out=x": self.x.array}.get(self.form)
        return comm.all_reduce(self.x.array, self.op, out=out, async_op=self.async_op)

    def check(self) -> list[str]:
        got = self.out if self.out is not None else self.x
        want = reference(self.stack, self.op, self.dtype)
        found = compare(
            got.values(), want, self.what, stack=self.stack, op=self.op, dtype=self.dtype
        )
        if self.out is not None:
            found += compare(self.x.values(), self.stack[self.rank], f"{self.what}: x changed")
        if not (self.x.intact() and (self.out is None or self.out.intact())):
            found.append(f"{self.what}: wrote outside the array")
        return found

    @property
    def persistent(self) -> bool:
        """Whether the mpi transport runs this one as a persistent request: MPI reduces its
        (dtype, op) with a predefined operation (every size of _COUNTS is within _LIMIT)."""
        return (self.dtype, self.op.value) in PERSISTENT


def _large(comm: Any, rng: np.random.Generator) -> tuple[Any, np.ndarray, np.ndarray]:
    """An asynchronous all-reduce that runs on the lane thread. Odd ranks issue it late and wait
    for it, even ranks go on at once: the calls that come next find the lane idle on odd ranks
    and busy (blocked in this one) on even ranks."""
    stack = rng.standard_normal((comm.size, _LARGE))
    x = stack[comm.rank].copy()
    if comm.rank % 2:
        time.sleep(0.005)
    work = comm.all_reduce(x, async_op=True)
    if comm.rank % 2:
        work.wait()
    return work, x, stack


def _broadcast(comm: Any, rng: np.random.Generator, what: str) -> list[str]:
    """A small broadcast: not an all-reduce, and non-blocking whatever the lane's state."""
    root = int(rng.integers(comm.size))
    sent = rng.integers(-9, 9, size=5)  # drawn on every rank: the sequence stays one
    b = sent.copy() if comm.rank == root else np.zeros(5, np.int64)
    comm.broadcast(b, root)
    return compare(b, sent, f"{what}: broadcast from {root}")


def _behind_the_lane(comm: Any, rng: np.random.Generator, count: int, what: str) -> list[str]:
    """Right after _large, while the lane is busy on even ranks only: an asynchronous
    broadcast, then a small all-reduce of a count not seen before (its request is made now,
    within _LIMIT) in place, then one out of place, then the broadcast is waited for."""
    root = int(rng.integers(comm.size))
    sent = rng.integers(-9, 9, size=5)
    b = sent.copy() if comm.rank == root else np.zeros(5, np.int64)
    work = comm.broadcast(b, root, async_op=True)
    stack = rng.integers(-99, 99, (comm.size, count))
    x = stack[comm.rank].copy()
    comm.all_reduce(x)
    found = compare(x, stack.sum(0), f"{what}: new request behind the lane")
    y = np.zeros(count, np.int64)
    comm.all_reduce(stack[comm.rank], out=y)
    found += compare(y, stack.sum(0), f"{what}: out= behind the lane")
    work.wait()
    return found + compare(b, sent, f"{what}: asynchronous broadcast from {root}")


def _settle(pending: list[tuple[Any, Any]], errors: Any) -> None:
    """Wait for the asynchronous calls issued so far and check each."""
    for work, done in pending:
        if work is not None:
            errors.run(f"wait: {done.what}", work.wait)
        errors.extend(done.check())
    pending.clear()


def _check_larges(larges: list[tuple[Any, np.ndarray, np.ndarray]], errors: Any) -> None:
    """Wait for the large all-reduces of _large and check each."""
    for j, (work, x, stack) in enumerate(larges):
        work.wait()
        errors.extend(
            compare(
                x,
                stack.sum(0),
                f"large all_reduce {j}",
                stack=stack,
                op=ReduceOp.SUM,
                dtype="float64",
            )
        )


def test_every_rank_its_own_form(hetcomm_make_comm, hetcomm_shared_seed, errors):
    """Small all-reduces of every kind, each rank in forms of its own, among broadcasts,
    float16 all-reduces (not persistent) and large ones on the lane (see the module's
    docstring); a mismatch between ranks fails within the communicator's timeout."""
    comm = hetcomm_make_comm(
        transport="mpi", name="persistent-forms", timeout=20, persistent_max=_LIMIT, check=False
    )
    transport, calls = counted(comm)
    shared = np.random.default_rng(hetcomm_shared_seed)
    mine = np.random.default_rng([hetcomm_shared_seed, comm.rank])
    pending: list[tuple[Any, Call]] = []
    larges, others = [], 0
    for i in range(160):
        step = shared.random()
        if step < 0.06:
            larges.append(_large(comm, shared))
            others += 1
            errors += _behind_the_lane(comm, shared, 1000 + i, f"step {i}")
            continue
        if step < 0.1:
            errors += _broadcast(comm, shared, f"step {i}")
            continue
        call = Call(shared, mine, comm.size, comm.rank)
        others += not call.persistent
        if not errors.run(
            f"step {i}: {call.what}", lambda c=call: pending.append((c.start(comm), c))
        ):
            continue
        # each rank waits for its asynchronous calls at moments of its own
        if pending and mine.random() < 0.3:
            _settle(pending, errors)
    _settle(pending, errors)
    _check_larges(larges, errors)
    if _NO_PERSISTENT is None:  # else: the same sequence on the non-persistent path
        # every small one of a kind MPI reduces itself went through a persistent request
        plain = calls["Iallreduce"] + calls["Allreduce"]
        errors.expect(
            plain == others,
            f"{plain} Iallreduce/Allreduce calls for {others} "
            f"all-reduces outside the persistent path ({dict(calls)})",
        )
        inits = sum(calls[name] for name in mpi_persistent.INITS.values())
        errors.expect(
            inits == transport.requests.made > 0 and calls["Allreduce_init"] > 0,
            f"requests made: {transport.requests.made}, inits: {dict(calls)}",
        )
    errors.verify()


@_needs_persistent
def test_more_keys_than_the_cache_holds(hetcomm_make_comm, hetcomm_shared_seed, errors):
    """Cycling through more keys than the cache holds evicts (and frees) the least recently
    used one each time; a key used between every two others stays. An asynchronous call still
    in flight when its request is evicted completes first, with its result."""
    comm = hetcomm_make_comm(
        transport="mpi", name="persistent-lru", timeout=60, persistent_max=_LIMIT, check=False
    )
    transport, calls = counted(comm)
    requests, cap = transport.requests, mpi_persistent.CAPACITY
    rng = np.random.default_rng(hetcomm_shared_seed)
    n, me = comm.size, comm.rank
    first = rng.integers(-50, 50, (n, 500))
    early = first[me].astype(np.int32)
    work = comm.all_reduce(early, async_op=True)
    # the hot key is of the kind made first (int32 SUM, like the early call), the cold ones of
    # another (int32 MAX): the eviction order must be by use, not by kind or by age
    hot_stack = rng.integers(-50, 50, (n, 999))
    counts = range(1, cap + 11)
    for rnd in range(2):
        for k in counts:
            hot = hot_stack[me].astype(np.int32)
            comm.all_reduce(hot)
            errors += compare(hot, hot_stack.sum(0), f"round {rnd}: hot key")
            stack = rng.integers(-50, 50, (n, k))
            x = stack[me].astype(np.int32)
            comm.all_reduce(x, ReduceOp.MAX)
            errors += compare(x, stack.max(0), f"round {rnd}: {k} elements")
        if rnd == 0:
            work.wait()
            errors += compare(early, first.sum(0), "the call evicted in flight")
    cold = 2 * len(counts) + 1  # every cold key, twice (each evicted before its next use) + 500
    errors.expect(requests.made == cold + 1, f"made {requests.made}, expected {cold + 1}")
    errors.expect(
        requests.freed == requests.made - cap and len(requests) == cap,
        f"freed {requests.freed}, cached {len(requests)} of {requests.made}",
    )
    errors.expect(calls["Iallreduce"] + calls["Allreduce"] == 0, f"plain calls: {dict(calls)}")
    errors.verify()


@_needs_persistent
def test_requests_are_reused_and_freed_on_close(hetcomm_make_comm, errors):
    """One request serves every call of its key, on the short path and the general one alike;
    closing the communicator frees it."""
    comm = hetcomm_make_comm(
        transport="mpi", name="persistent-close", persistent_max=_LIMIT, check=False
    )
    transport, calls = counted(comm)
    n = comm.size
    for i in range(50):
        x = np.full(2, float(i), np.float32)
        comm.all_reduce(x)
        errors.expect((x == i * n).all(), f"in place {i}: {x}")
    for i in range(20):
        x, out = np.full(2, float(i), np.float32), np.zeros(2, np.float32)
        comm.all_reduce(x, out=out)
        errors.expect((out == i * n).all(), f"out= {i}: {out}")
    x = np.full(2, 3.0, np.float32)
    comm.all_reduce(x, ReduceOp.AVG)
    errors.expect((x == 3).all(), f"AVG through SUM's request: {x}")
    requests = transport.requests
    errors.expect(
        requests.made == 1 and requests.uses >= 71, f"made {requests.made}, uses {requests.uses}"
    )
    errors.expect(
        calls["Allreduce_init"] == 1 and calls["Iallreduce"] == 0, f"MPI calls: {dict(calls)}"
    )
    slots = introspect.persistent_requests(transport)
    comm.close()
    errors.expect(
        requests.freed == 1 and len(requests) == 0,
        f"after close: freed {requests.freed}, cached {len(requests)}",
    )
    errors.expect(all(s.request == MPI.REQUEST_NULL for s in slots), "a request was not freed")
    errors.verify()


@pytest.mark.parametrize("why", ["limit 0", "no persistent collectives"])
def test_off(hetcomm_make_comm, errors, monkeypatch, why):
    """With HETCOMM_PERSISTENT_MAX=0, or an MPI without persistent collectives, small
    all-reduces are Iallreduce calls on the caller's arrays, as before."""
    options: dict[str, Any] = {}
    if why == "limit 0":
        options["persistent_max"] = 0
    else:
        monkeypatch.setattr(mpi_persistent, "unavailable", lambda: "MPI 3.1")
    comm = hetcomm_make_comm(transport="mpi", name="persistent-off", check=False, **options)
    transport, calls = counted(comm)
    errors.expect(
        (transport.persistent_off == "MPI 3.1") == (why != "limit 0"),
        f"reason: {transport.persistent_off}",
    )
    for i in range(5):
        x = np.full(3, float(i))
        comm.all_reduce(x)
        y = np.zeros(3)
        comm.all_reduce(x, out=y)
        errors.expect((x == i * comm.size).all() and (y == i * comm.size**2).all(), f"{i}: {x}")
    errors.expect(
        calls["Allreduce_init"] == 0 and calls["Iallreduce"] == 10, f"MPI calls: {dict(calls)}"
    )
    errors.verify()


@pytest.mark.parametrize("then", ["dup", "split", "fingerprint"])
def test_calls_outside_the_transport_come_after_the_lane(
    hetcomm_make_comm, hetcomm_shared_seed, errors, then
):
    """MPI_Comm_dup, MPI_Comm_split and the debug fingerprints are collectives of the
    communicator's MPI communicator too: made while the lane still holds small collectives on
    some ranks only, they must come after those everywhere. Even ranks' lanes are kept busy by
    a job of their own (a sleep), so that the small collectives queue there and run at once on
    odd ranks."""
    comm = hetcomm_make_comm(
        transport="mpi",
        name="persistent-outside",
        timeout=20,
        persistent_max=_LIMIT,
        debug=then == "fingerprint",
    )
    transport, _ = counted(comm)
    lane = introspect.lane(transport)
    rng = np.random.default_rng(hetcomm_shared_seed)
    n, me = comm.size, comm.rank
    for i in range(3):
        if me % 2 == 0:
            with lane.lock:
                lane.submit(partial(time.sleep, 0.05))
        sent = rng.integers(-9, 9, size=4)
        b = sent.copy() if me == 0 else np.zeros(4, np.int64)
        wb = comm.broadcast(b, 0, async_op=True)
        stack = rng.integers(-99, 99, (n, 100 + i))  # a new count: its request is made now
        x = stack[me].copy()
        wx = comm.all_reduce(x, async_op=True)
        y = np.full(3, float(me))
        if then == "fingerprint":
            other = None
            comm.all_reduce(y)  # its fingerprint is exchanged first
        else:
            other = comm.dup(name="outside") if then == "dup" else comm.split(0, name="outside")
            other.all_reduce(y)
        errors.expect((y == n * (n - 1) / 2).all(), f"{then} {i}: {y}")
        for w in (wb, wx):
            w.wait()
        errors += compare(b, sent, f"{then} {i}: broadcast")
        errors += compare(x, stack.sum(0), f"{then} {i}: all_reduce")
        if other is not None:
            other.close()
    errors.verify()


# the other small collectives, each with the non-blocking MPI call it replaces
_NONBLOCKING = {
    "reduce": "Ireduce",
    "broadcast": "Ibcast",
    "all_gather": "Iallgather",
    "reduce_scatter": "Ireduce_scatter_block",
    "all_to_all": "Ialltoall",
    "barrier": "Ibarrier",
}
_BLOCKS = (1, 2, 3, 5, 16, 100)  # elements per rank's block: 100 x 8 x 4 ranks within _LIMIT


class Collective:
    """One small collective other than the all-reduce, the same on every rank but for the
    form this rank gives it: numpy or torch, contiguous or strided input, blocking or not, the
    in-place forms where the op has them."""

    def __init__(
        self, shared: np.random.Generator, mine: np.random.Generator, size: int, rank: int
    ) -> None:
        self.rank, self.size = rank, size
        self.op = str(shared.choice(list(_NONBLOCKING)))
        self.dtype = str(shared.choice(_DTYPES))
        block = int(shared.choice(_BLOCKS))
        ops = ops_for(self.dtype)
        self.rop = ops[int(shared.integers(len(ops)))]
        self.root = int(shared.integers(size))
        lib = str(mine.choice(["numpy", "torch"]))
        self.async_op = bool(mine.random() < 0.3)
        self.in_place = bool(mine.random() < 0.4) and self.op in (
            "all_gather",
            "reduce_scatter",
            "all_to_all",
        )
        layout = "contiguous" if self.in_place else str(mine.choice(["contiguous", "strided"]))
        n_in = block * (size if self.op in ("reduce_scatter", "all_to_all") else 1)
        self.stack = draw(shared, self.dtype, (n_in,), size)
        self.x = self.out = None
        self.what = (
            f"{self.op} of {lib} {self.dtype}[{n_in}] {layout}"
            + (" in place" if self.in_place else "")
            + (" async" if self.async_op else "")
        )
        if self.op == "barrier":
            return
        mine_in = self.stack[rank] if self.op != "broadcast" or rank == self.root else None
        if mine_in is None:  # a broadcast's receiver: its input is overwritten
            mine_in = draw(mine, self.dtype, (n_in,), 1)[0]
        if self.op in ("reduce", "broadcast"):
            self.x = Placed(mine_in, self.dtype, lib, layout)
            return
        n_out = {"all_gather": block * size, "reduce_scatter": block, "all_to_all": n_in}[self.op]
        if not self.in_place:
            self.x = Placed(mine_in, self.dtype, lib, layout)
            self.out = Placed(draw(mine, self.dtype, (n_out,), 1)[0], self.dtype, lib, layout)
            return
        if self.op == "reduce_scatter":  # out is this rank's block of x
            self.x = Placed(mine_in, self.dtype, lib, layout)
            self._out_view = self.x.array[rank * block : (rank + 1) * block]
        elif self.op == "all_gather":  # x is this rank's block of out
            self.out = Placed(draw(mine, self.dtype, (n_out,), 1)[0], self.dtype, lib, layout)
            self.out.array[rank * block : (rank + 1) * block] = Placed(
                mine_in, self.dtype, lib, layout
            ).array
        else:  # all_to_all: out is x
            self.x = Placed(mine_in, self.dtype, lib, layout)
        self.block = block

    def start(self, comm: Any) -> Any:
        a = self.async_op
        if self.op == "barrier":
            return comm.barrier(async_op=a)
        if self.op == "reduce":
            return comm.reduce(self.x.array, self.root, self.rop, async_op=a)
        if self.op == "broadcast":
            return comm.broadcast(self.x.array, self.root, async_op=a)
        if not self.in_place:
            args: tuple = (self.out.array, self.x.array)
        elif self.op == "reduce_scatter":
            args = (self._out_view, self.x.array)
        elif self.op == "all_gather":
            b, r = self.block, self.rank
            args = (self.out.array, self.out.array[r * b : (r + 1) * b])
        else:
            args = (self.x.array, self.x.array)
        if self.op == "reduce_scatter":
            return comm.reduce_scatter(*args, self.rop, async_op=a)
        return getattr(comm, self.op)(*args, async_op=a)

    def check(self) -> list[str]:
        stack, rank, what = self.stack, self.rank, self.what
        if self.op == "barrier":
            return []
        found: list[str] = []
        if self.op == "reduce":
            if rank == self.root:
                want = reference(stack, self.rop, self.dtype)
                found += compare(
                    self.x.values(), want, what, stack=stack, op=self.rop, dtype=self.dtype
                )
            else:
                found += compare(self.x.values(), stack[rank], f"{what}: x changed off the root")
        elif self.op == "broadcast":
            found += compare(self.x.values(), stack[self.root], what)
        elif self.op == "all_gather":
            found += compare(self.out.values(), stack.reshape(-1), what)
        else:
            n = stack.shape[1] // self.size
            if self.op == "reduce_scatter":
                full = reference(stack, self.rop, self.dtype)
                got = self.x.values()[rank * n : (rank + 1) * n] if self.in_place else None
                got = self.out.values() if got is None else got
                found += compare(
                    got,
                    full[rank * n : (rank + 1) * n],
                    what,
                    stack=stack[:, rank * n : (rank + 1) * n],
                    op=self.rop,
                    dtype=self.dtype,
                )
            else:
                want = stack[:, rank * n : (rank + 1) * n].reshape(-1)
                got = self.x.values() if self.in_place else self.out.values()
                found += compare(got, want, what)
            if not self.in_place:
                found += compare(self.x.values(), stack[rank], f"{what}: x changed")
        for p in (self.x, self.out):
            if p is not None and not p.intact():
                found.append(f"{what}: wrote outside the array")
        return found

    @property
    def persistent(self) -> bool:
        """Whether the mpi transport runs this one as a persistent request (see
        MpiTransport._recipe): the library has the form; reductions of a kind MPI reduces
        itself; data of a dtype numpy holds as itself (not float16)."""
        if _NO_PERSISTENT is not None or self.op in mpi_persistent.missing():
            return False
        if self.op == "barrier":
            return True
        if self.op in ("reduce", "reduce_scatter"):
            return (self.dtype, self.rop.value) in PERSISTENT
        return self.dtype != "float16"


@pytest.mark.parametrize("check", [False, True], ids=["unchecked", "checked"])
def test_every_collective_its_own_form(hetcomm_make_comm, hetcomm_shared_seed, errors, check):
    """Small reduces, broadcasts, all-gathers, reduce-scatters, all-to-alls and barriers, each
    rank in forms of its own (in place or not, strided, numpy or torch, blocking or not),
    among large all-reduces that keep the lane busy on some ranks: each small one of a form
    MPI holds is its persistent request, on the prepared path and the general one alike (no
    non-blocking call of its kind is made), and every result is right. With the check on, a
    small blocking collective that every rank makes may ride in the check's records instead
    (hetcomm.carried), making no MPI call at all."""
    comm = hetcomm_make_comm(
        transport="mpi",
        name="persistent-collectives",
        timeout=20,
        persistent_max=_LIMIT,
        check=check,
    )
    transport, calls = counted(comm)
    shared = np.random.default_rng(hetcomm_shared_seed)
    mine = np.random.default_rng([hetcomm_shared_seed, comm.rank])
    pending: list[tuple[Any, Collective]] = []
    larges = []
    others: Counter[str] = Counter()
    for i in range(160):
        if shared.random() < 0.06:
            larges.append(_large(comm, shared))
        call = Collective(shared, mine, comm.size, comm.rank)
        if not call.persistent:
            others[_NONBLOCKING[call.op]] += 1
        if not errors.run(
            f"step {i}: {call.what}", lambda c=call: pending.append((c.start(comm), c))
        ):
            continue
        if pending and mine.random() < 0.3:
            _settle(pending, errors)
    _settle(pending, errors)
    _check_larges(larges, errors)
    # with the check on, a small blocking call of any of these may ride in its records
    for name in _NONBLOCKING.values():
        errors.expect(
            calls[name] <= others[name] if check else calls[name] == others[name],
            f"{calls[name]} {name} calls for {others[name]} outside the persistent path",
        )
    if _NO_PERSISTENT is None:
        inits = sum(calls[name] for name in mpi_persistent.INITS.values())
        errors.expect(
            inits == transport.requests.made > 0,
            f"requests made: {transport.requests.made}, inits: {dict(calls)}",
        )
    errors.verify()
