"""The coalesced study (`hetcomm bench --study coalesced`): all_reduce_coalesced of many small
float32 arrays against one all_reduce per array, host memory, in one run.

Both ways reduce the same arrays in interleaved rounds (timing.py): a sample is one call of
the way (all `--arrays` arrays) from fresh inputs, the slowest rank's time; every result is
checked against a float64 reference. Rows: the median of each way, its spread, and the median
of the per-round ratios separate / coalesced.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import numpy as np

from .timing import Interleaved, Run, paired_ratio


def add_arguments(group: Any) -> None:
    """The options of the coalesced study."""
    group.add_argument("--arrays", type=int, default=200, help="--study coalesced: arrays (200)")
    group.add_argument(
        "--array-bytes", type=int, default=4096, help="--study coalesced: bytes per array (4096)"
    )


def run(args: argparse.Namespace) -> int:
    """`hetcomm bench --study coalesced [--arrays N] [--array-bytes B] [--rounds N]`."""
    from mpi4py import MPI

    import hetcomm

    world = hetcomm.init(name="bench-coalesced")
    rank, size = world.rank, world.size
    count = max(1, args.array_bytes // 4)
    rng = np.random.default_rng(1234)  # the same on every rank: each can check the result
    inputs = rng.integers(-8, 8, size=(size, args.arrays, count)).astype(np.float32)
    want = inputs.astype(np.float64).sum(axis=0)  # small integers: exact in float32
    wrong = {"coalesced": 0, "separate": 0}

    def way(name: str) -> Run:
        def run_way(calls: int) -> None:
            for _ in range(calls):
                xs = [inputs[rank, i].copy() for i in range(args.arrays)]
                if name == "coalesced":
                    world.all_reduce_coalesced(xs)
                else:
                    for x in xs:
                        world.all_reduce(x)
                wrong[name] += sum(int(np.count_nonzero(x != w)) for x, w in zip(xs, want))

        return run_way

    ctl = MPI.COMM_WORLD.Dup()
    stats = Interleaved(ctl, args.rounds).measure(
        {"coalesced": way("coalesced"), "separate": way("separate")}, 1, warmup=2
    )
    bad = ctl.allreduce(sum(wrong.values()), op=MPI.SUM)
    ctl.Free()
    world.close()
    ratio = paired_ratio(stats["separate"], stats["coalesced"])
    if rank == 0:
        print(
            f"# --study coalesced: {size} ranks, {args.arrays} float32 arrays of "
            f"{count * 4} B, {args.rounds} interleaved rounds; wrong elements: {bad}"
        )
        print("| way | median | spread (max-min)/median |")
        print("|---|---:|---:|")
        for name, stat in stats.items():
            print(f"| {name} | {stat.median * 1e3:.2f} ms | {stat.spread:.0%} |")
        print(f"separate / coalesced, median of the per-round ratios: {ratio:.1f}x")
        if args.json:
            rows = [
                {"way": n, "median_s": s.median, "spread": s.spread, "rounds": list(s.rounds)}
                for n, s in stats.items()
            ]
            with open(args.json, "w") as f:
                json.dump({"ranks": size, "arrays": args.arrays, "rows": rows, "ratio": ratio}, f)
        sys.stdout.flush()
    MPI.COMM_WORLD.Barrier()
    return 0 if bad == 0 else 1
