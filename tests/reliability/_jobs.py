"""The MPI side of the reliability tests: `python -m mpi4py _jobs.py SCENARIO '{json params}'`.

Each rank prints one `RESULT {json}` line when it gets to the end; a rank that raises ends the
job (mpi4py's -m aborts it on an uncaught exception).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

import numpy as np
from mpi4py import MPI

import hetcomm
from hetcomm import CommTimeout, ReduceOp

RANK = MPI.COMM_WORLD.Get_rank()


def report(**result: Any) -> None:
    print("RESULT " + json.dumps({"rank": RANK, **result}), flush=True)


# ---- rank death -----------------------------------------------------------------------------


def death(params: dict[str, Any]) -> None:
    """all_reduce in a loop; rank `victim` SIGKILLs itself at iteration `at`."""
    world = hetcomm.init(name="death")
    x = np.ones(256, dtype=np.float32)
    for i in range(int(params.get("iters", 10_000))):
        if params["victim"] == RANK and i == params["at"]:
            print(f"rank {RANK}: SIGKILL at iteration {i}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            world.all_reduce(x, async_op=True).wait()  # type: ignore[union-attr]
        except CommTimeout as exc:
            print(f"rank {RANK}: CommTimeout at iteration {i}: {exc}", flush=True)
            raise
        x.fill(1)
    report(ok=True)  # not reached while a rank is dead


# ---- a rank that leaves out a fused all-reduce ---------------------------------------------------


def skipped_coalesced(params: dict[str, Any]) -> None:
    """Rank 1 leaves out a blocking all_reduce_coalesced (after one that both ranks made), on
    one node, where it reduces through shared segments: rank 0 gets CommTimeout within the
    timeout with its arrays untouched, and both ranks close their communicators."""
    world = hetcomm.init(name="skipped")
    xs = [np.full(100, RANK + 1.0) for _ in range(4)]
    world.all_reduce_coalesced(xs)
    first = all(bool((x == 3).all()) for x in xs)
    timed_out: float | None = None
    untouched: bool | None = None
    if RANK == 0:
        ys = [np.full(100, 7.0) for _ in range(4)]
        start = time.monotonic()
        try:
            world.all_reduce_coalesced(ys, timeout=params["timeout"])
        except CommTimeout:
            timed_out = time.monotonic() - start
        untouched = all(bool((y == 7).all()) for y in ys)
    else:
        time.sleep(params["timeout"] + 1)
    world.close()
    report(ok=first, timed_out=timed_out, untouched=untouched)


# ---- stall warning ----------------------------------------------------------------------------


def stall(params: dict[str, Any]) -> None:
    """Rank 1 comes `late` seconds after rank 0 into one all_reduce."""
    world = hetcomm.init(name="stalled")
    x = np.full(64, RANK + 1, dtype=np.float64)
    if RANK == 1:
        time.sleep(params["late"])
    start = time.monotonic()
    world.all_reduce(x, async_op=True).wait()  # type: ignore[union-attr]
    report(ok=bool((x == 3).all()), waited=time.monotonic() - start)
    world.close()


# ---- tracing -------------------------------------------------------------------------------


def trace(params: dict[str, Any]) -> None:
    """A few operations on the world and on a split group, traced by HETCOMM_TRACE."""
    world = hetcomm.init(name="world")
    half = world.split(RANK % 2, name=f"half{RANK % 2}")
    assert half is not None
    x = np.ones(1000, dtype=np.float32)
    for _ in range(params["ops"]):
        world.all_reduce(x, async_op=True).wait()  # type: ignore[union-attr]
        world.broadcast(x, 0)
        half.all_reduce(x, async_op=True).wait()  # type: ignore[union-attr]
    world.barrier()
    report(ok=True)
    half.close()
    world.close()


def trace_ops(params: dict[str, Any]) -> None:
    """Every operation once (the small in-place all_reduce three times) on one transport,
    traced by HETCOMM_TRACE; reports the size each operation should be traced with."""
    world = hetcomm.init(config=hetcomm.Config.load(transport=params["transport"]), name="ops")
    n, me = world.size, world.rank
    small = np.full(4, me + 1.0)
    for _ in range(3):  # the communicator's short path takes these when tracing is off
        world.all_reduce(small)
    x = np.ones(1000, dtype=np.float32)
    out = np.zeros(1000 * n, dtype=np.float32)
    world.all_reduce(x, out=x.copy())
    world.reduce(x, 0)
    world.broadcast(x, 0)
    world.all_gather(out, x)
    world.reduce_scatter(x[: 1000 // n], out[: 1000 // n * n])
    world.all_to_all(out.copy(), out)
    sent = world.send(x, (me + 1) % n, tag=1, async_op=True)
    world.recv(x.copy(), (me - 1) % n, tag=1)
    sent.wait()  # type: ignore[union-attr]
    world.barrier()
    report(
        ok=bool((small == (n * (n + 1) / 2) * n * n).all()),
        bytes={
            "all_reduce": [32, 32, 32, 4000],
            "reduce": [4000],
            "broadcast": [4000],
            "all_gather": [4000 * n],
            "reduce_scatter": [1000 // n * n * 4],
            "all_to_all": [4000 * n],
            "send": [4000],
            "recv": [4000],
            "barrier": [0],
        },
    )
    world.close()


# ---- stress ---------------------------------------------------------------------------------

DTYPES = ("int8", "uint8", "int32", "int64", "float16", "float32", "float64")
FLOATS = ("float16", "float32", "float64")
OPS = ("all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all", "ring")
_AVG = ReduceOp.AVG
REDUCTIONS = (ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG)


def _input(seed: int, step: int, grank: int, dtype: str, count: int) -> np.ndarray:
    """Rank `grank`'s input of operation `step`: small integers, so that every reduction of up
    to 4 of them is exact in every dtype (products included)."""
    gen = np.random.default_rng([seed, step, grank])
    low = 0 if dtype == "uint8" else -3
    return gen.integers(low, 4, size=count).astype(dtype)


def _reduce(arrays: list[np.ndarray], op: ReduceOp) -> np.ndarray:
    """The float64 reference of reducing `arrays`."""
    stack = np.stack([a.astype(np.float64) for a in arrays])
    if op is ReduceOp.SUM:
        return stack.sum(axis=0)
    if op is ReduceOp.PROD:
        return stack.prod(axis=0)
    if op is ReduceOp.MIN:
        return stack.min(axis=0)
    if op is ReduceOp.MAX:
        return stack.max(axis=0)
    return stack.mean(axis=0)


def _same(got: np.ndarray, want: np.ndarray, rtol: float = 0.0) -> str:
    """'' when `got` (of some dtype) equals the float64 reference `want` after rounding it to
    that dtype (within `rtol`, for averages), else where they first differ."""
    expected = want.astype(got.dtype)
    a, b = got.astype(np.float64), expected.astype(np.float64)
    bad = np.flatnonzero(np.abs(a - b) > rtol * np.abs(b)) if rtol else np.flatnonzero(a != b)
    if bad.size == 0 and got.shape == expected.shape:
        return ""
    i = int(bad[0]) if bad.size else -1
    return f"{bad.size} of {got.size} wrong, first at {i}: got {got[i]} want {expected[i]}"


def stress(params: dict[str, Any]) -> None:
    world = hetcomm.init(name="stress")
    seed = int.from_bytes(os.urandom(6), "little") if RANK == 0 else None
    seed = int(world.mpi.bcast(params.get("seed") or seed, root=0))
    if RANK == 0:
        print(f"SEED {seed}", flush=True)
    halves = world.split(RANK % 2, name=f"half{RANK % 2}")
    trio = world.split(0 if RANK < 3 else None, name="trio")
    groups = {"world": world, "half": halves, "trio": trio}
    rng = np.random.default_rng(seed)  # the same draws on every rank
    errors: list[str] = []
    counts: dict[str, int] = {}
    start = time.monotonic()
    for step in range(int(params["ops"])):
        gname = ("world", "half", "trio")[int(rng.integers(3))]
        what = OPS[int(rng.integers(len(OPS)))]
        dtype = DTYPES[int(rng.integers(len(DTYPES)))]
        count = int(rng.integers(0, 4097)) if rng.random() < 0.3 else int(rng.integers(0, 65))
        op = REDUCTIONS[int(rng.integers(len(REDUCTIONS) - (dtype not in FLOATS)))]
        root_draw = int(rng.integers(1 << 30))
        use_async = bool(rng.integers(2))
        comm = groups[gname]
        if comm is None:  # this rank is not in the trio
            continue
        n, me = comm.size, comm.rank
        root = root_draw % n
        # the same group of the two halves draws different inputs: tell them apart
        salt = step * 4 + (RANK % 2 if gname == "half" else 0)
        key = f"{what}/{gname}"
        counts[key] = counts.get(key, 0) + 1
        try:
            problem = _one(comm, what, n, me, root, op, dtype, count, seed, salt, use_async)
        except Exception as exc:  # keep going in step with the others: report at the end
            problem = f"{type(exc).__name__}: {exc}"
        if problem:
            errors.append(
                f"step {step} {what} on {gname} ({n} ranks) {dtype}[{count}] "
                f"{op.value} root {root}: {problem}"
            )
    world.barrier()
    seconds = time.monotonic() - start
    report(
        ok=not errors,
        seed=seed,
        errors=errors[:10],
        n_errors=len(errors),
        seconds=seconds,
        counts=counts,
    )
    for c in (trio, halves):
        if c is not None:
            c.close()
    world.close()


def _call(method: Any, use_async: bool, *args: Any, **kwargs: Any) -> None:
    if use_async:
        method(*args, async_op=True, **kwargs).wait()
    else:
        method(*args, **kwargs)


def _one(
    comm: Any,
    what: str,
    n: int,
    me: int,
    root: int,
    op: ReduceOp,
    dtype: str,
    count: int,
    seed: int,
    salt: int,
    use_async: bool,
) -> str:
    if what in ("reduce_scatter", "all_to_all"):
        inputs = [_input(seed, salt, g, dtype, count * n) for g in range(n)]
    else:
        inputs = [_input(seed, salt, g, dtype, count) for g in range(n)]
    x = inputs[me].copy()
    # an average is rounded where it is computed: allow a rounding step of the dtype
    rtol = {"float16": 2e-3, "float32": 1e-6, "float64": 1e-12}[dtype] if op is _AVG else 0.0
    if what == "all_reduce":
        _call(comm.all_reduce, use_async, x, op)
        return _same(x, _reduce(inputs, op), rtol)
    if what == "reduce":
        _call(comm.reduce, use_async, x, root, op)
        if me != root:
            return _same(x, inputs[me].astype(np.float64))
        return _same(x, _reduce(inputs, op), rtol)
    if what == "broadcast":
        _call(comm.broadcast, use_async, x, root)
        return _same(x, inputs[root].astype(np.float64))
    if what == "all_gather":
        out = np.zeros(count * n, dtype=dtype)
        _call(comm.all_gather, use_async, out, x)
        return _same(out, np.concatenate(inputs).astype(np.float64))
    if what == "reduce_scatter":
        out = np.zeros(count, dtype=dtype)
        _call(comm.reduce_scatter, use_async, out, x, op)
        return _same(out, _reduce(inputs, op)[me * count : (me + 1) * count], rtol)
    if what == "all_to_all":
        out = np.zeros(count * n, dtype=dtype)
        _call(comm.all_to_all, use_async, out, x)
        want = np.concatenate([inputs[g][me * count : (me + 1) * count] for g in range(n)])
        return _same(out, want.astype(np.float64))
    # ring: send to the next rank, receive from the previous one
    got = np.zeros(count, dtype=dtype)
    sent = comm.send(x, (me + 1) % n, tag=7, async_op=True)
    comm.recv(got, (me - 1) % n, tag=7)
    sent.wait()
    return _same(got, inputs[(me - 1) % n].astype(np.float64))


# ---- counts past 2^31 --------------------------------------------------------------------------

_TILE = 4099  # a prime: a piece landing at a wrong offset (a multiple of 2^k) shows up


def _tile(salt: int) -> np.ndarray:
    """The repeating pattern of int8 values that array `salt` holds."""
    return ((np.arange(_TILE, dtype=np.int64) * 37 + salt * 101) % 256 - 128).astype(np.int8)


def _fill(a: np.ndarray, tile: np.ndarray, first: int = 0) -> None:
    """a[i] = tile[(first + i) % len(tile)], written 8 tiles at a time as int64 words."""
    t = np.tile(np.roll(tile, -(first % len(tile))), 8)
    whole = len(a) - len(a) % len(t)
    a[:whole].view(np.int64).reshape(-1, len(t) // 8)[:] = t.view(np.int64)
    a[whole:] = t[: len(a) - whole]


def _differs(a: np.ndarray, tile: np.ndarray, first: int = 0) -> str:
    """'' when `a` holds the pattern `_fill` writes, else where it first differs (compared as
    int64 words, in slices, so that no temporary as large as `a` is made)."""
    t = np.tile(np.roll(tile, -(first % len(tile))), 8)
    words = t.view(np.int64)
    step = len(t) * 2048  # 64 MiB
    for start in range(0, len(a), step):
        part = a[start : start + step]
        whole = len(part) - len(part) % len(t)
        rows = part[:whole].view(np.int64).reshape(-1, len(words))
        bad = np.flatnonzero((rows != words).any(axis=1))
        if bad.size:
            row = part[bad[0] * len(t) : (bad[0] + 1) * len(t)]
            i = int(np.flatnonzero(row != t)[0])
            return f"element {start + bad[0] * len(t) + i}: got {row[i]}, want {t[i]}"
        if not np.array_equal(part[whole:], t[: len(part) - whole]):
            return f"elements {start + whole}.. of the last slice differ"
    return ""


class _Backing:
    """An int8 array of n elements between 64 sentinel bytes on each side; `part(k)` gives a
    view of its first k elements with fresh sentinels around them."""

    def __init__(self, n: int) -> None:
        self.memory = np.empty(n + 128, dtype=np.int8)

    def part(self, k: int) -> np.ndarray:
        self.memory[:64] = self.memory[64 + k : 128 + k] = 77
        self.k = k
        return self.memory[64 : 64 + k]

    def intact(self) -> bool:
        m, k = self.memory, self.k
        return bool((m[:64] == 77).all() and (m[64 + k : 128 + k] == 77).all())


def large(params: dict[str, Any]) -> None:
    """Every operation on int8 arrays of more than 2^31 elements between 2 ranks, each result
    checked in full against the pattern it must hold, and at a few random positions.

    Two arrays of n elements per rank serve every operation in turn (about 2n bytes per rank,
    touched once): their pages are faulted in once, which is most of the time this job takes.
    """
    world = hetcomm.init(config=hetcomm.Config.load(transport=params["transport"]), name="large")
    assert world.size == 2, "the large-count job runs on 2 ranks"
    n, me, other = int(params["count"]), world.rank, 1 - world.rank
    rng = np.random.default_rng(int(params["seed"]))  # the same draws on both ranks
    spots = np.unique(rng.integers(0, n, size=8))
    spot_values = rng.integers(-128, 128, size=(2, len(spots))).astype(np.int8)
    errors: list[str] = []
    seconds: dict[str, float] = {}
    a, b = _Backing(n), _Backing(n)

    def timed(what: str, call: Any, *args: Any, **kwargs: Any) -> bool:
        start = time.monotonic()
        try:
            work = call(*args, async_op=True, **kwargs)
            work.wait()
        except Exception as exc:
            errors.append(f"{what}: {type(exc).__name__}: {exc}")
            return False
        seconds[what] = round(time.monotonic() - start, 2)
        if params["transport"] == "mpi" and (work.info or {}).get("stages", 0) < 2:
            errors.append(f"{what}: one MPI call for {n} elements: {work.info}")
        return True

    def check(what: str, arr: np.ndarray, tile: np.ndarray, first: int = 0) -> None:
        problem = _differs(arr, tile, first)
        if problem:
            errors.append(f"{what}: {problem}")

    def outside(what: str, *backings: _Backing) -> None:
        if not all(k.intact() for k in backings):
            errors.append(f"{what}: wrote outside its arrays")

    # send/recv: rank 0's pattern (and its random spots) arrives whole at rank 1
    x = a.part(n)
    if me == 0:
        _fill(x, _tile(1))
        x[spots] = spot_values[0]
        timed("send", world.send, x, 1, tag=3)
    else:
        x[:] = 0
        if timed("recv", world.recv, x, 0, tag=3):
            got = x[spots].copy()
            x[spots] = _tile(1)[spots % _TILE]
            check("recv", x, _tile(1))
            if not np.array_equal(got, spot_values[0]):
                errors.append(f"recv: random spots hold {got}, want {spot_values[0]}")
    outside("send/recv", a)
    # broadcast from rank 1
    _fill(x, _tile(2 + me))
    if timed("broadcast", world.broadcast, x, 1):
        check("broadcast", x, _tile(3))
        outside("broadcast", a)
    # all_reduce SUM: the int8 sum of both ranks' patterns, wrapped; random spots exact
    _fill(x, _tile(4 + me))
    x[spots] = spot_values[me]
    if timed("all_reduce", world.all_reduce, x):
        want = (_tile(4).astype(np.int64) + _tile(5)).astype(np.int8)
        got = x[spots].copy()
        x[spots] = want[spots % _TILE]
        check("all_reduce", x, want)
        spot_want = (spot_values[0].astype(np.int64) + spot_values[1]).astype(np.int8)
        if not np.array_equal(got, spot_want):
            errors.append(f"all_reduce: random spots hold {got}, want {spot_want}")
        outside("all_reduce", a)
    if params.get("collectives", True):
        _large_collectives(world, n // 2, me, other, a, b, timed, check, outside)
    report(ok=not errors, errors=errors[:10], seconds=seconds)
    world.close()


def _large_collectives(
    world: Any,
    half: int,
    me: int,
    other: int,
    a: _Backing,
    b: _Backing,
    timed: Any,
    check: Any,
    outside: Any,
) -> None:
    """all_gather, reduce_scatter and all_to_all whose larger buffer has 2 * half elements."""
    # all_gather: blocks of half elements gathered into 2 * half
    x, out = a.part(half), b.part(2 * half)
    _fill(x, _tile(6 + me))
    if timed("all_gather", world.all_gather, out, x):
        check("all_gather block 0", out[:half], _tile(6))
        check("all_gather block 1", out[half:], _tile(7))
        check("all_gather: x", x, _tile(6 + me))
        outside("all_gather", a, b)
    # reduce_scatter: x of 2 * half elements, each rank's out the sum of its block
    x, out = b.part(2 * half), a.part(half)
    _fill(x, _tile(8 + me))
    if timed("reduce_scatter", world.reduce_scatter, out, x):
        want = (_tile(8).astype(np.int64) + _tile(9)).astype(np.int8)
        check("reduce_scatter", out, want, me * half)
        check("reduce_scatter: x", x, _tile(8 + me))
        outside("reduce_scatter", a, b)
    # all_to_all: block j of rank i lands as block i of rank j (x is still rank me's pattern)
    out = a.part(2 * half)
    if timed("all_to_all", world.all_to_all, out, x):
        for i in (me, other):
            check(f"all_to_all block {i}", out[i * half : (i + 1) * half], _tile(8 + i), me * half)
        check("all_to_all: x", x, _tile(8 + me))
        outside("all_to_all", a, b)


SCENARIOS = {
    "death": death,
    "stall": stall,
    "trace": trace,
    "stress": stress,
    "large": large,
    "trace_ops": trace_ops,
    "skipped_coalesced": skipped_coalesced,
}

if __name__ == "__main__":
    SCENARIOS[sys.argv[1]](json.loads(sys.argv[2]) if len(sys.argv) > 2 else {})
