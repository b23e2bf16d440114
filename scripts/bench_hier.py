"""hier vs flat all_reduce on the CPU, with simulated islands, side by side in one run.

mpirun --oversubscribe -n 4 python -m mpi4py scripts/bench_hier.py [--islands 2+2] [--rounds 7]
    [--json OUT.json]

Ranks are cut into islands of the given sizes (2+2: ranks 0-1 "nvidia", 2-3 "amd"; a third
island is "cpu"). Two communicators over the same ranks run the same out-of-place float32
all_reduce: one with HETCOMM_TRANSPORT=hier, one with mpi (flat); raw mpi4py Allreduce runs
beside them. Each round times every implementation once, in an order that rotates, and the
table gives per size the median time per call over the rounds (slowest rank each round), the
spread of the rounds ((max - min) / median), and the ratio hier / flat.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

import hetcomm

KiB, MiB = 1 << 10, 1 << 20
SIZES = (4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB)
VENDORS = ("nvidia", "amd", "cpu")


def vendor_of(rank: int, sizes: list[int]) -> str:
    """The simulated vendor of `rank` when islands of `sizes` ranks follow each other."""
    edge = 0
    for i, n in enumerate(sizes):
        edge += n
        if rank < edge:
            return VENDORS[i]
    raise SystemExit(f"--islands {'+'.join(map(str, sizes))} holds {edge} ranks; the job has more")


def calls_for(nbytes: int) -> int:
    """Calls per timed round: enough that a round of small messages lasts well over a tick."""
    return max(1, min(200, (4 * MiB) // nbytes))


def time_round(fn: Callable[[], None], calls: int, world: MPI.Intracomm) -> float:
    """Seconds per call of `fn` over `calls` calls, as the slowest rank saw it."""
    world.Barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return float(world.allreduce((time.perf_counter() - t0) / calls, op=MPI.MAX))


def implementations(
    hier: hetcomm.Communicator,
    flat: hetcomm.Communicator,
    world: MPI.Intracomm,
    x: np.ndarray,
    outs: dict[str, np.ndarray],
) -> dict[str, Callable[[], None]]:
    """The same out-of-place all_reduce of `x`, one callable per implementation."""
    return {
        "hier": lambda: hier.all_reduce(x, out=outs["hier"]),
        "flat": lambda: flat.all_reduce(x, out=outs["flat"]),
        "mpi4py": lambda: world.Allreduce(x, outs["mpi4py"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--islands", default="2+2", help="island sizes in rank order (default 2+2)")
    ap.add_argument("--rounds", type=int, default=7, help="timed rounds per size (default 7)")
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument(
        "--steps",
        action="store_true",
        help="also time hier's steps as raw MPI calls at the largest size",
    )
    args = ap.parse_args()
    world = MPI.COMM_WORLD
    rank, n = world.Get_rank(), world.Get_size()
    sizes = [int(s) for s in args.islands.split("+")]
    if sum(sizes) != n:
        raise SystemExit(f"--islands {args.islands} holds {sum(sizes)} ranks, the job has {n}")
    vendor = vendor_of(rank, sizes)
    hier = hetcomm.init(config=hetcomm.Config.load(transport="hier", vendor=vendor), name="hier")
    flat = hetcomm.init(config=hetcomm.Config.load(transport="mpi", vendor=vendor), name="flat")
    expected = n * (n + 1) / 2
    rows = []
    for nbytes in SIZES:
        count = nbytes // 4
        x = np.full(count, rank + 1, dtype=np.float32)
        outs = {k: np.zeros(count, dtype=np.float32) for k in ("hier", "flat", "mpi4py")}
        impls = implementations(hier, flat, world, x, outs)
        names = list(impls)
        calls = calls_for(nbytes)
        for name in names:  # warm-up: transports, parts and kernels are made on first use
            impls[name]()
        times: dict[str, list[float]] = {name: [] for name in names}
        for r in range(args.rounds):
            for name in names[r % 3 :] + names[: r % 3]:
                times[name].append(time_round(impls[name], calls, world))
        ok = all(bool((o == expected).all()) for o in outs.values())
        ok = bool(world.allreduce(ok, op=MPI.LAND))
        row: dict[str, Any] = {"bytes": nbytes, "calls": calls, "ok": ok}
        for name in names:
            med = statistics.median(times[name])
            row[f"{name}_us"] = med * 1e6
            row[f"{name}_spread"] = (max(times[name]) - min(times[name])) / med
        row["hier/flat"] = row["hier_us"] / row["flat_us"]
        rows.append(row)
        if rank == 0:
            print(_line(row), flush=True)
    if args.steps:
        steps(world, vendor, args.rounds)
    if rank == 0:
        print(
            f"\nislands {args.islands} on {n} ranks, {args.rounds} rounds; hier plan: "
            f"{hier.plan.lookup('all_reduce', 'host', 'large')}"
        )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(
                    {"islands": args.islands, "ranks": n, "rounds": args.rounds, "rows": rows},
                    f,
                    indent=1,
                )
    hier.close()
    flat.close()


def steps(world: MPI.Intracomm, vendor: str, rounds: int) -> None:
    """The steps of a hierarchical all_reduce of the largest size as raw MPI calls (islands
    reduce-scatter, matching members swap shards, islands all-gather), beside one flat
    Allreduce: what the hierarchy costs on this machine before any of hetcomm's own work."""
    rank, n = world.Get_rank(), world.Get_size()
    island = world.Split(VENDORS.index(vendor), rank)
    size = island.Get_size()
    count = SIZES[-1] // 4
    x, y = np.ones(count, np.float32), np.zeros(count, np.float32)
    shard, theirs = np.zeros(count // size, np.float32), np.zeros(count // size, np.float32)
    # the member at the same place in the other island (2 equal islands)
    partner = (rank + n // 2) % n
    calls = {
        "flat Allreduce": lambda: world.Allreduce(x, y),
        "island Reduce_scatter_block": lambda: island.Reduce_scatter_block(x, shard),
        "shard Sendrecv between islands": lambda: world.Sendrecv(
            shard, partner, 5, theirs, partner, 5
        ),
        "island Allgather": lambda: island.Allgather(shard, y),
    }
    if rank == 0:
        print(f"\nsteps at {_size(SIZES[-1])} (raw MPI; median of {rounds}, min..max):")
    for name, call in calls.items():
        if name.startswith("shard") and (count % size or n != 2 * size):
            continue  # the swap needs two equal islands whose size divides the vector
        call()
        times = sorted(time_round(call, 1, world) for _ in range(rounds))
        if rank == 0:
            print(
                f"  {name}: {_time(statistics.median(times) * 1e6)} "
                f"({_time(times[0] * 1e6)}..{_time(times[-1] * 1e6)})",
                flush=True,
            )
    island.Free()


def _size(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // KiB} KiB"


def _time(us: float) -> str:
    return f"{us / 1e3:.2f} ms" if us >= 1e3 else f"{us:.0f} µs"


def _line(row: dict[str, Any]) -> str:
    def cell(name: str) -> str:
        return f"{_time(row[f'{name}_us'])} ({row[f'{name}_spread']:.0%})"

    return (
        f"| {_size(row['bytes'])} | {cell('hier')} | {cell('flat')} | {cell('mpi4py')} | "
        f"{row['hier/flat']:.2f}x | {'yes' if row['ok'] else 'NO'} |"
    )


if __name__ == "__main__":
    main()
