"""Stress: a seeded random sequence of mixed operations on 4 ranks, checked against numpy.

Operations (all_reduce, reduce, broadcast, all_gather, reduce_scatter, all_to_all and a
send/recv ring), sizes (0..4096 elements, mostly small), dtypes, reductions, roots and
blocking/async calls are drawn from one generator seeded on rank 0 and broadcast; they run on
the world, on two halves (split by parity, running at the same time) and on a group of three
(rank 3 left out). Every rank checks its result against a float64 numpy reference. The seed is
printed, and named in every failure: STRESS_SEED=<seed> replays a run. STRESS_OPS sets the
number of operations (default 2000; the long version is STRESS_OPS=10000).
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import pytest
from _reliability import my_rank, report

import hetcomm
from hetcomm import ReduceOp

OPS = int(os.environ.get("STRESS_OPS", "2000"))
SEED = int(os.environ.get("STRESS_SEED", "0"))


@pytest.mark.parametrize("transport", ["auto", "staged"])
def test_stress_mixed_operations(job: Any, transport: str) -> None:
    limit = max(120, OPS * 0.06)
    result = job(
        4,
        stress,
        {"ops": OPS, "seed": SEED},
        limit,
        HETCOMM_TIMEOUT="60",
        HETCOMM_TRANSPORT=transport,
    )
    seed = next(
        (line.split()[1] for line in result.stdout.splitlines() if line.startswith("SEED ")),
        "unknown",
    )
    print(
        f"stress on {transport}: {OPS} operations, seed {seed}, exit {result.returncode} after "
        f"{result.seconds:.1f} s"
    )
    assert result.returncode == 0 and len(result.results) == 4, (
        f"seed {seed} (replay: STRESS_SEED={seed})\n{result.explain()}"
    )
    bad = [r for r in result.results if not r["ok"]]
    assert not bad, f"seed {seed} (replay: STRESS_SEED={seed}): " + "; ".join(
        f"rank {r['rank']}: {r['n_errors']} errors: {r['errors'][:3]}" for r in bad
    )
    if OPS >= 500:  # every kind of operation ran on every kind of group
        assert len(result.results[0]["counts"]) == 21, result.results[0]["counts"]


# ---- the rank side: scenarios run on every rank of a job (hetcomm.testing.run_scenario) ----


DTYPES = ("int8", "uint8", "int32", "int64", "float16", "float32", "float64")


FLOATS = ("float16", "float32", "float64")


KINDS = ("all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all", "ring")


_AVG = ReduceOp.AVG


REDUCTIONS = (ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG)


def stress(params: dict[str, Any]) -> None:
    world = hetcomm.init(name="stress")
    seed = int.from_bytes(os.urandom(6), "little") if my_rank() == 0 else None
    seed = int(world.mpi.bcast(params.get("seed") or seed, root=0))
    if my_rank() == 0:
        print(f"SEED {seed}", flush=True)
    halves = world.split(my_rank() % 2, name=f"half{my_rank() % 2}")
    trio = world.split(0 if my_rank() < 3 else None, name="trio")
    groups = {"world": world, "half": halves, "trio": trio}
    rng = np.random.default_rng(seed)  # the same draws on every rank
    errors: list[str] = []
    counts: dict[str, int] = {}
    start = time.monotonic()
    for step in range(int(params["ops"])):
        gname = ("world", "half", "trio")[int(rng.integers(3))]
        what = KINDS[int(rng.integers(len(KINDS)))]
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
        salt = step * 4 + (my_rank() % 2 if gname == "half" else 0)
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
