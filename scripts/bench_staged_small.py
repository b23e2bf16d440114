"""Small staged all_reduces: the ring beside recursive doubling, rounds alternating, one run.

mpirun -n 4 python -m mpi4py scripts/bench_staged_small.py [--device] [--rounds 15] [--json OUT]

Host arrays (numpy) by default, so it runs on the CPU; --device uses CuPy arrays, each rank on
the device its topology names. Each round times every size once per algorithm (median of 5
calls, the slowest rank's time each call); the table gives the median over the rounds, the
spread of the rounds ((max - min) / median) and ring / doubling. Recursive doubling applies to
power-of-two groups only (DOUBLING_MAX_BYTES in hetcomm/transports/staged_collectives.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np
from mpi4py import MPI

import hetcomm
from hetcomm.transports.staged import collectives as sc

SIZES = (8, 4096, 65536, 262144)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", action="store_true")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--json")
    args = p.parse_args()
    world = MPI.COMM_WORLD
    xp: Any = np
    if args.device:
        import cupy

        from hetcomm.topology import use_local_device

        use_local_device()
        xp = cupy
    comm = hetcomm.init(config=hetcomm.Config.load(transport="staged"))
    limit = sc.DOUBLING_MAX_BYTES
    algorithms = {"ring": 0, "doubling": limit}
    times: dict[tuple[str, int], list[float]] = {}
    n = world.Get_size()
    for _ in range(args.rounds):
        for name, bound in algorithms.items():
            sc.DOUBLING_MAX_BYTES = bound
            for size in SIZES:
                x = xp.ones(size // 4, dtype=np.float32)
                comm.all_reduce(x)
                per = []
                for _ in range(5):
                    world.Barrier()
                    t0 = time.perf_counter()
                    comm.all_reduce(x)
                    if args.device:
                        xp.cuda.Device().synchronize()
                    per.append(world.allreduce(time.perf_counter() - t0, op=MPI.MAX))
                times.setdefault((name, size), []).append(statistics.median(per))
                x[:] = 1
                comm.all_reduce(x)
                if not bool((x == n).all()):
                    raise SystemExit(f"{name} {size} B: wrong sum")
    sc.DOUBLING_MAX_BYTES = limit
    comm.close()
    if world.Get_rank() != 0:
        return
    rows = []
    print(
        f"{n} ranks, {'device' if args.device else 'host'} arrays, float32 sum, "
        f"{args.rounds} rounds"
    )
    print(
        f"{'bytes':>8} {'ring us':>9} {'spread':>7} {'doubling us':>12} {'spread':>7} "
        f"{'ring/doubling':>14}"
    )
    for size in SIZES:
        ring, dbl = times[("ring", size)], times[("doubling", size)]
        a, b = statistics.median(ring), statistics.median(dbl)
        sa, sb = (max(ring) - min(ring)) / a, (max(dbl) - min(dbl)) / b
        print(f"{size:>8} {a * 1e6:>9.0f} {sa:>7.0%} {b * 1e6:>12.0f} {sb:>7.0%} {a / b:>14.2f}")
        rows.append(
            {
                "bytes": size,
                "ranks": n,
                "ring_us": a * 1e6,
                "doubling_us": b * 1e6,
                "ring_spread": sa,
                "doubling_spread": sb,
            }
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
