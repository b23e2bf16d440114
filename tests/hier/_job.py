"""The MPI side of the hier tests: `python -m mpi4py _job.py SCENARIO '{json params}'`.

Ranks get their vendor and host from HETCOMM_VENDOR / HETCOMM_HOST (set per rank by the
test's MPMD command line) and HETCOMM_TRANSPORT=hier. Each rank prints one `RESULT {json}` line
at the end; a rank that raises ends the job (mpi4py's -m aborts it).
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys
import time
from typing import Any

import numpy as np
from mpi4py import MPI

import hetcomm
from hetcomm import CommAborted, CommTimeout, ReduceOp, introspect

RANK = MPI.COMM_WORLD.Get_rank()
OPS = tuple(ReduceOp)
INTS = ("int8", "int32", "int64", "uint8")
FLOATS = ("float16", "bfloat16", "float32", "float64")
# relative error allowed per rank taking part (see `check`)
EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-22, "float64": 2.0**-50}
PAD = 3  # sentinel elements on each side of every output


@functools.cache
def torch() -> Any:
    """torch, imported by the jobs that use bfloat16 only (numpy has none): it is slow to load."""
    import torch

    return torch


def report(**result: Any) -> None:
    print("RESULT " + json.dumps({"rank": RANK, **result}), flush=True)


# ---- data -----------------------------------------------------------------------------------


def draw(rng: np.random.Generator, dtype: str, n: int, count: int) -> np.ndarray:
    """Logical inputs of all n ranks (float64; int64; bool), exact in `dtype`; products of n
    of them stay in range."""
    if dtype == "bool":
        return rng.random((n, count)) < 0.6
    if dtype in INTS:
        info = np.iinfo(dtype)
        hi = max(1, min(1000, int(float(info.max) ** (1.0 / n))))
        return rng.integers(0 if info.min == 0 else -hi, hi, (n, count), endpoint=True)
    values = rng.uniform(0.5, 2.0, (n, count)) * rng.choice([-1.0, 1.0], (n, count))
    if dtype == "bfloat16":
        return torch().from_numpy(values).to(torch().bfloat16).to(torch().float64).numpy()
    return values.astype(dtype).astype(np.float64)


def sentinel(dtype: str) -> Any:
    return True if dtype == "bool" else (177 if dtype == "uint8" else -77)


def array(values: np.ndarray, dtype: str) -> Any:
    """numpy for every dtype numpy has, a torch CPU tensor for bfloat16."""
    if dtype == "bfloat16":
        t = torch()
        return t.from_numpy(np.array(values, dtype=np.float64)).to(t.bfloat16)
    return np.array(values, dtype=dtype)


def logical(arr: Any) -> np.ndarray:
    if not isinstance(arr, np.ndarray):  # a torch tensor
        return arr.to(torch().float64).numpy()
    a = np.asarray(arr)
    return (
        a.copy()
        if a.dtype == np.bool_
        else a.astype(np.float64 if a.dtype.kind == "f" else np.int64)
    )


def raw(arr: Any) -> bytes:
    """The bits of an array (for the bitwise comparison across ranks)."""
    if not isinstance(arr, np.ndarray):  # a torch tensor
        return arr.view(torch().int16).numpy().tobytes()
    return np.ascontiguousarray(arr).tobytes()


class Placed:
    """An output array inside a backing array of sentinels: intact() checks nothing else moved."""

    def __init__(self, values: np.ndarray, dtype: str) -> None:
        self.n = values.size
        self.sentinel = sentinel(dtype)
        self.backing = array(np.full(self.n + 2 * PAD, self.sentinel), dtype)
        self.array = self.backing[PAD : PAD + self.n]
        self.array[...] = array(values, dtype)

    def intact(self) -> bool:
        b = logical(self.backing)
        return bool((b[:PAD] == self.sentinel).all() and (b[PAD + self.n :] == self.sentinel).all())


def reference(stack: np.ndarray, op: ReduceOp, dtype: str) -> np.ndarray:
    """The reduction over the ranks (axis 0), in float64 / int64 / bool."""
    if dtype == "bool":
        return stack.any(axis=0) if op in (ReduceOp.SUM, ReduceOp.MAX) else stack.all(axis=0)
    if op is ReduceOp.MIN:
        return stack.min(axis=0)
    if op is ReduceOp.MAX:
        return stack.max(axis=0)
    if op is ReduceOp.PROD:
        return stack.prod(axis=0)
    total = stack.sum(axis=0)
    if op is ReduceOp.AVG:
        return np.trunc(total / len(stack)) if dtype in INTS else total / len(stack)
    return total


def check(
    got: np.ndarray, stack: np.ndarray, op: ReduceOp | None, dtype: str, what: str
) -> list[str]:
    """[] when `got` matches the reduction of `stack` (op None: `stack` itself is expected).

    Float SUM, AVG and PROD round at each step: |error| <= n * eps * scale, scale being the
    sum of magnitudes (its average for AVG) or the product's magnitude."""
    want = stack if op is None else reference(stack, op, dtype)
    if got.shape != want.shape:
        return [f"{what}: shape {got.shape}, expected {want.shape}"]
    if op is None or dtype not in FLOATS or op in (ReduceOp.MIN, ReduceOp.MAX):
        bad = got != want
    else:
        n = len(stack)
        scale = np.abs(stack).prod(axis=0) if op is ReduceOp.PROD else np.abs(stack).sum(axis=0)
        scale = scale / n if op is ReduceOp.AVG else scale
        bad = ~(np.abs(got - want) <= n * EPS[dtype] * scale)
    if not bad.any():
        return []
    i = int(np.flatnonzero(bad)[0])
    return [
        f"{what}: {int(bad.sum())} of {bad.size} differ, first at {i}: got "
        f"{got.reshape(-1)[i]}, want {want.reshape(-1)[i]}"
    ]


# ---- the scenarios -------------------------------------------------------------------------------


def collectives(params: dict[str, Any]) -> None:
    """Every operation x dtype x reduce op x count, synchronous and asynchronous, against numpy."""
    world = hetcomm.init(name="hier")
    seed = int(world.mpi.bcast(params.get("seed") or int(time.time_ns() % (1 << 31)), root=0))
    rng = np.random.default_rng(seed)  # the same draws on every rank
    errors: list[str] = []
    digest = hashlib.sha256()
    start = time.monotonic()
    cases = [(d, c) for d in params["dtypes"] for c in params["counts"]]
    cases += [
        (d, params["large"])
        for d in ("float32", "bfloat16")
        if params.get("large") and d in params["dtypes"]
    ]
    for dtype, count in cases:
        for op in OPS:
            if dtype == "bool" and op is ReduceOp.AVG:
                continue
            case = f"{dtype}[{count}] {op}"
            errors += _all_reduce(world, rng, dtype, count, op, case, digest)
            errors += _reduce_scatter(world, rng, dtype, count, op, case)
            if op is ReduceOp.SUM or count == 7:
                errors += _reduce(world, rng, dtype, count, op, case)
        errors += _moves(world, rng, dtype, count, f"{dtype}[{count}]")
    errors += _asynchronous(world, rng)
    world.barrier()
    seconds = time.monotonic() - start
    plan = world.plan.lookup("all_reduce", "host", "large")
    transport = introspect.transports(world).get("hier")
    parts = {}
    if transport is not None:
        for part in (transport.island, transport.cross, transport.flat):  # type: ignore[attr-defined]
            parts[part.name] = {
                "hier": introspect.unavailable(part).get("hier"),
                "device": part.plan.lookup("all_reduce", "device", "large")[0],
                "host": part.plan.lookup("all_reduce", "host", "large")[0],
            }
    # without forcing a transport: host buffers stay on mpi, device collectives go to hier
    auto = hetcomm.init(config=hetcomm.Config.load(transport="auto"), name="hier-auto")
    table = auto.plan
    planned = {
        f"{op} {memory}": list(table.lookup(op, memory, "large"))
        for op in ("all_reduce", "all_gather", "send")
        for memory in ("host", "device")
    }
    auto.close()
    report(
        ok=not errors,
        errors=errors[:10],
        n_errors=len(errors),
        seed=seed,
        seconds=seconds,
        digest=digest.hexdigest(),
        plan=list(plan),
        parts=parts,
        auto=planned,
        device_plan=list(world.plan.lookup("all_reduce", "device", "large")),
        routed=sorted(introspect.transports(world)),
    )
    world.close()


def _all_reduce(
    world: Any,
    rng: np.random.Generator,
    dtype: str,
    count: int,
    op: ReduceOp,
    case: str,
    digest: Any,
) -> list[str]:
    n, me = world.size, world.rank
    stack = draw(rng, dtype, n, count)
    errors = []
    # out of place: x unchanged, nothing written around out
    x = array(stack[me], dtype)
    out = Placed(draw(rng, dtype, 1, count)[0], dtype)
    world.all_reduce(x, op, out=out.array)
    errors += check(logical(out.array), stack, op, dtype, f"all_reduce out= {case}")
    errors += check(logical(x), stack[me], None, dtype, f"all_reduce out= {case}: x changed")
    if not out.intact():
        errors.append(f"all_reduce out= {case}: wrote outside out")
    digest.update(raw(out.array))
    # in place, asynchronous
    y = Placed(stack[me], dtype)
    world.all_reduce(y.array, op, async_op=True).wait()
    errors += check(logical(y.array), stack, op, dtype, f"all_reduce in place {case}")
    if not y.intact():
        errors.append(f"all_reduce in place {case}: wrote outside x")
    if raw(y.array) != raw(out.array):
        errors.append(f"all_reduce {case}: in place and out= differ in their bits")
    return errors


def _reduce_scatter(
    world: Any, rng: np.random.Generator, dtype: str, count: int, op: ReduceOp, case: str
) -> list[str]:
    n, me = world.size, world.rank
    stack = draw(rng, dtype, n, n * count)
    x = array(stack[me], dtype)
    out = Placed(draw(rng, dtype, 1, count)[0], dtype)
    world.reduce_scatter(out.array, x, op)
    errors = check(
        logical(out.array),
        stack[:, me * count : (me + 1) * count],
        op,
        dtype,
        f"reduce_scatter {case}",
    )
    errors += check(logical(x), stack[me], None, dtype, f"reduce_scatter {case}: x changed")
    if not out.intact():
        errors.append(f"reduce_scatter {case}: wrote outside out")
    return errors


def _reduce(
    world: Any, rng: np.random.Generator, dtype: str, count: int, op: ReduceOp, case: str
) -> list[str]:
    n, me = world.size, world.rank
    root = int(rng.integers(n))
    stack = draw(rng, dtype, n, count)
    x = Placed(stack[me], dtype)
    world.reduce(x.array, root, op)
    if me == root:
        errors = check(logical(x.array), stack, op, dtype, f"reduce root {root} {case}")
    else:
        errors = check(logical(x.array), stack[me], None, dtype, f"reduce {case}: non-root x")
    return errors + ([] if x.intact() else [f"reduce {case}: wrote outside x"])


def _moves(world: Any, rng: np.random.Generator, dtype: str, count: int, case: str) -> list[str]:
    """all_gather, broadcast from every root, all_to_all, a ring of send/recv, barrier."""
    n, me = world.size, world.rank
    errors: list[str] = []
    stack = draw(rng, dtype, n, count)
    x = array(stack[me], dtype)
    out = Placed(draw(rng, dtype, 1, n * count)[0], dtype)
    world.all_gather(out.array, x)
    errors += check(logical(out.array), stack.reshape(-1), None, dtype, f"all_gather {case}")
    errors += check(logical(x), stack[me], None, dtype, f"all_gather {case}: x changed")
    if not out.intact():
        errors.append(f"all_gather {case}: wrote outside out")
    for root in sorted({0, n - 1}):
        y = Placed(stack[me], dtype)
        world.broadcast(y.array, root)
        errors += check(logical(y.array), stack[root], None, dtype, f"broadcast root {root} {case}")
        if not y.intact():
            errors.append(f"broadcast root {root} {case}: wrote outside x")
    blocks = draw(rng, dtype, n, n * count)
    out = Placed(draw(rng, dtype, 1, n * count)[0], dtype)
    world.all_to_all(out.array, array(blocks[me], dtype))
    want = np.concatenate([blocks[s, me * count : (me + 1) * count] for s in range(n)])
    errors += check(logical(out.array), want, None, dtype, f"all_to_all {case}")
    got = Placed(draw(rng, dtype, 1, count)[0], dtype)
    sent = world.send(array(stack[me], dtype), (me + 1) % n, tag=3, async_op=True)
    world.recv(got.array, (me - 1) % n, tag=3)
    sent.wait()
    errors += check(logical(got.array), stack[(me - 1) % n], None, dtype, f"send/recv {case}")
    world.barrier()
    return errors


def _asynchronous(world: Any, rng: np.random.Generator) -> list[str]:
    """Several operations in flight at once, waited for in reverse order; an operation that
    cannot complete before a late rank arrives is still pending when its call returns."""
    n, me = world.size, world.rank
    errors: list[str] = []
    count = 1001
    a = draw(rng, "float32", n, count)
    b = draw(rng, "float64", n, n * count)
    c = draw(rng, "int32", n, count)
    xa = array(a[me], "float32")
    ob = np.zeros(count)
    oc = np.zeros(n * count, np.int32)
    xd = array(a[me], "float32")
    works = [
        world.all_reduce(xa, ReduceOp.SUM, async_op=True),
        world.reduce_scatter(ob, array(b[me], "float64"), ReduceOp.MAX, async_op=True),
        world.all_gather(oc, array(c[me], "int32"), async_op=True),
        world.broadcast(xd, n - 1, async_op=True),
    ]
    for w in reversed(works):
        w.wait()
    errors += check(logical(xa), a, ReduceOp.SUM, "float32", "async all_reduce")
    errors += check(
        logical(ob),
        b[:, me * count : (me + 1) * count],
        ReduceOp.MAX,
        "float64",
        "async reduce_scatter",
    )
    errors += check(logical(oc), c.reshape(-1), None, "int32", "async all_gather")
    errors += check(logical(xd), a[n - 1], None, "float32", "async broadcast")
    # rank n-1 comes late: the others' all_reduce cannot be complete when the call returns
    x = array(a[me], "float32")
    if me == n - 1:
        time.sleep(0.3)
    work = world.all_reduce(x, ReduceOp.SUM, async_op=True)
    if me != n - 1 and work.test():
        errors.append("async all_reduce was complete before the last rank had called it")
    work.wait()
    errors += check(logical(x), a, ReduceOp.SUM, "float32", "late async all_reduce")
    return errors


def timeouts(params: dict[str, Any]) -> None:
    """Rank 0 alone calls: the setup of the transport, then an operation (per-op timeout), then
    an async operation (the configured timeout) time out, and the communicators are aborted."""
    found: dict[str, Any] = {}
    quick = hetcomm.Config.load(timeout=1.5)
    lonely = hetcomm.init(config=quick, name="lonely-setup")
    if RANK == 0:
        found["setup"] = _timed(lambda: lonely.all_reduce(np.ones(8)))
    op_comm = hetcomm.init(name="lonely-op")
    async_comm = hetcomm.init(config=quick, name="lonely-async")
    x = np.ones(1000)
    op_comm.all_reduce(x)  # every rank: the transports are set up
    async_comm.all_reduce(x)
    if RANK == 0:
        found["op"] = _timed(lambda: op_comm.all_reduce(x, timeout=1.0))
        work = async_comm.all_reduce(np.ones(100_000), async_op=True)
        found["async"] = _timed(work.wait)
        for name, comm in (("setup", lonely), ("op", op_comm), ("async", async_comm)):
            try:
                comm.all_reduce(x)
            except CommAborted:
                found[name]["then"] = "CommAborted"
            except Exception as exc:
                found[name]["then"] = f"{type(exc).__name__}: {exc}"
            else:
                found[name]["then"] = "returned"
        start = time.monotonic()
        for comm in (lonely, op_comm, async_comm):
            comm.close()
        found["close_s"] = time.monotonic() - start
    MPI.COMM_WORLD.Barrier()
    report(**found)
    if RANK != 0:
        for comm in (lonely, op_comm, async_comm):
            comm.close()


def _timed(call: Any) -> dict[str, Any]:
    start = time.monotonic()
    try:
        call()
    except CommTimeout as exc:
        return {
            "error": "CommTimeout",
            "message": str(exc),
            "group": exc.group,
            "op": exc.op,
            "seconds": time.monotonic() - start,
        }
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"error": None}


SCENARIOS = {"collectives": collectives, "timeouts": timeouts}

if __name__ == "__main__":
    SCENARIOS[sys.argv[1]](json.loads(sys.argv[2]) if len(sys.argv) > 2 else {})
