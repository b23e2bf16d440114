"""`hetcomm tune`: measure this topology's best chunk size, slots, rail weights and the
direct/staged crossover, and write them to the cache that hetcomm.tuning reads at init."""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from .config import Config
from .tuning import LANE_OPS, SCHEMA, Tuning, cache_dir, cache_path

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


def lane_min(
    sizes: Sequence[int], lane_s: Sequence[float], caller_s: Sequence[float]
) -> int | None:
    """The mpi transport's LANE_MIN entry of one op from median times per size: collectives of
    more bytes than it run blocking on the lane. None (never) when the non-blocking call from
    the caller still wins at the largest size tried; else the largest size at which it still
    won below a run of lane wins to the top, or half the smallest size tried when the lane wins
    at every size (what lies below is not measured)."""
    value = crossover(sizes, lane_s, caller_s)  # which also checks the input
    if not lane_s[-1] < caller_s[-1]:
        return None
    return value if value > 0 else int(sizes[0]) // 2


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
    lane_sizes: tuple[int, ...] = ()  # collective sizes of the mpi transport's lane crossover


FULL = Sweep(
    chunks=(1 * MiB, 2 * MiB, 4 * MiB, 8 * MiB, 16 * MiB),
    slots=(2, 4, 8, 16),
    message=64 * MiB,
    sizes=tuple(4096 << 2 * i for i in range(8)),
    repeats=5,
    lane_sizes=(256 << 10, 1 * MiB, 4 * MiB, 16 * MiB),
)


QUICK = Sweep(
    chunks=(256 << 10, 1 * MiB),
    slots=(2, 4),
    message=4 * MiB,
    sizes=(4096, 64 << 10, 1 * MiB),
    repeats=3,
    lane_sizes=(64 << 10, 256 << 10),
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


def measure_lane(mpi: Any, sizes: Sequence[int], repeats: int) -> dict[str, Any]:
    """The mpi transport's two forms of each laned-or-not collective, on host buffers, raw
    MPI: the blocking call handed to a lane (an InOrderWorker, as the transport's own) and
    waited for, against the non-blocking call polled by the calling thread; interleaved, per
    repeat the slowest rank's time, medians. Sizes are the bytes LANE_MIN compares (see
    MpiTransport._start's callers). Collective over `mpi`; the same result on every rank."""
    import statistics
    import time

    import numpy as np
    from mpi4py import MPI

    from .transports.worker import InOrderWorker

    n, me = mpi.Get_size(), mpi.Get_rank()
    lane = InOrderWorker("hetcomm-tune-lane")

    def handed(call: Any) -> None:
        with lane.lock:
            job = lane.submit(call)
        job.wait()
        job.check()

    def polled(request: Any) -> None:
        while not request.Test():
            pass

    def forms(op: str, nbytes: int) -> tuple[Any, Any]:
        count = max(n, nbytes // 8 // n * n)
        x, y = np.ones(count), np.empty(count)
        block, part = x[: count // n], y[: count // n]
        root_in = MPI.IN_PLACE if me == 0 else x
        root_out = x if me == 0 else None
        calls = {
            "all_reduce": (lambda: mpi.Allreduce(x, y), lambda: mpi.Iallreduce(x, y)),
            "reduce": (
                lambda: mpi.Reduce(root_in, root_out, root=0),
                lambda: mpi.Ireduce(root_in, root_out, root=0),
            ),
            "broadcast": (lambda: mpi.Bcast(x, 0), lambda: mpi.Ibcast(x, 0)),
            "all_gather": (lambda: mpi.Allgather(block, y), lambda: mpi.Iallgather(block, y)),
            "reduce_scatter": (
                lambda: mpi.Reduce_scatter_block(x, part),
                lambda: mpi.Ireduce_scatter_block(x, part),
            ),
            "all_to_all": (lambda: mpi.Alltoall(x, y), lambda: mpi.Ialltoall(x, y)),
        }
        blocking, start = calls[op]
        return partial(handed, blocking), lambda: polled(start())

    def seconds(run: Any, calls: int) -> float:
        mpi.Barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            run()
        return float(mpi.allreduce((time.perf_counter() - t0) / calls, op=MPI.MAX))

    result: dict[str, Any] = {"value": {}, "sizes": list(sizes), "lane_s": {}, "caller_s": {}}
    try:
        for op in LANE_OPS:
            lane_s, caller_s = [], []
            for nbytes in sizes:
                on_lane, on_caller = forms(op, nbytes)
                on_lane(), on_caller()  # untimed: the first call of each form
                calls = max(1, 4 * MiB // nbytes)  # samples of a few milliseconds at least
                times: tuple[list[float], list[float]] = ([], [])
                for _ in range(repeats):
                    times[0].append(seconds(on_lane, calls))
                    times[1].append(seconds(on_caller, calls))
                lane_s.append(statistics.median(times[0]))
                caller_s.append(statistics.median(times[1]))
            result["lane_s"][op], result["caller_s"][op] = lane_s, caller_s
            result["value"][op] = lane_min(sizes, lane_s, caller_s)
    finally:
        lane.stop(5.0)
    return result


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
        comm = hetcomm.init(config=replace(plain, transport="staged", _tuned=trial), name="tune")
        # chunks, slots and weights are the rails': host messages between ranks of one host,
        # which would skip them (staged/pull.py), take them here
        transport: Any = comm._transport("send", _as_buffer(bench.x))
        transport.single_copy = False
        return comm

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
    lane = measure_lane(mpi, sweep.lane_sizes, sweep.repeats) if sweep.lane_sizes else None
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
        **({} if lane is None else {"lane_min": lane}),
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
    lane = data.get("lane_min")
    if lane is not None:
        chosen = ", ".join(f"{op} {'never' if v is None else v}" for op, v in lane["value"].items())
        lines.append(f"lane_min     {chosen}  (sizes {lane['sizes']})")
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
