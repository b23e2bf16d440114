"""`hetcomm bench` in-process under mpirun: a tiny checked sweep, its JSON and its plot."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import pytest
from mpi4py import MPI

from hetcomm.bench import main as bench
from hetcomm.bench.latency_table import FORMS


def _check_on_rank0(world, check, where):
    """Run `check` on rank 0, remove `where`, then fail there if it failed: the other ranks
    never wait on a rank that stopped at an assertion."""
    failed = None
    if world.Get_rank() == 0:
        try:
            check()
        except AssertionError as exc:
            failed = exc
    world.Barrier()
    if world.Get_rank() == 0:
        shutil.rmtree(where)
        if failed is not None:
            raise failed


def _nccl_tests_rows(text):
    """nccl-tests' data lines as a cluster script reads them: not starting with '#', split on
    whitespace, size, count, type, redop, root, then time algbw busbw #wrong out of place and
    again in place; plus the two closing lines."""
    rows, closing = [], {}
    for line in text.splitlines():
        if line.startswith("# Out of bounds values") or line.startswith("# Avg bus bandwidth"):
            label, _, value = line[2:].partition(":")
            closing[label.strip()] = value.split()
        elif line.strip() and not line.startswith("#"):
            c = line.split()
            assert len(c) == 13, line
            rows.append((int(c[0]), int(c[1]), c[2], c[3], int(c[4]), c[5:9], c[9:13]))
    return rows, closing


@pytest.mark.mpi(min_size=2)
def test_bench_sweep_checks_json_and_plot(capsys):
    world = MPI.COMM_WORLD
    # one directory for every rank: rank 0 makes it and tells the others
    where = tempfile.mkdtemp(prefix="hetcomm-bench-") if world.Get_rank() == 0 else None
    where = world.bcast(where, root=0)
    out_json, out_png = os.path.join(where, "rows.json"), os.path.join(where, "bw.png")
    code = bench.main(
        [
            "--op",
            "all_reduce,allgather,broadcast",
            "-b",
            "8",
            "-e",
            "512",
            "-f",
            "64",
            "-c",
            "1",
            "-d",
            "float",
            "-n",
            "2",
            "-w",
            "1",
            "-z",
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
    printed = capsys.readouterr().out

    def check():
        reports = printed.split("# ---- ")[1:]
        assert [r.split()[0] for r in reports] == ["all_reduce", "all_gather", "broadcast"]
        for titled in reports:
            report = titled.partition("\n")[2]
            head = [ln for ln in report.splitlines() if ln.startswith("# nThread")]
            assert head == [
                "# nThread 1 nGpus 1 minBytes 8 maxBytes 512 step: 64(factor) warmup iters: 1 "
                "iters: 2 agg iters: 1 validation: 1 graph: 0"
            ]
            ranks = [ln for ln in report.splitlines() if ln.startswith("#  Rank")]
            assert len(ranks) == world.Get_size()
            rows, closing = _nccl_tests_rows(report)
            n = world.Get_size()
            sizes = [8, 512]
            if titled.startswith("all_gather"):  # whole blocks of float32, one per rank
                sizes = [4 * max(n, s // 4 - (s // 4) % n) for s in sizes]
            assert [r[0] for r in rows] == sizes  # hetcomm's rows only
            assert closing["Out of bounds values"] == ["0", "OK"]
            assert float(closing["Avg bus bandwidth"][0]) >= 0
            for _size, _count, dtype, _redop, _root, _oop, ip in rows:
                assert dtype == "float" and ip[3] == "0" and float(ip[0]) > 0
            if titled.startswith("broadcast"):
                assert all(r[5] == ["N/A"] * 4 and r[4] == 0 and r[3] == "none" for r in rows)
            else:
                assert all(r[5][3] == "0" and float(r[5][0]) > 0 and r[4] == -1 for r in rows)
        with open(out_json) as f:
            data = json.load(f)["rows"]
        assert {r["op"] for r in data} == {"all_reduce", "all_gather", "broadcast"}
        assert {r["transport"] for r in data} >= {"auto", "mpi4py", "naive"}
        assert {r["form"] for r in data} == {"out-of-place", "in-place"}
        sizes = {r["size_bytes"] for r in data if r["op"] == "all_reduce"}
        assert sizes == {8, 512}
        assert all(r["wrong"] == 0 for r in data), [r for r in data if r["wrong"]]
        assert all(r["time_us"] > 0 and r["busbw_GBps"] >= 0 for r in data)
        assert os.path.getsize(out_png) > 0

    _check_on_rank0(world, check, where)


def _latency_lines(text):
    """Data lines of the latency table the way a cluster script reads them: comment lines
    name the section, every other non-empty line splits on whitespace into the columns."""
    section, rows = None, []
    for line in text.splitlines():
        if line.startswith("# section "):
            section = line.split()[2].rstrip(":")
        elif line.strip() and not line.startswith("#"):
            cells = line.split()
            assert len(cells) == 10, line
            op, form, nbytes, het, floor, ratio, _spread, floor_name, gloo, wrong = cells
            rows.append(
                {
                    "section": section,
                    "op": op,
                    "form": form,
                    "bytes": int(nbytes),
                    "hetcomm": None if het == "-" else float(het),
                    "floor": None if floor == "-" else float(floor),
                    "ratio": None if ratio == "-" else float(ratio),
                    "floor_name": floor_name,
                    "gloo": None if gloo == "-" else float(gloo),
                    "wrong": None if wrong == "-" else int(wrong),
                }
            )
    return rows


@pytest.mark.mpi(min_size=2)
def test_latency_table_every_form_beside_its_floor(capsys):
    world = MPI.COMM_WORLD
    where = tempfile.mkdtemp(prefix="hetcomm-latency-") if world.Get_rank() == 0 else None
    where = world.bcast(where, root=0)
    out_json = os.path.join(where, "latency.json")
    sweep = ["--latency", "-b", "8", "-e", "16K", "-f", "2048", "-n", "3", "--iters-large", "2"]
    code = bench.main(
        [*sweep, "--rounds", "2", "-w", "1", "-c", "1", "--transport", "mpi", "--json", out_json]
    )
    assert code == 0
    printed = capsys.readouterr().out

    def check():
        head = [ln for ln in printed.splitlines() if ln.startswith("# ")]
        assert head[0].startswith("# hetcomm bench --latency: mpirun -n ")
        assert any(ln.startswith("# date: ") for ln in head)
        assert any(ln.startswith("# machine: ") for ln in head)
        assert any("round trip / 2" in ln for ln in head)
        rows = _latency_lines(printed)
        host = [r for r in rows if r["section"] == "host"]
        forms = list(dict.fromkeys((r["op"], r["form"]) for r in host))
        assert forms == list(FORMS)  # every op form, in the table's order
        assert ("all_reduce", "out-of-place") in forms and ("sendrecv", "ping-pong") in forms
        sizes = {r["bytes"] for r in host if r["op"] == "all_reduce"}
        assert sizes == {8, 16384}
        assert [r["bytes"] for r in host if r["op"] == "barrier"] == [0]
        for r in host:
            assert r["hetcomm"] > 0 and r["floor"] > 0 and r["floor_name"] == "mpi4py", r
            assert r["ratio"] > 0 and r["wrong"] == 0, r
        torch_rows = [r for r in rows if r["section"] == "torch"]
        assert {r["op"] for r in torch_rows} == {
            "all_reduce",
            "broadcast",
            "all_gather_single",
            "sendrecv",
        }
        assert all(r["floor"] > 0 and r["wrong"] == 0 for r in torch_rows)
        assert any(r["gloo"] is not None for r in host if r["op"] == "all_reduce")
        with open(out_json) as f:
            data = json.load(f)
        assert data["meta"]["transport"] == "mpi" and data["meta"]["ranks"] == world.Get_size()
        assert len(data["rows"]) == len(rows)
        for r in data["rows"]:
            if r["section"] == "torch":
                assert {"dist_us", "bare_us", "goal_us"} <= set(r["extra"])

    _check_on_rank0(world, check, where)


@pytest.mark.mpi(min_size=2)
def test_coalesced_study_checks_its_results(capsys):
    code = bench.main(["--study", "coalesced", "--arrays", "6", "--array-bytes", "64"])
    assert code == 0
    out = capsys.readouterr().out
    if MPI.COMM_WORLD.Get_rank() == 0:
        assert "wrong elements: 0" in out
        assert "| coalesced |" in out and "| separate |" in out


@pytest.mark.mpi(min_size=2)
def test_wake_study_checks_its_messages(capsys, tmp_path_factory):
    path = tmp_path_factory.mktemp("wake") / f"wake{MPI.COMM_WORLD.Get_rank()}.json"
    code = bench.main(
        ["--study", "wake", "--pause", "1", "--rounds", "1", "-n", "3", "--json", str(path)]
    )
    assert code == 0
    out = capsys.readouterr().out
    if MPI.COMM_WORLD.Get_rank() == 0:
        assert "wrong messages: 0" in out and "1 ms pause" in out
        rows = json.loads(path.read_text())["rows"]
        assert [r["bytes"] for r in rows] == [8, 65536, 1 << 20]
        # each round trip holds two pauses of at least 1 ms: nothing is left below them
        assert all(r["hetcomm_us"] >= 0 and r["mpi4py_us"] >= 0 for r in rows), rows


@pytest.mark.mpi(min_size=2)
def test_lane_study_checks_every_way(capsys, tmp_path_factory):
    path = tmp_path_factory.mktemp("lane") / f"lane{MPI.COMM_WORLD.Get_rank()}.json"
    argv = ["--study", "lane", "--op", "all_reduce,reduce,broadcast,reduce_scatter"]
    argv += ["-b", "64K", "-e", "1M", "-f", "16", "--rounds", "1", "-n", "2", "--json", str(path)]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    if MPI.COMM_WORLD.Get_rank() == 0:
        assert "wrong elements: 0" in out and "| hetcomm's way |" in out
        data = json.loads(path.read_text())
        rows = data["rows"]
        n = MPI.COMM_WORLD.Get_size()
        ops = ("all_reduce", "reduce", "broadcast", "reduce_scatter")
        # reduce_scatter's input holds whole blocks of float32, one per rank
        sizes = {op: (65536, 1 << 20) for op in ops[:3]}
        sizes["reduce_scatter"] = tuple(b // 4 // n * n * 4 for b in (65536, 1 << 20))
        assert [(r["op"], r["bytes"]) for r in rows] == [(op, b) for op in ops for b in sizes[op]]
        # 1 MiB all_reduces and reduces take the lane (LANE_MIN), 64 KiB ones the calling thread
        ways = {(r["op"], r["bytes"]): r["way"] for r in rows}
        assert ways[("all_reduce", 1 << 20)] == ways[("reduce", 1 << 20)] == "lane", ways
        assert {ways[(op, sizes[op][0])] for op in ops} == {"calling thread"}, ways
        assert all(r["direct_us"] > 0 and r["thread/direct"] > 0 for r in rows), rows


@pytest.mark.mpi(min_size=2)
def test_lane_study_refuses_an_unknown_op():
    with pytest.raises(SystemExit, match="--op takes all_reduce"):
        bench.main(["--study", "lane", "--op", "all_gather"])
