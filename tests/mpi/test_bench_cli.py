"""`hetcomm bench` in-process under mpirun: a tiny checked sweep, its JSON and its plot."""

from __future__ import annotations

import json
import os
import tempfile

import pytest
from mpi4py import MPI

from hetcomm import bench


@pytest.mark.mpi(min_size=2)
def test_bench_sweep_checks_json_and_plot():
    world = MPI.COMM_WORLD
    # one directory for every rank: rank 0 makes it and tells the others
    where = tempfile.mkdtemp(prefix="hetcomm-bench-") if world.Get_rank() == 0 else None
    where = world.bcast(where, root=0)
    out_json, out_png = os.path.join(where, "rows.json"), os.path.join(where, "bw.png")
    code = bench.main(
        [
            "--op",
            "all_reduce,allgather",
            "-b",
            "8",
            "-e",
            "4K",
            "-f",
            "8",
            "--check",
            "--iters",
            "2",
            "--warmup",
            "1",
            "--transport",
            "auto",
            "--baselines",
            "mpi4py,gloo,naive",
            "--no-progress",
            "--json",
            out_json,
            "--plot",
            out_png,
        ]
    )
    assert code == 0
    with open(out_json) as f:
        rows = json.load(f)["rows"]
    ops = {r["op"] for r in rows}
    assert ops == {"all_reduce", "all_gather"}
    assert {r["transport"] for r in rows} >= {"auto", "mpi4py", "naive"}
    assert {r["size_bytes"] for r in rows if r["op"] == "all_reduce"} == {8, 64, 512, 4096}
    assert all(r["wrong"] == 0 for r in rows), [r for r in rows if r["wrong"]]
    assert all(r["time_us"] > 0 and r["busbw_GBps"] >= 0 for r in rows)
    assert os.path.getsize(out_png) > 0
    world.Barrier()
    if world.Get_rank() == 0:
        for path in (out_json, out_png):
            os.remove(path)
        os.rmdir(where)
