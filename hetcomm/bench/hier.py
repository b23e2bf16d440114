"""The hier study (`hetcomm bench --study hier`): hier against flat all_reduce on the CPU, with
simulated vendor islands, beside raw mpi4py, in one run.

Ranks are cut into islands of the sizes `--islands` gives (2+2: ranks 0-1 "nvidia", 2-3 "amd";
a third island is "cpu"). Two communicators over the same ranks run the same out-of-place
float32 all_reduce, one with Config(transport="hier"), one with "mpi" (flat); mpi4py's
Allreduce runs beside them, in interleaved rounds (timing.py). Rows: per size the median per
call, the spread and hier / flat.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import numpy as np

from .report import parse_size, size_steps
from .timing import Interleaved, Run, paired_ratio

KiB, MiB = 1 << 10, 1 << 20
SIZES = (4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB)
VENDORS = ("nvidia", "amd", "cpu")


def add_arguments(group: Any) -> None:
    """The option of the hier study."""
    group.add_argument(
        "--islands", default="2+2", help="--study hier: island sizes in rank order (2+2)"
    )


def vendor_of(rank: int, sizes: list[int]) -> str:
    """The simulated vendor of `rank` when islands of `sizes` ranks follow each other."""
    edge = 0
    for i, n in enumerate(sizes):
        edge += n
        if rank < edge:
            return VENDORS[i]
    raise SystemExit(f"--islands {'+'.join(map(str, sizes))} holds {edge} ranks; the job has more")


def calls_for(nbytes: int) -> int:
    """Calls per sample: enough that a sample of small messages lasts well over a tick."""
    return max(1, min(200, (4 * MiB) // nbytes))


def _repeat(fn: Any, *args: Any, **kwargs: Any) -> Run:
    def run(calls: int) -> None:
        for _ in range(calls):
            fn(*args, **kwargs)

    return run


def run(args: argparse.Namespace) -> int:
    """`hetcomm bench --study hier [--islands 2+2] [--rounds N] [-b -e] [--json FILE]`."""
    from mpi4py import MPI

    import hetcomm

    world = MPI.COMM_WORLD
    rank, n = world.Get_rank(), world.Get_size()
    islands = [int(s) for s in args.islands.split("+")]
    if sum(islands) != n or len(islands) > len(VENDORS):
        raise SystemExit(f"--islands {args.islands} holds {sum(islands)} ranks, the job has {n}")
    vendor = vendor_of(rank, islands)
    hier = hetcomm.init(config=hetcomm.Config.load(transport="hier", vendor=vendor), name="hier")
    flat = hetcomm.init(config=hetcomm.Config.load(transport="mpi", vendor=vendor), name="flat")
    raw, ctl = world.Dup(), world.Dup()
    timing = Interleaved(ctl, args.rounds)
    sizes: list[int] = list(SIZES)
    if args.minbytes or args.maxbytes:
        lo, hi = parse_size(args.minbytes or SIZES[0]), parse_size(args.maxbytes or SIZES[-1])
        sizes = size_steps(lo, hi, args.stepfactor or 4)
    expected = n * (n + 1) / 2
    rows = []
    for nbytes in sizes:
        count = max(1, nbytes // 4)
        x = np.full(count, rank + 1, dtype=np.float32)
        outs = {k: np.zeros(count, dtype=np.float32) for k in ("hier", "flat", "mpi4py")}
        impls = {
            "hier": _repeat(hier.all_reduce, x, out=outs["hier"]),
            "flat": _repeat(flat.all_reduce, x, out=outs["flat"]),
            "mpi4py": _repeat(raw.Allreduce, x, outs["mpi4py"]),
        }
        stats = timing.measure(impls, calls_for(nbytes), warmup=1)
        ok = all(bool((o == expected).all()) for o in outs.values())
        row: dict[str, Any] = {"bytes": count * 4, "calls": calls_for(nbytes)}
        row["ok"] = bool(world.allreduce(ok, op=MPI.LAND))
        for name, stat in stats.items():
            row[f"{name}_us"] = stat.median * 1e6
            row[f"{name}_spread"] = stat.spread
        row["hier/flat"] = paired_ratio(stats["hier"], stats["flat"])
        rows.append(row)
    plan = hier.plan.lookup("all_reduce", "host", "large")
    hier.close()
    flat.close()
    raw.Free()
    ctl.Free()
    if rank == 0:
        print(
            f"# --study hier: islands {args.islands} on {n} ranks, {args.rounds} rounds; "
            f"hier plan: {plan}"
        )
        print("| size | hier | flat (mpi) | mpi4py | hier / flat | ok |")
        print("|---:|---:|---:|---:|---:|---|")
        for r in rows:
            cells = [
                f"{r[f'{k}_us']:.1f} us ({r[f'{k}_spread']:.0%})"
                for k in ("hier", "flat", "mpi4py")
            ]
            ratio = r["hier/flat"]
            print(
                f"| {r['bytes']} | {' | '.join(cells)} | "
                f"{'-' if ratio is None else f'{ratio:.2f}x'} | {'yes' if r['ok'] else 'NO'} |"
            )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(
                    {"islands": args.islands, "ranks": n, "rounds": args.rounds, "rows": rows},
                    f,
                    indent=1,
                )
        sys.stdout.flush()
    world.Barrier()
    return 0 if all(r["ok"] for r in rows) else 1
