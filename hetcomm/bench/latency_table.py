"""The rows, text table and JSON of `hetcomm bench --latency` (no MPI here).

A row is one op in one form at one size: hetcomm's time per call beside its floor measured in
the same run, their ratio and the spread of the rounds. Sections say what hetcomm and the floor
are: `host` (hetcomm on numpy arrays vs raw mpi4py doing the same op the same way), `torch`
(`dist.<op>` through a hetcomm ProcessGroup minus the same op on the bare Communicator, vs a
trivial Python ProcessGroup: torch's own dispatch), `device` (hetcomm on device arrays vs the
copies and signals any transport must make). Data lines split on whitespace; a missing value
is `-`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

#: (op, form) of every row of the host and device sections, in table order. "async": the call
#: made asynchronous (async_op=True; MPI's non-blocking call) and waited for at once, in place
#: for all_reduce, reduce and broadcast, out of place for the others; for send/recv, each send
#: and receive of the ping-pong so. "exchange": both ranks of a pair call sendrecv at once;
#: "exchange-async": the same sendrecv made asynchronous and waited for at once
FORMS: tuple[tuple[str, str], ...] = (
    ("all_reduce", "in-place"),
    ("all_reduce", "out-of-place"),
    ("all_reduce", "async"),
    ("reduce", "in-place"),
    ("reduce", "async"),
    ("broadcast", "in-place"),
    ("broadcast", "async"),
    ("all_gather", "out-of-place"),
    ("all_gather", "in-place"),
    ("all_gather", "async"),
    ("reduce_scatter", "out-of-place"),
    ("reduce_scatter", "in-place"),
    ("reduce_scatter", "async"),
    ("all_to_all", "out-of-place"),
    ("all_to_all", "in-place"),
    ("all_to_all", "async"),
    ("sendrecv", "ping-pong"),
    ("sendrecv", "async"),
    ("sendrecv", "exchange"),
    ("sendrecv", "exchange-async"),
    ("all_reduce_coalesced", "in-place"),
    ("barrier", "-"),
)
#: (op, form) of the torch section: the ops the torch layer's goals name
TORCH_FORMS: tuple[tuple[str, str], ...] = (
    ("all_reduce", "in-place"),
    ("all_reduce", "async"),
    ("broadcast", "in-place"),
    ("broadcast", "async"),
    ("all_gather_single", "out-of-place"),
    ("sendrecv", "ping-pong"),
    ("sendrecv", "async"),
)
SECTIONS = ("host", "check", "torch", "device")
OPS = tuple(dict.fromkeys(op for op, _ in FORMS + TORCH_FORMS))

COLUMNS = (
    ("op", 20),
    ("form", 12),
    ("bytes", 10),
    ("hetcomm(us)", 11),
    ("floor(us)", 10),
    ("ratio", 7),
    ("spread", 7),
    ("floor", 12),
    ("gloo(us)", 9),
    ("#wrong", 6),
)

SECTION_NOTES = {
    "host": "hetcomm on numpy arrays; floor: raw mpi4py, the same op the same way "
    "(MPI.IN_PLACE in place, two buffers out of place); gloo: torch gloo, where torch has the form",
    "check": "the cost of the default mismatch check: hetcomm(us) with it (as configured), "
    "floor(us) the same op on a Communicator with Config(check=False), in the same interleaved "
    "rounds; ratio = checked / unchecked",
    "torch": "hetcomm(us): dist.<op> through a hetcomm ProcessGroup minus the same op on its bare "
    "Communicator (per round); floor: dist.<op> on a trivial Python ProcessGroup that returns a "
    "finished Work (torch's own dispatch); goal: at most max(3 x floor, 10 us)",
    "device": "hetcomm on device arrays, a device synchronize after each call; floors: "
    "two-copies (device->pinned host, 1-byte MPI message, pinned host->device in the other "
    "process, 1-byte answer), peer-copy (a copy into the peer's mapped buffer + a 1-byte "
    "message), mpi4py-host (the collective on host buffers); copy: one device copy of the size",
}


@dataclass
class LatencyRow:
    """One line of the table: times in microseconds, None where not measured."""

    section: str
    op: str
    form: str
    bytes: int
    hetcomm_us: float | None
    floor_us: float | None
    floor: str
    spread: float | None = None
    wrong: int | None = None
    gloo_us: float | None = None
    ratio: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.section not in SECTIONS:
            raise ValueError(f"section must be one of {SECTIONS}, got {self.section!r}")
        if self.ratio is None and self.hetcomm_us is not None and self.floor_us:
            self.ratio = self.hetcomm_us / self.floor_us


def torch_goal_us(floor_us: float) -> float:
    """The torch layer's goal for its cost over the bare Communicator: max(3 x floor, 10 us)."""
    return max(3.0 * floor_us, 10.0)


def _us(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if abs(value) < 100 else f"{value:.1f}"


def _cells(row: LatencyRow) -> tuple[str, ...]:
    return (
        row.op,
        row.form,
        str(row.bytes),
        _us(row.hetcomm_us),
        _us(row.floor_us),
        "-" if row.ratio is None else f"{row.ratio:.2f}",
        "-" if row.spread is None else f"{row.spread:.0%}",
        row.floor or "-",
        _us(row.gloo_us),
        "-" if row.wrong is None else str(row.wrong),
    )


def header(meta: Mapping[str, Any]) -> list[str]:
    """The comment lines above the table: the command, date, machine and how it was timed."""
    lines = [f"# hetcomm bench --latency: {meta.get('command', '')}"]
    for key in ("date", "machine", "mpi", "versions", "ranks", "transport", "mismatch_check"):
        if key in meta:
            lines.append(f"# {key.replace('_', ' ')}: {meta[key]}")
    lines.append(
        f"# timing: per call, the slowest rank's time; median over {meta.get('rounds', '?')} "
        "interleaved rounds (each round every implementation once, in a random order that is "
        "the same on every rank); spread = (max - min) / median of the rounds, the larger of "
        "hetcomm's and the floor's; ratio = median of the per-round ratios"
    )
    lines.append(
        "# sendrecv ping-pong and async: ranks 2k and 2k+1 send to each other in turn; every "
        "time is one way = round trip / 2; exchange: both send and receive at once "
        "(Communicator.sendrecv, MPI_Sendrecv; exchange-async: async_op=True and waited, "
        "Irecv + Isend and Waitall), the time of one exchange"
    )
    return lines


def pingpong(op: str, form: str) -> bool:
    """Whether a row's calls are a ping-pong, timed one way (half its round trip)."""
    return op == "sendrecv" and not form.startswith("exchange")


def table(rows: Sequence[LatencyRow], meta: Mapping[str, Any] | None = None) -> str:
    """The text table: the header, then per section a note, the column line and the rows."""
    lines = header(meta or {})
    for section in SECTIONS:
        mine = [r for r in rows if r.section == section]
        if not mine:
            continue
        lines.append("#")
        lines.append(f"# section {section}: {SECTION_NOTES[section]}")
        lines.append("# " + " ".join(f"{name:>{w}}" for name, w in COLUMNS))
        for r in mine:
            lines.append("  " + " ".join(f"{c:>{w}}" for c, (_, w) in zip(_cells(r), COLUMNS)))
    return "\n".join(lines)


def parse_table(text: str) -> list[dict[str, str]]:
    """Data lines of `table` as {column: cell}, with the section each came from."""
    names = [name for name, _ in COLUMNS]
    out, section = [], ""
    for line in text.splitlines():
        if line.startswith("# section "):
            section = line[len("# section ") :].split(":", 1)[0]
        if not line.strip() or line.startswith("#"):
            continue
        cells = line.split()
        if len(cells) != len(names):
            raise ValueError(f"expected {len(names)} cells in a data line, got {line!r}")
        out.append({"section": section, **dict(zip(names, cells))})
    return out


def to_json(rows: Iterable[LatencyRow], meta: Mapping[str, Any]) -> str:
    """{"meta": {...}, "rows": [every field of every row]}."""
    return json.dumps({"meta": dict(meta), "rows": [asdict(r) for r in rows]}, indent=1)


def iterations(nbytes: int, small: int, large: int, threshold: int = 8192) -> int:
    """Calls per sample at a size, as OSU does: `small` up to `threshold` bytes, else `large`."""
    if small < 1 or large < 1:
        raise ValueError(f"iterations must be at least 1, got {small} and {large}")
    return small if nbytes <= threshold else large


def select_forms(ops: str | None, forms: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """The (op, form) pairs of `forms` whose op is in the comma list `ops` (all when None)."""
    if ops is None or not ops.strip():
        return list(forms)
    wanted = [o.strip().lower() for o in ops.split(",") if o.strip()]
    bad = [o for o in wanted if o not in OPS]
    if bad:
        raise ValueError(f"unknown op(s) {', '.join(bad)}; expected some of {', '.join(OPS)}")
    return [(op, form) for op, form in forms if op in wanted]
