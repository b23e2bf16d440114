"""hetcomm bench without MPI: sizes, bus-bandwidth factors, rows, JSON, the table and the plot."""

from __future__ import annotations

import json

import pytest

from hetcomm.bench_report import (
    ROW_KEYS,
    add_ratios,
    bus_factor,
    canonical_op,
    element_count,
    make_row,
    parse_size,
    plot,
    size_steps,
    table,
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


def _row(transport, kind, busbw_time, size=4096, op="all_reduce", wrong=0):
    return make_row(
        op=op,
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
        for key in ("op", "transport", "dtype"):
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


def test_table_layout():
    rows = [
        _row("auto", "hetcomm", 1e-6),
        _row("mpi4py", "baseline", 2e-6),
        _row("auto", "hetcomm", 1e-6, size=8, wrong=None),
    ]
    add_ratios(rows)
    lines = table(rows).splitlines()
    assert lines[0] == "# all_reduce"
    assert lines[1].startswith("#") and "busbw" in lines[1] and "#wrong" in lines[1]
    assert "(GB/s)" in lines[2] and "(us)" in lines[2]
    body = [ln for ln in lines[3:] if ln.strip()]
    assert len(body) == 3
    assert len({len(ln) for ln in lines[1:] if ln.strip()}) == 1  # aligned columns
    first = body[0].split()
    assert first[:7] == ["4096", "1024", "float32", "sum", "-1", "auto", "1.0"]
    assert first[-2:] == ["0", "2.00x"]
    assert body[2].split()[-2:] == ["N/A", "-"]
    assert "" in lines  # a blank line between sizes


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
    from hetcomm.bench import overhead_table

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
