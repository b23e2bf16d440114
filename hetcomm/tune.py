"""Tuned values per topology: the cache file `hetcomm tune` writes and communicators read."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
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

    def summary(self) -> str:
        """One line per value, for `hetcomm info`."""
        direct = (
            str(self.direct_min)
            if self.direct_min is not None
            else self.direct_note or "not measured"
        )
        rails = ", ".join(f"{k} {w:.2f}" for k, w in sorted(self.rail_weights.items())) or "-"
        return "\n".join(
            [
                f"file:         {self.path}",
                f"measured:     {self.measured} by hetcomm {self.version}",
                f"chunk bytes:  {self.chunk_bytes}",
                f"slots:        {self.slots}",
                f"rail weights: {rails}",
                f"direct_min:   {direct}",
            ]
        )


# ---- choosing from measured medians (pure) ---------------------------------------------------


def fastest(medians: Mapping[int, float]) -> int:
    """The setting with the smallest median time (the smaller setting on a tie)."""
    if not medians:
        raise ValueError("fastest: no measurements")
    bad = {
        k: v
        for k, v in medians.items()
        if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v))
    }
    if bad:
        raise ValueError(f"fastest: expected positive finite times, got {bad}")
    return min(medians, key=lambda k: (medians[k], k))


def crossover(sizes: Sequence[int], direct_s: Sequence[float], staged_s: Sequence[float]) -> int:
    """direct_min from median times per message size: the largest size tried at which staged
    still won, when direct wins at every larger size tried (0 when direct always wins; the
    largest size when direct never wins at the top)."""
    if not sizes or not len(sizes) == len(direct_s) == len(staged_s):
        raise ValueError(
            f"crossover: expected one time of each transport per size, got "
            f"{len(sizes)} sizes, {len(direct_s)} direct, {len(staged_s)} staged"
        )
    if list(sizes) != sorted(set(sizes)) or sizes[0] < 0:
        raise ValueError(
            f"crossover: sizes must be distinct, ascending and >= 0, got {list(sizes)}"
        )
    first = len(sizes)  # index from which direct wins at every size
    for i in range(len(sizes) - 1, -1, -1):
        if direct_s[i] < staged_s[i]:
            first = i
        else:
            break
    return 0 if first == 0 else int(sizes[first - 1])


def rail_weights(speeds: Mapping[str, float]) -> dict[str, float]:
    """Each rail's speed over the fastest rail of its kind (the key's first word)."""
    best: dict[str, float] = {}
    for key, speed in speeds.items():
        kind = key.split()[0]
        best[kind] = max(best.get(kind, 0.0), speed)
    return {
        k: round(s / best[k.split()[0]], 3) if best[k.split()[0]] > 0 else 1.0
        for k, s in speeds.items()
    }


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
    )


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


def write(path: Path, data: Mapping[str, Any]) -> None:
    """Write `data` as JSON to `path` atomically (a temporary file beside it, then a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


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


# ---- `hetcomm tune`: the measurement (under MPI) --------------------------------------------

MiB = 1 << 20


@dataclass(frozen=True)
class Sweep:
    """What one `hetcomm tune` run tries."""

    chunks: tuple[int, ...]
    slots: tuple[int, ...]
    message: int  # bytes of the large message that chunks, slots and rails are timed with
    sizes: tuple[int, ...]  # message sizes of the direct/staged crossover
    repeats: int


FULL = Sweep(
    chunks=(1 * MiB, 2 * MiB, 4 * MiB, 8 * MiB, 16 * MiB),
    slots=(2, 4, 8, 16),
    message=64 * MiB,
    sizes=tuple(4096 << 2 * i for i in range(8)),
    repeats=5,
)
QUICK = Sweep(
    chunks=(256 << 10, 1 * MiB),
    slots=(2, 4),
    message=4 * MiB,
    sizes=(4096, 64 << 10, 1 * MiB),
    repeats=3,
)


class _Bench:
    """Pairs of ranks (0->1, 2->3, ...) sending one message at once, timed as bench does: per
    repeat the slowest rank's time from a barrier, then the median."""

    def __init__(self, mpi: Any, memory: str, nbytes: int) -> None:
        self.mpi, self.memory = mpi, memory
        self.rank, self.size = mpi.Get_rank(), mpi.Get_size()
        self.peer = self.rank ^ 1 if (self.rank ^ 1) < self.size else None
        if memory == "device":
            import cupy

            self.xp = cupy
        else:
            import numpy

            self.xp = numpy
        # bytes that differ from chunk to chunk, without a large temporary
        self.x = self.xp.tile(self.xp.arange(251, dtype=self.xp.uint8), nbytes // 251 + 1)[:nbytes]
        self.y = self.xp.zeros(nbytes, dtype=self.xp.uint8)

    def _sync(self) -> None:
        if self.memory == "device":
            self.xp.cuda.Device().synchronize()

    def once(self, comm: Any, nbytes: int) -> None:
        if self.peer is None:
            return
        if self.rank % 2 == 0:
            comm.send(self.x[:nbytes], self.peer)
        else:
            comm.recv(self.y[:nbytes], self.peer)
        self._sync()

    def median(self, comm: Any, nbytes: int, repeats: int, before: Any = None) -> float:
        """Median seconds of one pairwise send of `nbytes` (after one untimed round that opens
        the channels); the received bytes are checked once."""
        import statistics
        import time

        from mpi4py import MPI

        self.once(comm, nbytes)
        if before is not None:
            before()
        self.y[:nbytes] = 0
        times = []
        for _ in range(repeats):
            self.mpi.Barrier()
            t0 = time.perf_counter()
            self.once(comm, nbytes)
            times.append(self.mpi.allreduce(time.perf_counter() - t0, op=MPI.MAX))
        ok = (
            self.peer is None
            or self.rank % 2 == 0
            or bool((self.y[:nbytes] == self.x[:nbytes]).all())
        )
        if not self.mpi.allreduce(ok, op=MPI.LAND):
            raise RuntimeError(
                f"hetcomm tune: a {nbytes}-byte message arrived wrong; the measurement is void"
            )
        return float(statistics.median(times))


def measure(sweep: Sweep, base: Config) -> dict[str, Any] | None:
    """Run the sweep on every rank of COMM_WORLD; the cache file's contents on rank 0."""
    import datetime

    from mpi4py import MPI

    import hetcomm

    from .transports import registry
    from .transports.staged.transport import SLOTS

    plain = base.with_options(tune_dir="off", direct_min=None)
    world = hetcomm.init(config=plain.with_options(transport="staged"), name="tune")
    topo, rank, mpi = world.topology, world.rank, world.mpi
    fp = topo.fingerprint()
    if world.size < 2:
        world.close()
        raise SystemExit("hetcomm tune: needs 2 or more ranks (run it under mpirun)")
    on_device = all(r.device_index is not None for r in topo) and _cupy_ok()
    memory = "device" if bool(mpi.allreduce(on_device, op=MPI.LAND)) else "host"
    if memory == "device":
        import cupy

        cupy.cuda.Device(topo[rank].device_index).use()
    sizes = [s for s in sweep.sizes if s <= sweep.message]
    bench = _Bench(mpi, memory, max([sweep.message, *sizes]))

    def staged(chunk: int, slots: int) -> Any:
        trial = Tuning(fp, chunk, slots, path="(trial)")
        return hetcomm.init(config=replace(plain, transport="staged", _tuned=trial), name="tune")

    def timed(comm: Any, nbytes: int, before: Any = None) -> float:
        try:
            return bench.median(comm, nbytes, sweep.repeats, before)
        finally:
            comm.close()

    chunk_s = {c: timed(staged(c, SLOTS), sweep.message) for c in sweep.chunks}
    chunk = fastest(chunk_s)
    pairs = [(r, r ^ 1) for r in range(0, world.size - 1, 2)]
    shm = base.rails.strip().lower() != "mpi" and any(
        topo[a].host == topo[b].host and topo[a].node == topo[b].node for a, b in pairs
    )
    slot_s: dict[int, float] = {}
    if shm:
        slot_s = {s: timed(staged(chunk, s), sweep.message) for s in sweep.slots}
        slots = fastest(slot_s)
    else:
        slots = SLOTS
    # rails: the bytes each rail carried over the time of the whole message
    comm = staged(chunk, slots)
    transport = comm._transport("send", _as_buffer(bench.x))
    rail_s = timed(comm, sweep.message, before=transport.stats.clear)
    mine = {k: n / sweep.repeats / rail_s / 1e9 for k, n in transport.bytes_per_rail().items()}
    speeds: dict[str, list[float]] = {}
    for theirs in mpi.allgather(mine):
        for k, v in theirs.items():
            speeds.setdefault(k, []).append(v)
    rail_GBps = {k: round(sorted(v)[len(v) // 2], 4) for k, v in speeds.items()}
    weights = rail_weights(rail_GBps)
    # the direct/staged crossover, where direct can run
    direct: dict[str, Any] = {"value": None}
    cls = registry().get("direct")
    why = "the transport is not part of this installation" if cls is None else cls.unavailable(topo)
    if memory == "host":
        why = "no GPU on every rank, so no device buffers to move direct"
    if why is None:
        d_s = [
            timed(hetcomm.init(config=plain.with_options(transport="direct"), name="tune"), n)
            for n in sizes
        ]
        s_s = [timed(staged(chunk, slots), n) for n in sizes]
        direct = {
            "value": crossover(sizes, d_s, s_s),
            "sizes": sizes,
            "direct_s": d_s,
            "staged_s": s_s,
        }
    else:
        direct["note"] = f"not measured: {why}"
    world.close()
    if rank != 0:
        return None
    return {
        "schema": SCHEMA,
        "fingerprint": fp,
        "hetcomm": hetcomm.__version__,
        "measured": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "ranks": len(topo),
        "hosts": topo.hosts(),
        "vendors": topo.vendors(),
        "memory": memory,
        "repeats": sweep.repeats,
        "message_bytes": sweep.message,
        "rails_option": base.rails,
        "chunk_bytes": {"value": chunk, "median_s": {str(k): v for k, v in chunk_s.items()}},
        "slots": {
            "value": slots,
            "median_s": {str(k): v for k, v in slot_s.items()},
            **({} if shm else {"note": "not measured: no shm rail between the pairs"}),
        },
        "rails": {k: {"GBps": v, "weight": weights[k]} for k, v in rail_GBps.items()},
        "direct_min": direct,
    }


def _cupy_ok() -> bool:
    try:
        import cupy

        return bool(cupy.cuda.runtime.getDeviceCount() > 0)
    except Exception:
        return False


def _as_buffer(x: Any) -> Any:
    from .arrays import as_buffer

    return as_buffer(x)


def describe(data: Mapping[str, Any]) -> str:
    """A short text of a cache file's contents (what `hetcomm tune` prints)."""

    def medians(entry: Mapping[str, Any]) -> str:
        return ", ".join(
            f"{int(k)}: {v * 1e3:.2f} ms" for k, v in entry.get("median_s", {}).items()
        )

    direct = data["direct_min"]
    lines = [
        f"topology {data['fingerprint']}: {data['ranks']} ranks on {', '.join(data['hosts'])}, "
        f"{data['memory']} buffers, median of {data['repeats']}",
        f"chunk_bytes  {data['chunk_bytes']['value']}  ({medians(data['chunk_bytes'])} "
        f"for {data['message_bytes']} bytes)",
        f"slots        {data['slots']['value']}  "
        f"({medians(data['slots']) or data['slots'].get('note', '')})",
    ]
    for key, rail in sorted(data["rails"].items()):
        lines.append(f"rail {key:20} {rail['GBps']:.3f} GB/s  weight {rail['weight']:.2f}")
    if direct["value"] is None:
        lines.append(f"direct_min   {direct.get('note', '')}")
    else:
        lines.append(f"direct_min   {direct['value']}  (sizes {direct['sizes']})")
    return "\n".join(lines)


def run_args(args: Any) -> int:
    """`hetcomm tune`: measure, then rank 0 writes <dir>/<fingerprint>.json and prints it."""
    from mpi4py import MPI

    base = Config.load()
    directory = Path(os.path.expanduser(args.dir)) if args.dir else cache_dir(base)
    if directory is None:
        raise SystemExit(
            "hetcomm tune: HETCOMM_TUNE_DIR is 'off': give --dir DIR or set it to a "
            "directory to write the results to"
        )
    sweep = QUICK if args.quick else FULL
    if args.repeats is not None:
        if args.repeats < 1:
            raise SystemExit(f"hetcomm tune: --repeats must be >= 1, got {args.repeats}")
        sweep = replace(sweep, repeats=args.repeats)
    data = measure(sweep, base)
    failed = None
    if MPI.COMM_WORLD.Get_rank() == 0:
        assert data is not None
        path = cache_path(directory, data["fingerprint"])
        try:
            write(path, data)
        except OSError as exc:
            failed = f"hetcomm tune: cannot write {path}: {exc}"
        else:
            print(describe(data))
            print(f"written to {path}", flush=True)
    # every rank returns once the file is there (or fails with rank 0)
    failed = MPI.COMM_WORLD.bcast(failed, root=0)
    if failed is not None:
        raise SystemExit(failed)
    return 0


def add_parser(sub: Any) -> Any:
    """Register `hetcomm tune` on the subparsers object of the `hetcomm` command."""
    p = sub.add_parser(
        "tune",
        help="measure the staged chunk size, slots, rail speeds and the direct/staged "
        "crossover for this job's topology, and cache them (run under mpirun)",
        description=__doc__,
    )
    p.add_argument("--quick", action="store_true", help="a tiny sweep (seconds; for tests)")
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help=f"timed repeats per setting (default {FULL.repeats}, {QUICK.repeats} with --quick)",
    )
    p.add_argument("--dir", default=None, help="write here instead of HETCOMM_TUNE_DIR")
    p.set_defaults(func=run_args)
    return p
