"""Tuned values per topology: the cache file `hetcomm tune` writes, read at init (no MPI
beyond one broadcast, nothing measured here; the measuring tool is hetcomm.tune)."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .config import Config
from .plan import DIRECT_MIN_BYTES

log = logging.getLogger("hetcomm")


SCHEMA = 1


MIN_CHUNK_BYTES = 4096


MIN_SLOTS = 2


_warned: set[tuple[str, str]] = set()  # (file, reason): each bad file is named once per process


@dataclass(frozen=True)
class Tuning:
    """What `hetcomm tune` measured for one topology, as the transports and the plan use it."""

    fingerprint: str
    chunk_bytes: int
    slots: int
    # rail key (staged_schedule.rail_key) -> speed relative to the fastest rail of its kind
    rail_weights: Mapping[str, float] = field(default_factory=dict)
    direct_min: int | None = None  # None: not measured (direct_note says why)
    direct_note: str = ""
    measured: str = ""  # ISO date and time
    version: str = ""
    path: str = ""
    # op -> the mpi transport's LANE_MIN entry (None: never on the lane); absent: built in
    lane_min: Mapping[str, int | None] = field(default_factory=dict)

    def summary(self) -> str:
        """One line per value, for `hetcomm info`."""
        direct = (
            str(self.direct_min)
            if self.direct_min is not None
            else self.direct_note or "not measured"
        )
        rails = ", ".join(f"{k} {w:.2f}" for k, w in sorted(self.rail_weights.items())) or "-"
        lanes = (
            ", ".join(f"{op} {'never' if v is None else v}" for op, v in self.lane_min.items())
            or "not measured (built-in)"
        )
        return "\n".join(
            [
                f"file:         {self.path}",
                f"measured:     {self.measured} by hetcomm {self.version}",
                f"chunk bytes:  {self.chunk_bytes}",
                f"slots:        {self.slots}",
                f"rail weights: {rails}",
                f"direct_min:   {direct}",
                f"lane_min:     {lanes}",
            ]
        )


def resolve_direct_min(explicit: int | None, tuned: Tuning | None) -> tuple[int, str]:
    """(direct_min, where it came from): HETCOMM_DIRECT_MIN > the tuned value > the default."""
    if explicit is not None:
        return explicit, "HETCOMM_DIRECT_MIN"
    if tuned is not None and tuned.direct_min is not None:
        return tuned.direct_min, f"tuned ({tuned.path})"
    return DIRECT_MIN_BYTES, "built-in default"


def adopt(config: Config, tuned: Tuning | None) -> Config:
    """`config` with `tuned` attached and direct_min resolved (explicit > tuned > default)."""
    value, _ = resolve_direct_min(config.direct_min, tuned)
    return replace(config, _tuned=tuned, direct_min=value)


# ---- the file ----------------------------------------------------------------------------------


def cache_dir(config: Config) -> Path | None:
    """The directory of tuning files, or None when HETCOMM_TUNE_DIR is 'off'."""
    if config.tune_dir.strip().lower() == "off":
        return None
    return Path(os.path.expanduser(config.tune_dir.strip()))


def cache_path(directory: Path, fingerprint: str) -> Path:
    """The file of one topology: <directory>/<fingerprint>.json."""
    if not fingerprint or not all(c in "0123456789abcdef" for c in fingerprint):
        raise ValueError(f"expected a topology fingerprint (hex digits), got {fingerprint!r}")
    return directory / f"{fingerprint}.json"


def parse(data: Any, fingerprint: str, path: str = "") -> Tuning:
    """A Tuning from a file's JSON; ValueError naming the first thing that is wrong."""
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, got {type(data).__name__}")
    if data.get("schema") != SCHEMA:
        raise ValueError(f"schema {data.get('schema')!r}, this hetcomm reads schema {SCHEMA}")
    if data.get("fingerprint") != fingerprint:
        raise ValueError(
            f"measured for topology {data.get('fingerprint')!r}, this job's "
            f"topology is {fingerprint!r}"
        )
    chunk = _value(data, "chunk_bytes")
    if not _int(chunk) or chunk < MIN_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes: expected an int >= {MIN_CHUNK_BYTES}, got {chunk!r}")
    slots = _value(data, "slots")
    if not _int(slots) or slots < MIN_SLOTS:
        raise ValueError(f"slots: expected an int >= {MIN_SLOTS}, got {slots!r}")
    rails = data.get("rails")
    if not isinstance(rails, dict):
        raise ValueError(f"rails: expected an object, got {rails!r}")
    weights: dict[str, float] = {}
    for key, entry in rails.items():
        w = entry.get("weight") if isinstance(entry, dict) else None
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 < w <= 1:
            raise ValueError(f"rails[{key!r}]: expected a weight in (0, 1], got {entry!r}")
        weights[str(key)] = float(w)
    direct = data.get("direct_min")
    if not isinstance(direct, dict) or "value" not in direct:
        raise ValueError(f"direct_min: expected an object with a value, got {direct!r}")
    value = direct["value"]
    if value is not None and (not _int(value) or value < 0):
        raise ValueError(f"direct_min: expected bytes >= 0 or null, got {value!r}")
    note = direct.get("note", "")
    if value is None and not (isinstance(note, str) and note):
        raise ValueError("direct_min: null without a note saying why it was not measured")
    lanes = _lane_min(data.get("lane_min"))
    for key in ("measured", "hetcomm"):
        if not isinstance(data.get(key), str):
            raise ValueError(f"{key}: expected a string, got {data.get(key)!r}")
    return Tuning(
        fingerprint,
        chunk,
        slots,
        weights,
        value,
        note if value is None else "",
        data["measured"],
        data["hetcomm"],
        path,
        lanes,
    )


# the collectives a file's lane_min may name (hetcomm.tune.LANE_OPS)
LANE_OPS = ("all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all")


def _lane_min(entry: Any) -> dict[str, int | None]:
    """A file's lane_min values (op -> bytes or None); {} where the file has none."""
    if entry is None:
        return {}
    values = entry.get("value") if isinstance(entry, dict) else None
    if not isinstance(values, dict):
        raise ValueError(f"lane_min: expected an object with a value object, got {entry!r}")
    lanes: dict[str, int | None] = {}
    for op, v in values.items():
        if op not in LANE_OPS:
            raise ValueError(f"lane_min: unknown collective {op!r}; expected one of {LANE_OPS}")
        if v is not None and (not _int(v) or v < 0):
            raise ValueError(f"lane_min[{op!r}]: expected bytes >= 0 or null, got {v!r}")
        lanes[op] = v
    return lanes


def read(path: Path, fingerprint: str) -> Tuning | None:
    """The tuning in `path`, or None: absent silently; unreadable or wrong with one warning."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        _warn(path, str(exc))
        return None
    try:
        return parse(json.loads(text), fingerprint, str(path))
    except ValueError as exc:  # json.JSONDecodeError is one
        _warn(path, str(exc))
        return None


def _warn(path: Path, reason: str) -> None:
    if (str(path), reason) not in _warned:
        _warned.add((str(path), reason))
        log.warning("ignoring tuning file %s: %s", path, reason)


def lookup(mpi_comm: Any, fingerprint: str, config: Config) -> Tuning | None:
    """The tuning of this topology, read by rank 0 and broadcast, so that every rank uses the
    same values. Collective over `mpi_comm`; never raises for a bad file (one warning)."""
    found = None
    if mpi_comm.Get_rank() == 0:
        directory = cache_dir(config)
        if directory is not None:
            found = read(cache_path(directory, fingerprint), fingerprint)
    tuned: Tuning | None = mpi_comm.bcast(found, root=0)
    return tuned


def _value(data: Mapping[str, Any], key: str) -> Any:
    entry = data.get(key)
    return entry.get("value") if isinstance(entry, dict) else None


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
