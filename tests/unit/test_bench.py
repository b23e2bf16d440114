"""hetcomm bench without MPI: sizes, bus-bandwidth factors, rows, JSON, the table and the plot."""

from __future__ import annotations

import json

import pytest

from hetcomm.bench.report import (
    NCCL_DATA_COLUMNS,
    ROW_KEYS,
    add_ratios,
    bus_factor,
    canonical_dtype,
    canonical_op,
    element_count,
    make_row,
    nccl_report,
    nccl_time,
    parse_size,
    plot,
    size_steps,
    to_json,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("8", 8),
        ("1K", 1024),
        ("64k", 65536),
        ("256M", 256 << 20),
        ("1G", 1 << 30),
        ("2KiB", 2048),
        ("1MB", 1 << 20),
        (" 16 ", 16),
        (0, 0),
        (4096, 4096),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "K", "1X", "-8", "1.5.2M"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_size_steps_like_nccl_tests():
    assert size_steps(8, 256 << 20, 2)[:3] == [8, 16, 32]
    assert size_steps(8, 256 << 20, 2)[-1] == 256 << 20
    assert len(size_steps(8, 256 << 20, 2)) == 26
    assert size_steps(8, parse_size("1M"), 8) == [8, 64, 512, 4096, 32768, 262144]
    assert size_steps(8, 4096, 8) == [8, 64, 512, 4096]
    assert size_steps(100, 100, 2) == [100]
    for bad in ((0, 8, 2), (16, 8, 2), (8, 64, 1)):
        with pytest.raises(ValueError):
            size_steps(*bad)


def test_size_steps_in_step_bytes_like_nccl_tests_i():
    assert size_steps(1 << 20, 4 << 20, 1, step_bytes=1 << 20) == [
        1 << 20,
        2 << 20,
        3 << 20,
        4 << 20,
    ]
    assert size_steps(8, 20, 1, step_bytes=5) == [8, 13, 18]
    assert size_steps(8, 64, 2, step_bytes=5) == [8, 16, 32, 64]  # a factor above 1 wins
    with pytest.raises(ValueError):
        size_steps(8, 64, 1, step_bytes=-1)


def test_datatype_names_of_hetcomm_and_nccl_tests():
    known = ("bool", "int8", "uint8", "int32", "int64", "float16", "bfloat16", "float32", "float64")
    assert canonical_dtype("float", known) == "float32"
    assert canonical_dtype("half", known) == "float16"
    assert canonical_dtype("double", known) == "float64"
    assert canonical_dtype("bfloat16", known) == "bfloat16"
    assert canonical_dtype("Float32", known) == "float32"
    assert canonical_dtype("int32", known) == "int32"
    for bad in ("uint32", "uint64", "all", "fp8"):
        with pytest.raises(ValueError, match="unknown datatype"):
            canonical_dtype(bad, known)


def test_nccl_time_cells():
    assert nccl_time(1.234) == "   1.23"
    assert nccl_time(135.84) == "  135.8"
    assert nccl_time(12646.4) == "  12646"


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_bus_factors(n):
    assert bus_factor("all_reduce", n) == pytest.approx(2 * (n - 1) / n)
    for op in (
        "all_gather",
        "reduce_scatter",
        "all_to_all",
        "allgather",
        "reducescatter",
        "alltoall",
    ):
        assert bus_factor(op, n) == pytest.approx((n - 1) / n)
    for op in ("broadcast", "reduce", "sendrecv"):
        assert bus_factor(op, n) == 1.0


def test_bus_factor_values():
    assert bus_factor("allreduce", 8) == pytest.approx(1.75)
    assert bus_factor("all_gather", 4) == pytest.approx(0.75)
    with pytest.raises(ValueError):
        bus_factor("all_reduce", 0)


def test_op_names():
    assert canonical_op("allreduce") == "all_reduce"
    assert canonical_op("AllGather") == "all_gather"
    assert canonical_op("reducescatter") == "reduce_scatter"
    assert canonical_op("alltoall") == "all_to_all"
    assert canonical_op("all-to-all") == "all_to_all"
    assert canonical_op("sendrecv") == "sendrecv"
    assert canonical_op("broadcast") == "broadcast"
    with pytest.raises(ValueError, match="unknown op"):
        canonical_op("gather")


def test_element_count_whole_blocks():
    assert element_count("all_reduce", 8, 4, 4) == 2
    assert element_count("all_gather", 8, 4, 4) == 4  # at least one element per rank
    assert element_count("all_gather", 40, 4, 4) == 8  # 10 elements -> 2 blocks of 4
    assert element_count("broadcast", 1, 4, 4) == 1


def _row(transport, kind, busbw_time, size=4096, op="all_reduce", wrong=0, form="out-of-place"):
    return make_row(
        op=op,
        form=form,
        transport=transport,
        kind=kind,
        count=size // 4,
        itemsize=4,
        dtype="float32",
        redop="sum",
        root=None,
        ranks=2,
        time_s=busbw_time,
        wrong=wrong,
    )


def test_row_formulas():
    r = _row("auto", "hetcomm", 1e-6)
    assert r["size_bytes"] == 4096 and r["count"] == 1024
    assert r["time_us"] == pytest.approx(1.0)
    assert r["algbw_GBps"] == pytest.approx(4096 / 1e-6 / 1e9)
    assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * 1.0)  # 2 ranks: 2(n-1)/n = 1
    g = make_row(
        op="all_gather",
        transport="mpi",
        kind="hetcomm",
        count=1024,
        itemsize=4,
        dtype="float32",
        redop=None,
        root=None,
        ranks=4,
        time_s=2e-6,
        wrong=None,
    )
    assert g["busbw_GBps"] == pytest.approx(g["algbw_GBps"] * 0.75)


def test_ratios_against_best_baseline():
    rows = [
        _row("auto", "hetcomm", 1e-6),
        _row("mpi4py", "baseline", 2e-6),
        _row("gloo", "baseline", 4e-6),
        _row("auto", "hetcomm", 1e-6, size=8),
    ]
    add_ratios(rows)
    assert rows[0]["ratio"] == pytest.approx(2.0)
    assert rows[1]["ratio"] == pytest.approx(1.0)
    assert rows[2]["ratio"] == pytest.approx(0.5)
    assert rows[3]["ratio"] is None  # no baseline at that size


def test_json_schema():
    rows = [_row("auto", "hetcomm", 1e-6), _row("mpi4py", "baseline", 2e-6)]
    add_ratios(rows)
    doc = json.loads(to_json(rows, ranks=2))
    assert doc["ranks"] == 2
    assert len(doc["rows"]) == 2
    for r in doc["rows"]:
        assert tuple(r) == ROW_KEYS
        for key in ("op", "form", "transport", "dtype"):
            assert isinstance(r[key], str)
        for key in ("size_bytes", "count", "ranks", "wrong"):
            assert isinstance(r[key], int)
        for key in ("time_us", "algbw_GBps", "busbw_GBps", "ratio"):
            assert isinstance(r[key], float)
    for key in (
        "op",
        "transport",
        "size_bytes",
        "dtype",
        "time_us",
        "algbw_GBps",
        "busbw_GBps",
        "wrong",
        "ratio",
    ):
        assert key in ROW_KEYS


def parse_nccl_tests(text):
    """Read nccl-tests output as cluster scripts do: data lines are the lines that do not start
    with '#', split on whitespace, the columns at nccl-tests' positions; the closing lines by
    their labels."""
    rows, oob, avg = [], None, None
    for line in text.splitlines():
        if line.startswith("# Out of bounds values"):
            oob = line.split(":")[1].split()
        elif line.startswith("# Avg bus bandwidth"):
            avg = float(line.split(":")[1].split()[0])
        elif line.strip() and not line.startswith("#"):
            c = line.split()
            rows.append(
                {
                    "size": int(c[0]),
                    "count": int(c[1]),
                    "type": c[2],
                    "redop": c[3],
                    "root": int(c[4]),
                    "oop": (c[5], c[6], c[7], c[8]),
                    "ip": (c[9], c[10], c[11], c[12]),
                    "extra": c[13:],
                }
            )
    return rows, oob, avg


META = {
    "min_bytes": 8,
    "max_bytes": 4096,
    "step": (8, "factor"),
    "warmup": 1,
    "iters": 3,
    "check": 1,
    "ranks": 2,
    "notes": ["a note"],
}
DEVICES = [
    {"rank": r, "pid": 100 + r, "host": "node", "device": -1, "bus": 0, "name": "cpu"}
    for r in (0, 1)
]


def test_nccl_report_reads_as_nccl_tests():
    rows = []
    for size, t in ((8, 2e-6), (4096, 5e-6)):
        rows.append(_row("auto", "hetcomm", t, size=size))
        rows.append(_row("auto", "hetcomm", t / 2, size=size, form="in-place", wrong=1))
        rows.append(_row("mpi4py", "baseline", t / 4, size=size))
    add_ratios(rows)
    text = nccl_report(rows, META, DEVICES)
    lines = text.splitlines()
    assert lines[0] == (
        "# nThread 1 nGpus 1 minBytes 8 maxBytes 4096 step: 8(factor) warmup iters: 1 iters: 3 "
        "agg iters: 1 validation: 1 graph: 0"
    )
    assert "# Using devices" in lines
    assert [ln for ln in lines if ln.startswith("#  Rank")] == [
        "#  Rank  0 Group  0 Pid    100 on       node device -1 [0x00] cpu",
        "#  Rank  1 Group  0 Pid    101 on       node device -1 [0x00] cpu",
    ]
    head = next(ln for ln in lines if "redop" in ln)
    pair = ["time", "algbw", "busbw", "#wrong"]
    assert head.split() == ["#", "size", "count", "type", "redop", "root", *pair, *pair]
    assert any(ln.startswith("#") and "out-of-place" in ln and "in-place" in ln for ln in lines)
    data, oob, avg = parse_nccl_tests(text)
    assert len(data) == 2  # hetcomm's rows only: the baseline's lines are comments
    assert all(len(ln.split()) == NCCL_DATA_COLUMNS for ln in lines if not ln.startswith("#"))
    first = data[0]
    key = (first["size"], first["count"], first["type"], first["redop"], first["root"])
    assert key == (8, 2, "float", "sum", -1)  # nccl-tests' name of float32
    assert float(first["oop"][0]) == pytest.approx(2.0)
    assert float(first["ip"][0]) == pytest.approx(1.0)
    assert float(first["oop"][1]) == pytest.approx(8 / 2e-6 / 1e9, abs=0.01)
    assert first["oop"][3] == "0" and first["ip"][3] == "1"
    assert oob == ["2", "FAILED"]
    mine = [r for r in rows if r["kind"] == "hetcomm"]
    assert avg == pytest.approx(sum(r["busbw_GBps"] for r in mine) / len(mine), rel=1e-5)
    assert any(ln.startswith("#") and "4096" in ln for ln in lines if "mpi4py" not in ln)


def test_nccl_report_marks_missing_forms_and_unchecked():
    rows = [_row("auto", "hetcomm", 1e-6, op="broadcast", form="in-place", wrong=None)]
    meta = {**META, "check": 0}
    data, oob, _ = parse_nccl_tests(nccl_report(rows, meta, DEVICES))
    assert data[0]["oop"] == ("N/A", "N/A", "N/A", "N/A")
    assert data[0]["ip"][3] == "N/A"
    assert oob == ["0", "OK"]


def test_nccl_report_extra_columns_come_after_nccl_tests_columns():
    rows = [_row("staged", "hetcomm", 1e-6), _row("mpi4py", "baseline", 2e-6)]
    add_ratios(rows)
    data, _, _ = parse_nccl_tests(nccl_report(rows, META, DEVICES, extra=True))
    assert data[0]["extra"] == ["staged", "2.00x", "-"]
    plain, _, _ = parse_nccl_tests(nccl_report(rows, META, DEVICES))
    assert plain[0]["extra"] == []


def test_blocked_ops_count_per_rank_like_nccl_tests():
    rows = [_row("auto", "hetcomm", 1e-6, op="all_gather", size=4096)]
    data, _, _ = parse_nccl_tests(nccl_report(rows, META, DEVICES))
    assert data[0]["size"] == 4096 and data[0]["count"] == 512  # 1024 elements over 2 ranks


def test_plot_writes_png(tmp_path):
    rows = [
        _row("auto", "hetcomm", 1e-6),
        _row("mpi4py", "baseline", 2e-6),
        _row("auto", "hetcomm", 1e-6, size=8),
        _row("mpi4py", "baseline", 1e-6, size=8),
    ]
    path = tmp_path / "bw.png"
    plot(rows, str(path), ranks=2, when="2025-01-01")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_overhead_table_ratios():
    """The overhead table's ratios come from the rows: medians, and the per-round pairs."""
    from hetcomm.bench.overhead import overhead_table

    def row(impl, us, **extra):
        return {
            "case": "8 B float32",
            "impl": impl,
            "ranks": 2,
            "median_us": us,
            "spread": 0.25,
            **extra,
        }

    rows = [
        row("hetcomm", 6.0),
        row("gloo", 420.0),
        row("hetcomm numpy", 3.0, paired_ratio=2.4),
        row("mpi4py", 1.2),
    ]
    line = overhead_table(rows).splitlines()[2]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[6:] == ["2.50x", "2.40x", "70.00x", "25%"]
    no_numpy = overhead_table([row("hetcomm", 6.0), row("gloo", 12.0)]).splitlines()[2]
    assert [c.strip() for c in no_numpy.strip("|").split("|")][6:] == ["-", "-", "2.00x", "25%"]


def test_every_study_resolves_to_a_function():
    import importlib

    from hetcomm.bench.main import STUDIES

    for name, (module, function, what) in STUDIES.items():
        assert callable(getattr(importlib.import_module(f"hetcomm.bench.{module}"), function)), name
        assert what


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-g", "2"], "one GPU per rank"),
        (["-t", "4"], "one thread per rank"),
        (["-d", "uint32"], "hetcomm has no uint32"),
        (["-d", "all"], "unknown datatype"),
        (["--latency", "--study", "ddp"], "give one"),
        (["-c", "-1"], "-c takes 0 or a positive count"),
        (["-b", "1X"], "expected a size"),
        (["--latency", "-b", "64", "-e", "8"], "need 0 < begin <= end"),
        (["-f", "1"], "give step bytes"),
    ],
)
def test_bench_refuses_what_it_cannot_do_before_any_mpi(argv, message):
    from hetcomm.bench import main as bench

    with pytest.raises(SystemExit, match=message):
        bench.main(argv)


def test_bench_accepts_nccl_tests_spellings():
    import argparse

    from hetcomm.bench.main import _defaults, _refuse, add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["-b", "8", "-e", "128M", "-f", "2", "-c", "1", "-d", "half", "-o", "max"])
    _refuse(args)
    _defaults(args)
    assert (args.dtype, args.redop, args.check, args.iters, args.warmup) == (
        "float16",
        "max",
        1,
        20,
        5,
    )
    assert p.parse_args(["-c"]).check == 1 and p.parse_args(["-c", "0"]).check == 0
    assert p.parse_args(["-z", "1"]).blocking == 1
    latency = p.parse_args(["--latency"])
    _defaults(latency)
    assert (latency.maxbytes, latency.iters, latency.stepfactor) == ("16M", 100, 2.0)


def test_copies_study_says_it_needs_a_gpu(monkeypatch):
    import argparse

    from hetcomm.kernels import device

    from hetcomm.bench import copies

    monkeypatch.setattr(device, "unavailable", lambda: "no GPU visible to cupy")
    with pytest.raises(SystemExit, match="times copies on a GPU: no GPU visible to cupy"):
        copies.run(argparse.Namespace())
