"""Sizes, bus-bandwidth factors and the table, JSON and plot of `hetcomm bench` (no MPI here).

The columns and formulas follow nccl-tests (see docs/bench.md): algbw = bytes / time and
busbw = algbw x factor, with the factor of `bus_factor`.
"""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Iterable, Sequence
from typing import Any

OPS = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "reduce",
    "all_to_all",
    "sendrecv",
)
# nccl-tests' names (and a few spellings) -> hetcomm's
OP_ALIASES = {
    "allreduce": "all_reduce",
    "allgather": "all_gather",
    "reducescatter": "reduce_scatter",
    "alltoall": "all_to_all",
    "bcast": "broadcast",
    "send_recv": "sendrecv",
}
# ops whose size is the whole array spread over (or gathered from) every rank: the count must
# split into one equal block per rank
BLOCKED = frozenset(("all_gather", "reduce_scatter", "all_to_all"))
REDUCING = frozenset(("all_reduce", "reduce_scatter", "reduce"))
ROOTED = frozenset(("broadcast", "reduce"))
ROW_KEYS = (
    "op",
    "transport",
    "kind",
    "size_bytes",
    "count",
    "dtype",
    "redop",
    "root",
    "ranks",
    "time_us",
    "algbw_GBps",
    "busbw_GBps",
    "wrong",
    "ratio",
)

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str | int) -> int:
    """Bytes from nccl-tests' notation: '8', '1K', '256M', '1G' (powers of 1024; 'KiB', 'MB' ok)."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must not be negative, got {text}")
        return text
    m = _SIZE.match(str(text))
    if m is None:
        raise ValueError(f"expected a size such as 8, 64K, 256M or 1G, got {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def size_steps(begin: int, end: int, factor: float = 2) -> list[int]:
    """Sizes from `begin` to `end` (both included when reached), each `factor` times the last
    (nccl-tests' -b/-e/-f)."""
    if begin <= 0 or end < begin:
        raise ValueError(f"need 0 < begin <= end, got begin={begin}, end={end}")
    if factor <= 1:
        raise ValueError(f"the step factor must be above 1, got {factor}")
    out, size = [], begin
    while size <= end:
        out.append(size)
        size = int(size * factor)
    return out


def canonical_op(name: str) -> str:
    """hetcomm's name of an op given by its own or nccl-tests' name."""
    key = name.strip().lower().replace("-", "_")
    key = OP_ALIASES.get(key.replace("_", ""), OP_ALIASES.get(key, key))
    if key not in OPS:
        raise ValueError(
            f"unknown op {name!r}; expected one of {', '.join(OPS)} (or {', '.join(OP_ALIASES)})"
        )
    return key


def bus_factor(op: str, ranks: int) -> float:
    """busbw / algbw of nccl-tests for `op` on `ranks` ranks."""
    op = canonical_op(op)
    if ranks < 1:
        raise ValueError(f"ranks must be at least 1, got {ranks}")
    if op == "all_reduce":
        return 2 * (ranks - 1) / ranks
    if op in BLOCKED:
        return (ranks - 1) / ranks
    return 1.0


def element_count(op: str, size_bytes: int, itemsize: int, ranks: int) -> int:
    """Elements of the benchmarked array for a size: at least one (one per rank for the ops that
    split it in blocks), rounded down to whole blocks as nccl-tests does."""
    count = max(1, size_bytes // itemsize)
    if op in BLOCKED:
        count = max(ranks, count - count % ranks)
    return count


def make_row(
    *,
    op: str,
    transport: str,
    kind: str,
    count: int,
    itemsize: int,
    dtype: str,
    redop: str | None,
    root: int | None,
    ranks: int,
    time_s: float,
    wrong: int | None,
) -> dict[str, Any]:
    """One result row (keys ROW_KEYS; ratio filled in later by `add_ratios`)."""
    size = count * itemsize
    algbw = size / time_s / 1e9 if time_s > 0 else 0.0
    return {
        "op": op,
        "transport": transport,
        "kind": kind,
        "size_bytes": size,
        "count": count,
        "dtype": dtype,
        "redop": redop,
        "root": root,
        "ranks": ranks,
        "time_us": time_s * 1e6,
        "algbw_GBps": algbw,
        "busbw_GBps": algbw * bus_factor(op, ranks),
        "wrong": wrong,
        "ratio": None,
    }


def add_ratios(rows: Sequence[dict[str, Any]]) -> None:
    """Each row's ratio: its busbw over the best baseline's busbw of the same op and size."""
    best: dict[tuple[str, int], float] = {}
    for r in rows:
        if r["kind"] == "baseline":
            key = (r["op"], r["size_bytes"])
            best[key] = max(best.get(key, 0.0), r["busbw_GBps"])
    for r in rows:
        top = best.get((r["op"], r["size_bytes"]))
        r["ratio"] = r["busbw_GBps"] / top if top else None


def _num(value: float) -> str:
    return f"{value:.2f}" if value < 1e4 else f"{value:.4g}"


def _size(n: int) -> str:
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def table(rows: Sequence[dict[str, Any]]) -> str:
    """nccl-tests style text: a header of two comment lines, one line per size and transport."""
    head = (
        "#",
        "size",
        "count",
        "type",
        "redop",
        "root",
        "transport",
        "time",
        "algbw",
        "busbw",
        "#wrong",
        "vs best",
    )
    units = ("#", "(B)", "(elements)", "", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "baseline")
    widths = (1, 12, 12, 9, 6, 5, 10, 11, 8, 8, 7, 9)
    lines = []
    for op in dict.fromkeys(r["op"] for r in rows):
        lines.append(f"# {op}")
        lines.append(" ".join(f"{h:>{w}}" for h, w in zip(head, widths)))
        lines.append(" ".join(f"{h:>{w}}" for h, w in zip(units, widths)))
        last = None
        for r in (r for r in rows if r["op"] == op):
            if last is not None and r["size_bytes"] != last:
                lines.append("")
            last = r["size_bytes"]
            cells = (
                "",
                str(r["size_bytes"]),
                str(r["count"]),
                r["dtype"],
                r["redop"] or "none",
                "-1" if r["root"] is None else str(r["root"]),
                r["transport"],
                f"{r['time_us']:.1f}",
                _num(r["algbw_GBps"]),
                _num(r["busbw_GBps"]),
                "N/A" if r["wrong"] is None else str(r["wrong"]),
                "-" if r["ratio"] is None else f"{r['ratio']:.2f}x",
            )
            lines.append(" ".join(f"{c:>{w}}" for c, w in zip(cells, widths)))
    return "\n".join(lines)


def to_json(rows: Iterable[dict[str, Any]], **meta: Any) -> str:
    """{"rows": [...], **meta} with every row reduced to ROW_KEYS."""
    return json.dumps({"rows": [{k: r.get(k) for k in ROW_KEYS} for r in rows], **meta}, indent=1)


def plot(rows: Sequence[dict[str, Any]], path: str, ranks: int, when: str | None = None) -> None:
    """busbw against size, one line per transport or baseline, one panel per op (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = list(dict.fromkeys(r["op"] for r in rows)) or ["(no results)"]
    when = when or datetime.date.today().isoformat()
    fig, axes = plt.subplots(1, len(ops), figsize=(6.4 * len(ops), 4.6), squeeze=False)
    for ax, op in zip(axes[0], ops):
        mine = [r for r in rows if r["op"] == op and r["busbw_GBps"] > 0]
        for name in dict.fromkeys(r["transport"] for r in mine):
            pts = [(r["size_bytes"], r["busbw_GBps"]) for r in mine if r["transport"] == name]
            kind = next(r["kind"] for r in mine if r["transport"] == name)
            ax.plot(
                *zip(*pts),
                marker="o",
                markersize=3,
                linestyle="--" if kind == "baseline" else "-",
                label=name if kind != "baseline" else f"{name} (baseline)",
            )
        if mine:
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.legend(fontsize="small")
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        dtype = mine[0]["dtype"] if mine else ""
        ax.set_title(f"{op} {dtype}, {ranks} ranks, {when}")
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
