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
            errors.append(f"step {step} {what} on {gname} ({n} ranks) {dtype}[{count}] "
                          f"{op.value} root {root}: {problem}")  # fmt: skip
    world.barrier()
    seconds = time.monotonic() - start
    report(ok=not errors, seed=seed, errors=errors[:10], n_errors=len(errors), seconds=seconds,
           counts=counts)  # fmt: skip
    for c in (trio, halves):
        if c is not None:
            c.close()
    world.close()


def _call(method: Any, use_async: bool, *args: Any, **kwargs: Any) -> None:
    if use_async:
        method(*args, async_op=True, **kwargs).wait()
    else:
        method(*args, **kwargs)


def _one(comm: Any, what: str, n: int, me: int, root: int, op: ReduceOp, dtype: str, count: int,
         seed: int, salt: int, use_async: bool) -> str:  # fmt: skip
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


SCENARIOS = {"death": death, "stall": stall, "trace": trace, "stress": stress}

if __name__ == "__main__":
    SCENARIOS[sys.argv[1]](json.loads(sys.argv[2]) if len(sys.argv) > 2 else {})
