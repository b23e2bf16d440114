"""Tensor fusion: all_reduce_coalesced of many small arrays against one all_reduce each, CPU.

    mpirun -n 4 python -m mpi4py scripts/bench_coalesced.py [--arrays 200 --bytes 4096 --repeats 25]
    mpirun -n 4 python -m mpi4py scripts/bench_coalesced.py --parts

Both ways reduce the same float32 numpy arrays in the same job, alternating within each repeat
(which goes first alternates too, so drift of the machine hits both alike). A repeat's time is the
slowest rank's (a barrier before each timing). After a warm-up, rank 0 prints the median time of
each way, the spread of the repeats ((max - min) / median, and the 10th-90th percentile) and the
median of the per-repeat ratios; every result is checked against a float64 reference.
`--parts` times the pieces of one coalesced call instead (checking, packing, the fused all_reduce,
unpacking) beside a raw mpi4py Allreduce of the same bytes and the fused all_reduce started from
the calling thread rather than the mpi transport's lane thread.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI

import hetcomm
from hetcomm import ReduceOp, fusion
from hetcomm.transports.mpi import transport as mpi_transport


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--arrays", type=int, default=200)
    parser.add_argument("--bytes", type=int, default=4096, help="bytes per array (float32)")
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--parts", action="store_true", help="time the pieces of one call")
    args = parser.parse_args()
    if args.parts:
        parts(args)
        return

    world = hetcomm.init(name="bench")
    rank, size = world.rank, world.size
    count = args.bytes // 4
    rng = np.random.default_rng(1234)  # the same on every rank: each can check the result
    inputs = rng.integers(-8, 8, size=(size, args.arrays, count)).astype(np.float32)
    want = inputs.astype(np.float64).sum(axis=0)  # small integers: exact in float32

    def fresh() -> list[np.ndarray]:
        return [inputs[rank, i].copy() for i in range(args.arrays)]

    def coalesced(xs: list[np.ndarray]) -> None:
        world.all_reduce_coalesced(xs)

    def separate(xs: list[np.ndarray]) -> None:
        for x in xs:
            world.all_reduce(x)

    ways = {"coalesced": coalesced, "separate": separate}
    times: dict[str, list[float]] = {name: [] for name in ways}
    ratios: list[float] = []
    for repeat in range(args.warmup + args.repeats):
        order = list(ways) if repeat % 2 == 0 else list(reversed(ways))
        took = {}
        for name in order:
            xs = fresh()
            world.mpi.Barrier()
            t0 = time.perf_counter()
            ways[name](xs)
            mine = time.perf_counter() - t0
            took[name] = world.mpi.allreduce(mine, op=MPI.MAX)
            if not all(np.array_equal(x, w) for x, w in zip(xs, want)):
                raise SystemExit(f"rank {rank}: {name} gave a wrong result")
        if repeat >= args.warmup:
            for name in ways:
                times[name].append(took[name])
            ratios.append(took["separate"] / took["coalesced"])
    if rank == 0:
        print(
            f"{size} ranks, {args.arrays} float32 arrays of {args.bytes} B, {args.repeats} "
            f"repeats after {args.warmup} warm-up"
        )
        print("| way | median | p10-p90 | spread (max-min)/median |")
        print("|---|---:|---:|---:|")
        for name, ts in times.items():
            med = statistics.median(ts)
            print(
                f"| {name} | {med * 1e3:.2f} ms | {percentile(ts, 0.1) * 1e3:.2f}-"
                f"{percentile(ts, 0.9) * 1e3:.2f} ms | {(max(ts) - min(ts)) / med:.0%} |"
            )
        ratio = statistics.median(times["separate"]) / statistics.median(times["coalesced"])
        print(
            f"separate / coalesced: {ratio:.1f}x (ratio of medians); per-repeat ratios: median "
            f"{statistics.median(ratios):.1f}x, p10-p90 {percentile(ratios, 0.1):.1f}-"
            f"{percentile(ratios, 0.9):.1f}x"
        )
    world.close()


def parts(args: argparse.Namespace) -> None:
    """Median time of each piece of a coalesced call, per rank (the slowest rank's shown)."""
    world = hetcomm.init(name="bench")
    count = args.bytes // 4
    xs = [np.ones(count, dtype=np.float32) for _ in range(args.arrays)]
    flat = np.ones(count * args.arrays, dtype=np.float32)
    names = (
        "check and group",
        "pack",
        "fused all_reduce",
        "unpack",
        "raw Allreduce, same bytes",
        "fused all_reduce, started from the calling thread",
    )
    times: dict[str, list[float]] = {name: [] for name in names}
    for repeat in range(args.warmup + args.repeats):
        world.mpi.Barrier()
        t0 = time.perf_counter()
        _, groups = fusion.prepare(xs, ReduceOp.SUM, "bench")
        t1 = time.perf_counter()
        fusion.pack_host(groups[0], flat)
        t2 = time.perf_counter()
        world.mpi.Barrier()  # as before the raw Allreduce: no waiting for late ranks counted
        t2b = time.perf_counter()
        world.all_reduce(flat)
        t3 = time.perf_counter()
        fusion.unpack_host(groups[0], flat)
        t4 = time.perf_counter()
        flat[...] = 1
        world.mpi.Barrier()
        t5 = time.perf_counter()
        world.mpi.Allreduce(MPI.IN_PLACE, flat)
        t6 = time.perf_counter()
        flat[...] = 1
        # the same all_reduce without the lane thread (LANE_BYTES raised for this bench only)
        lane, mpi_transport.LANE_BYTES = mpi_transport.LANE_BYTES, 1 << 62
        world.mpi.Barrier()
        t7 = time.perf_counter()
        world.all_reduce(flat)
        t8 = time.perf_counter()
        mpi_transport.LANE_BYTES = lane
        flat[...] = 1
        if repeat >= args.warmup:
            pieces = (t1 - t0, t2 - t1, t3 - t2b, t4 - t3, t6 - t5, t8 - t7)
            for name, dt in zip(names, pieces):
                times[name].append(dt)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    slowest = world.mpi.allreduce(list(medians.values()), op=_max_each)
    if world.rank == 0:
        print(
            f"{world.size} ranks, {args.arrays} float32 arrays of {args.bytes} B: median per "
            f"piece (slowest rank), {args.repeats} repeats"
        )
        for name, t in zip(names, slowest):
            print(f"| {name} | {t * 1e3:.2f} ms |")
    world.close()


def _max_each(a: list[float], b: list[float], datatype: object = None) -> list[float]:
    return [max(x, y) for x, y in zip(a, b)]


if __name__ == "__main__":
    main()
