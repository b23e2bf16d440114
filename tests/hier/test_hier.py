"""The hier transport on the CPU: simulated islands (vendors and hosts per rank), every
operation forced onto hier with host arrays, checked against numpy float64 references.

Each job runs every collective x dtype (bfloat16 through torch CPU tensors) x reduce op x count
(empty, fewer elements than ranks, counts no island divides, a large one), synchronously and
asynchronously; the ranks check their own results and report; this side checks that every
rank's all_reduce results are bitwise identical and that the plan and the parts are as designed.
"""

from __future__ import annotations

import hashlib
import re
import time
from typing import Any

import numpy as np
import pytest
from _hier import OPS, Placed, array, check, draw, logical, my_rank, raw, report, world

import hetcomm
from hetcomm import CommAborted, CommTimeout, ReduceOp, introspect

# float16 everywhere and bfloat16 in most jobs (hetcomm's own kernels reduce them); the other
# dtypes spread over the layouts, and test_mpi_suite_on_hier runs every dtype on 3 + 1
DTYPES = ["float64", "float32", "float16", "bfloat16", "int32", "uint8", "bool"]
FEW_DTYPES = ["float32", "float16", "bfloat16", "int64"]
NO_TORCH = ["float32", "float16", "int8"]  # jobs without bfloat16 need not load torch
# (ranks, vendor, host) in rank order -> islands; the dtypes and counts each job runs. 70_001
# float32 elements take the MPI transport's large-message path inside the islands.
LAYOUTS = {
    "2+2": ([(2, "nvidia", "ha"), (2, "amd", "ha")], DTYPES, [0, 1, 3, 7, 1001], 70_001),
    "3+1": ([(3, "nvidia", "ha"), (1, "amd", "ha")], NO_TORCH, [0, 1, 2, 7, 1001], 70_001),
    "1+1": ([(1, "nvidia", "ha"), (1, "amd", "ha")], NO_TORCH, [0, 1, 7, 1001], 70_001),
    "1+2+1": (
        [(1, "nvidia", "ha"), (2, "amd", "ha"), (1, "cpu", "hb")],
        FEW_DTYPES,
        [1, 3, 7, 1001],
        0,
    ),
    "interleaved 2+2": (
        [(1, "nvidia", "ha"), (1, "amd", "ha"), (1, "nvidia", "ha"), (1, "amd", "ha")],
        NO_TORCH,
        [3, 1001],
        0,
    ),
}
REASON = "{} vendor islands: native inside, staged/direct between"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_collectives_on_islands(hier_job, layout: str) -> None:
    ranks, dtypes, counts, large = LAYOUTS[layout]
    n = sum(count for count, _, _ in ranks)
    params = {"dtypes": dtypes, "counts": counts, "large": large}
    job = hier_job(ranks, collectives, params, limit=150)
    results = job.ranks(n)
    seed = results[0]["seed"]
    for r in results:
        assert r["ok"], f"rank {r['rank']} (seed {seed}): {r['n_errors']} errors: {r['errors']}"
    # every rank's all_reduce outputs, bit for bit the same
    digests = {r["digest"] for r in results}
    assert len(digests) == 1, f"all_reduce results differ in their bits across ranks: {digests}"
    for r in results:
        assert r["plan"] == ["hier", "forced by HETCOMM_TRANSPORT"]
        assert r["device_plan"] == ["hier", "forced by HETCOMM_TRANSPORT"]
        assert "hier" in r["routed"], r["routed"]
        # without forcing: host buffers on mpi; device collectives across islands on hier,
        # with the reason; point-to-point not on hier
        islands = 3 if layout == "1+2+1" else 2
        assert r["auto"]["all_reduce device"] == ["hier", REASON.format(islands)], r["auto"]
        assert r["auto"]["all_gather device"][0] == "hier", r["auto"]
        assert r["auto"]["send device"][0] not in ("hier", "none"), r["auto"]
        assert r["auto"]["all_reduce host"][0] == "mpi", r["auto"]
        # the parts plan for themselves and never choose hier again
        assert len(r["parts"]) == 3, r["parts"]
        for name, part in r["parts"].items():
            assert part["hier"] == "inside a hier transport", (name, part)
            assert part["host"] == "mpi" and part["device"] not in ("hier", "none"), (name, part)


def test_timeouts_abort_and_close(hier_job) -> None:
    """Rank 0 alone calls: the first collective (whose default check, made before the hier
    transport's setup, catches the missing rank), an operation with a per-op timeout, and an
    async operation under the configured timeout each raise CommTimeout naming the group; the
    communicator then refuses calls with CommAborted and closes promptly."""
    ranks = [(1, "nvidia", "ha"), (1, "amd", "ha")]
    job = hier_job(ranks, timeouts, {}, limit=60)
    lone = job.ranks(2)[0]
    for case, group, op in (
        ("setup", "lonely-setup", "all_reduce"),
        ("op", "lonely-op", "all_reduce"),
        ("async", "lonely-async", "all_reduce"),
    ):
        found = lone[case]
        assert found["error"] == "CommTimeout", (case, found, job.explain())
        assert (found["group"], found["op"]) == (group, op), (case, found)
        assert found["seconds"] < 10, (case, found)
        assert found["then"] == "CommAborted", (case, found)
    assert lone["close_s"] < 10, lone


def test_mpi_suite_on_hier(hier_pytest) -> None:
    """The collectives and point-to-point tests of tests/mpi (every dtype, numpy and torch, empty,
    0-d, strided and transposed arrays, sentinels around every output), on islands 3 + 1 with
    hier forced: every rank's pytest passes."""
    job = hier_pytest(
        [(3, "nvidia", "ha"), (1, "amd", "ha")], ["test_collectives.py", "test_p2p.py"]
    )
    text = re.sub(r"\x1b\[[0-9;]*m", "", job.stdout)  # pytest's colours
    summaries = [
        line for line in text.splitlines() if "passed" in line and re.search(r" in [\d.]+s", line)
    ]
    assert job.returncode == 0 and len(summaries) == 4, job.explain()
    for line in summaries:
        assert "failed" not in line and "error" not in line, job.explain()


# ---- the rank side: scenarios run on every rank of a job (hetcomm.testing.run_scenario) ----


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
    carried = _carried(world)
    world.all_reduce(x, op, out=out.array)
    # a small blocking call may ride in the check's records, which reduce in rank order: its
    # bits then need not be those of the transport's algorithm (both are checked against the
    # reference; each is the same on every rank)
    rode = _carried(world) > carried
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
    if not rode and raw(y.array) != raw(out.array):
        errors.append(f"all_reduce {case}: in place and out= differ in their bits")
    return errors


def _carried(world: Any) -> int:
    """The calls of `world` that rode in the check's records so far (hetcomm.carried)."""
    return sum(r["carried"] for r in world.routes())


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
    if my_rank() == 0:
        found["setup"] = _timed(lambda: lonely.all_reduce(np.ones(8)))
    op_comm = hetcomm.init(name="lonely-op")
    async_comm = hetcomm.init(config=quick, name="lonely-async")
    x = np.ones(1000)
    op_comm.all_reduce(x)  # every rank: the transports are set up
    async_comm.all_reduce(x)
    if my_rank() == 0:
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
    world().Barrier()
    report(**found)
    if my_rank() != 0:
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
