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
FORMS = ("out-of-place", "in-place")
ROW_KEYS = (
    "op",
    "form",
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


def size_steps(begin: int, end: int, factor: float = 2, step_bytes: int | None = None) -> list[int]:
    """Sizes from `begin` to `end` (both included when reached): each `factor` times the last,
    or, with a factor of 1 (or less) and `step_bytes`, each `step_bytes` more (nccl-tests'
    -b/-e/-f/-i)."""
    if begin <= 0 or end < begin:
        raise ValueError(f"need 0 < begin <= end, got begin={begin}, end={end}")
    if factor <= 1 and not step_bytes:
        raise ValueError(f"the step factor must be above 1 (or give step bytes), got {factor}")
    if step_bytes is not None and step_bytes <= 0:
        raise ValueError(f"step bytes must be positive, got {step_bytes}")
    out, size = [], begin
    while size <= end:
        out.append(size)
        size = int(size * factor) if factor > 1 else size + int(step_bytes or 0)
    return out


#: hetcomm dtype -> the name nccl-tests prints in its `type` column (and accepts after -d)
NCCL_TYPE_NAMES = {
    "float32": "float",
    "float16": "half",
    "float64": "double",
    "bfloat16": "bfloat16",
    "int8": "int8",
    "uint8": "uint8",
    "int32": "int32",
    "int64": "int64",
}
# the other spellings nccl-tests accepts for -d
_NCCL_TYPE_ALIASES = {"fp32": "float32", "fp16": "float16", "fp64": "float64", "char": "int8"}


def canonical_dtype(name: str, known: Sequence[str]) -> str:
    """hetcomm's dtype for a name of its own (`known`) or of nccl-tests (`float`, `half`, ...)."""
    key = name.strip().lower()
    if key in known:
        return key
    by_nccl = {v: k for k, v in NCCL_TYPE_NAMES.items()}
    key = by_nccl.get(key, _NCCL_TYPE_ALIASES.get(key, key))
    if key in known:
        return key
    raise ValueError(
        f"unknown datatype {name!r}; expected one of {', '.join(known)} or nccl-tests' "
        f"{', '.join(NCCL_TYPE_NAMES.values())} (hetcomm has no uint32, uint64 or 'all')"
    )


def type_name(dtype: str) -> str:
    """The `type` column: nccl-tests' name where it has one, else hetcomm's."""
    return NCCL_TYPE_NAMES.get(dtype, dtype)


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
    form: str = "out-of-place",
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
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    size = count * itemsize
    algbw = size / time_s / 1e9 if time_s > 0 else 0.0
    return {
        "op": op,
        "form": form,
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
    """Each row's ratio: its busbw over the best baseline's busbw of the same op, size and form
    (of either form where no baseline has this one)."""
    best: dict[tuple[str, int, str | None], float] = {}
    for r in rows:
        if r["kind"] == "baseline":
            form = r.get("form", "out-of-place")
            for key in ((r["op"], r["size_bytes"], form), (r["op"], r["size_bytes"], None)):
                best[key] = max(best.get(key, 0.0), r["busbw_GBps"])
    for r in rows:
        key = (r["op"], r["size_bytes"], r.get("form", "out-of-place"))
        top = best.get(key) or best.get((r["op"], r["size_bytes"], None))
        r["ratio"] = r["busbw_GBps"] / top if top else None


def nccl_time(us: float) -> str:
    """nccl-tests' time cell: 2 decimals below 100 us, 1 below 10 ms, none above."""
    if us >= 10000:
        return f"{us:7.0f}"
    return f"{us:7.1f}" if us >= 100 else f"{us:7.2f}"


def nccl_count(op: str, count: int, ranks: int) -> int:
    """nccl-tests' count column: elements per rank's block for the ops that split the array in
    blocks (all_gather, reduce_scatter, all_to_all), else the array's elements."""
    return count // ranks if op in BLOCKED else count


# the column lines of nccl-tests' table (out-of-place then in-place: time, algbw, busbw, #wrong)
_NCCL_FORMS = "#" + " " * 62 + "out-of-place" + " " * 23 + "in-place"
_NCCL_HEAD = (
    "#       size         count      type   redop    root"
    "     time   algbw   busbw #wrong     time   algbw   busbw #wrong"
)
_NCCL_UNITS = (
    "#        (B)    (elements)                        "
    "       (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)"
)
NCCL_DATA_COLUMNS = 13  # size count type redop root, then time algbw busbw #wrong twice


def _pair_cells(r: dict[str, Any] | None, checked: bool) -> str:
    if r is None:  # hetcomm (or the baseline) has no such form of the op
        return f"  {'N/A':>7}  {'N/A':>6}  {'N/A':>6}  {'N/A':>5}"
    wrong = "N/A" if r["wrong"] is None or not checked else str(r["wrong"])
    return (
        f"  {nccl_time(r['time_us'])}  {r['algbw_GBps']:6.2f}  {r['busbw_GBps']:6.2f}  {wrong:>5}"
    )


def nccl_lines(
    rows: Sequence[dict[str, Any]], ranks: int, checked: bool, extra: bool = False
) -> list[str]:
    """nccl-tests' column lines and one data line per size of `rows` (one op, one
    implementation): the out-of-place columns, then the in-place ones; with `extra`, hetcomm's
    columns after them (transport, then busbw / best baseline's per form)."""
    lines = [_NCCL_FORMS, _NCCL_HEAD + ("  transport  vs-best(oop)  vs-best(ip)" if extra else "")]
    lines.append(_NCCL_UNITS)
    by_size: dict[int, dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_size.setdefault(r["size_bytes"], {})[r.get("form", "out-of-place")] = r
    for size, forms in by_size.items():
        any_row = next(iter(forms.values()))
        root = "-1" if any_row["root"] is None else str(any_row["root"])
        line = (
            f"{size:12d}  {nccl_count(any_row['op'], any_row['count'], ranks):12d}  "
            f"{type_name(any_row['dtype']):>8}  {any_row['redop'] or 'none':>6}  {root:>6}"
        )
        line += _pair_cells(forms.get("out-of-place"), checked)
        line += _pair_cells(forms.get("in-place"), checked)
        if extra:
            ratios = [forms.get(f, {}).get("ratio") for f in FORMS]
            line += f"  {any_row['transport']:>9}" + "".join(
                f"  {'-' if v is None else f'{v:.2f}x':>11}" for v in ratios
            )
        lines.append(line)
    return lines


def nccl_summary(rows: Sequence[dict[str, Any]]) -> list[str]:
    """nccl-tests' closing lines: wrong elements over every row, and the mean busbw."""
    wrong = sum(r["wrong"] or 0 for r in rows)
    bws = [r["busbw_GBps"] for r in rows]
    avg = sum(bws) / len(bws) if bws else 0.0
    return [
        f"# Out of bounds values : {wrong} {'FAILED' if wrong else 'OK'}",
        f"# Avg bus bandwidth    : {avg:g} ",
        "#",
    ]


def nccl_header(meta: dict[str, Any], devices: Sequence[dict[str, Any]]) -> list[str]:
    """nccl-tests' opening block: the parameters line, then one `#  Rank ...` line per rank."""
    step = meta["step"]
    lines = [
        f"# nThread 1 nGpus 1 minBytes {meta['min_bytes']} maxBytes {meta['max_bytes']} "
        f"step: {step[0]}({step[1]}) warmup iters: {meta['warmup']} iters: {meta['iters']} "
        f"agg iters: 1 validation: {meta['check']} graph: 0"
    ]
    if meta.get("blocking"):
        lines.append("# Blocking Enabled: wait for completion and barrier after each collective ")
    lines += ["#", "# Using devices"]
    for d in devices:
        lines.append(
            f"#  Rank {d['rank']:2d} Group  0 Pid {d['pid']:6d} on {d['host']:>10s} "
            f"device {d['device']:2d} [0x{d['bus']:02x}] {d['name']}"
        )
    return lines


def nccl_report(
    rows: Sequence[dict[str, Any]],
    meta: dict[str, Any],
    devices: Sequence[dict[str, Any]],
    extra: bool = False,
) -> str:
    """The whole nccl-tests style report of one op: the opening block, hetcomm's notes as
    comments, one table per hetcomm transport with its closing lines, then each baseline's
    table as comment lines (nccl-tests parsers read hetcomm's rows only)."""
    checked = bool(meta["check"])
    ranks = int(meta["ranks"])
    lines = nccl_header(meta, devices)
    lines += ["#"] + [f"# {note}" for note in meta.get("notes", ())]
    impls = list(dict.fromkeys(r["transport"] for r in rows))
    for kind in ("hetcomm", "baseline"):
        for name in impls:
            mine = [r for r in rows if r["transport"] == name and r["kind"] == kind]
            if not mine:
                continue
            body = nccl_lines(mine, ranks, checked, extra)
            if kind == "hetcomm":
                lines += ["#", f"# hetcomm transport {name}", *body, *nccl_summary(mine)]
            else:
                lines += ["#", f"# baseline {name} (commented out: not hetcomm's rows)"]
                lines += [ln if ln.startswith("#") else "#" + ln for ln in body]
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
        # one line per implementation: its out-of-place rows where it has them
        oop = {r["transport"] for r in mine if r.get("form", "out-of-place") == "out-of-place"}
        mine = [
            r
            for r in mine
            if r.get("form", "out-of-place") == "out-of-place" or r["transport"] not in oop
        ]
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
