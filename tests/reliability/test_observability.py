"""HETCOMM_TRACE and HETCOMM_STALL in real MPI jobs of 2 ranks."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent


def test_trace_of_a_job_merges_into_one_timeline(job: Any, tmp_path: Path) -> None:
    d = tmp_path / "traces"
    result = job(2, "trace", {"ops": 5}, 120, HETCOMM_TRACE=str(d), HETCOMM_TIMEOUT="60")
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
    result = job(2, "stall", {"late": 2.5}, 120, HETCOMM_STALL="0.5", HETCOMM_TIMEOUT="30")
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
        2, "trace_ops", {"transport": transport}, 120, HETCOMM_TRACE=str(d), HETCOMM_TIMEOUT="60"
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
