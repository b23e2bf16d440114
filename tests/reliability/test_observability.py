"""HETCOMM_TRACE and HETCOMM_STALL in real MPI jobs of 2 ranks."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _reliability import my_rank, report

import hetcomm

ROOT = Path(__file__).resolve().parent.parent.parent


def test_trace_of_a_job_merges_into_one_timeline(job: Any, tmp_path: Path) -> None:
    d = tmp_path / "traces"
    result = job(2, trace, {"ops": 5}, 120, HETCOMM_TRACE=str(d), HETCOMM_TIMEOUT="60")
    assert result.returncode == 0 and len(result.results) == 2, result.explain()
    assert sorted(p.name for p in d.iterdir()) == ["trace-rank00000.json", "trace-rank00001.json"]
    out = tmp_path / "merged.json"
    done = subprocess.run(
        [str(ROOT / "scripts" / "merge-trace"), str(d), str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    events = json.loads(out.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in events
        if e["ph"] == "M" and e["name"] == "thread_name"
    }
    for rank in (0, 1):
        mine = [e for e in spans if e["pid"] == rank]
        by_group: dict[str, list[dict[str, Any]]] = {}
        for e in mine:
            assert threads[(rank, e["tid"])] == e["args"]["group"]
            by_group.setdefault(e["args"]["group"], []).append(e)
        # every async all_reduce of the world and of this rank's half made one event, in order
        world = [e for e in by_group["world"] if e["name"] == "all_reduce"]
        assert len(world) == 5, [e["args"] for e in mine]
        half = by_group[f"half{rank}"]
        assert [e["args"]["seq"] for e in half] == sorted(e["args"]["seq"] for e in half)
        assert len(half) == 5
        assert all(e["dur"] >= 0 and e["args"]["op"] == e["name"] for e in mine)
    # the two ranks' events of one world all_reduce overlap in time: one clock for both
    a, b = (
        [
            e
            for e in spans
            if e["pid"] == r and e["args"]["group"] == "world" and e["name"] == "all_reduce"
        ][-1]
        for r in (0, 1)
    )
    assert a["args"]["seq"] == b["args"]["seq"]
    assert a["ts"] <= b["ts"] + b["dur"] + 1e5 and b["ts"] <= a["ts"] + a["dur"] + 1e5


def test_stall_warning_in_a_job(job: Any) -> None:
    """Rank 1 is 2.5 s late: rank 0 warns once after 0.5 s, then completes normally."""
    result = job(2, stall, {"late": 2.5}, 120, HETCOMM_STALL="0.5", HETCOMM_TIMEOUT="30")
    assert result.returncode == 0 and len(result.results) == 2, result.explain()
    assert all(r["ok"] for r in result.results), result.explain()
    warnings = [line for line in result.stderr.splitlines() if "has waited" in line]
    assert len(warnings) == 1, result.explain()
    assert warnings[0].startswith("hetcomm WARNING: group 'stalled': all_reduce #1 has waited 0.")
    assert "ranks not arrived: [1]" in warnings[0]
    assert result.results[0]["waited"] > 2


@pytest.mark.parametrize("transport", ["mpi", "staged"], ids=["on-mpi", "on-staged"])
def test_every_operation_is_traced_with_its_transport_facts(
    job: Any, tmp_path: Path, transport: str
) -> None:
    """Each operation makes one event whose args name the transport, the operation's size and
    its stages, on every transport; small in-place all_reduces (which take a short path
    without a Work while tracing is off) are traced too."""
    d = tmp_path / "traces"
    result = job(
        2, trace_ops, {"transport": transport}, 120, HETCOMM_TRACE=str(d), HETCOMM_TIMEOUT="60"
    )
    ranks = result.ranks(2)
    assert result.returncode == 0 and all(r["ok"] for r in ranks), result.explain()
    for r in ranks:
        data = json.loads((d / f"trace-rank{r['rank']:05d}.json").read_text())
        spans = [e for e in data["traceEvents"] if e["ph"] == "X" and e["args"]["group"] == "ops"]
        got: dict[str, list[int]] = {}
        for e in spans:
            args = e["args"]
            assert args["transport"] == transport, args
            assert isinstance(args["stages"], int) and args["stages"] >= 0, args
            if args["bytes"] and transport == "mpi":
                assert args["stages"] >= 1, args
            got.setdefault(e["name"], []).append(args["bytes"])
        assert got == r["bytes"], f"rank {r['rank']}: traced {got}, expected {r['bytes']}"


# ---- the rank side: scenarios run on every rank of a job (hetcomm.testing.run_scenario) ----


def stall(params: dict[str, Any]) -> None:
    """Rank 1 comes `late` seconds after rank 0 into one all_reduce."""
    world = hetcomm.init(name="stalled")
    x = np.full(64, my_rank() + 1, dtype=np.float64)
    if my_rank() == 1:
        time.sleep(params["late"])
    start = time.monotonic()
    world.all_reduce(x, async_op=True).wait()  # type: ignore[union-attr]
    report(ok=bool((x == 3).all()), waited=time.monotonic() - start)
    world.close()


def trace(params: dict[str, Any]) -> None:
    """A few operations on the world and on a split group, traced by HETCOMM_TRACE."""
    world = hetcomm.init(name="world")
    half = world.split(my_rank() % 2, name=f"half{my_rank() % 2}")
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
