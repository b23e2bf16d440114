"""The rails study (`hetcomm bench --study rails`): staged send/recv over 1, 2, 4 emulated rails
of equal speed, 2 ranks made two hosts, in one run.

Run it inside scripts/emulate-rails, which sets up K rate-limited loopback rails and exports
HETCOMM_RAILS (docs/bench.md):

    scripts/emulate-rails --rails 4 --rate 400mbit -- timeout 600 .venv/bin/mpirun \\
        --oversubscribe -n 2 .venv/bin/python -m mpi4py -m hetcomm bench --study rails

Each rail count gets its own Communicator (Config(rails=the first k addresses, host=host<rank>,
transport="staged"), so that rails and not shared memory join the ranks). Rank 0 sends, rank 1
receives; a sample is one message, the slowest rank's time from a barrier; the rail counts take
turns in interleaved rounds (timing.py). Rows: median, min..max, Gbit/s, the ratio to one
rail (goals 1.8x for 2 rails, 3.4x for 4) and each rail's share of the bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from .timing import Interleaved, Run

MiB = 1 << 20
GOALS = {2: 1.8, 4: 3.4}  # throughput ratio to one rail, for rails of equal speed


def add_arguments(group: Any) -> None:
    """The options of the rails study."""
    group.add_argument("--rails", default="1,2,4", help="--study rails: rail counts (1,2,4)")
    group.add_argument("--mib", type=float, default=64, help="--study rails: message MiB (64)")


def rail_bytes(comm: Any) -> dict[str, int]:
    """Bytes each rail of `comm`'s staged transport carried ({} where it cannot tell): the
    transport's own counters, read through hetcomm.introspect (hetcomm has no public rail
    statistics yet)."""
    from .. import introspect

    transport = introspect.transports(comm).get("staged")
    stats = getattr(transport, "stats", None)
    return dict(stats) if isinstance(stats, dict) else {}


def shares(stats: dict[str, int]) -> list[float]:
    """Each rail's part of the bytes sent, in rail order (names 'RAIL detail')."""
    per: dict[str, int] = {}
    for name, n in stats.items():
        key = name.split()[0]
        per[key] = per.get(key, 0) + n
    total = sum(per.values()) or 1
    return [round(per[k] / total, 3) for k in sorted(per)]


def measure(args: argparse.Namespace) -> dict[str, Any] | None:
    """The study on 2 ranks; the result on rank 0 (None elsewhere)."""
    import numpy as np
    from mpi4py import MPI

    import hetcomm

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    counts = sorted({int(k) for k in args.rails.split(",") if k.strip()})
    if world.Get_size() != 2:
        raise SystemExit("--study rails: needs exactly 2 ranks")
    if not counts or counts[0] < 1:
        raise SystemExit(f"--rails: expected rail counts such as 1,2,4, got {args.rails!r}")
    addrs = [a for a in os.environ.get("HETCOMM_RAILS", "").split(",") if a]
    if len(addrs) < counts[-1] or "EMULATE_RAILS_NETNS" not in os.environ:
        raise SystemExit(
            f"--study rails: needs {counts[-1]} emulated rails; run it through "
            f"scripts/emulate-rails (HETCOMM_RAILS={','.join(addrs) or 'unset'})"
        )
    nbytes = int(args.mib * MiB)
    comms = {}
    for k in counts:
        config = hetcomm.Config.load(
            rails=",".join(addrs[:k]), host=f"host{rank}", transport="staged"
        )
        comms[k] = hetcomm.init(config=config, name=f"rails{k}")
    data = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)
    got = np.zeros(nbytes, np.uint8)

    def one(k: int, size: int) -> Run:
        def run(calls: int) -> None:
            for _ in range(calls):
                if rank == 0:
                    comms[k].send(data[:size], 1)
                else:
                    comms[k].recv(got[:size], 0)

        return run

    for k in counts:  # open the channels; let TCP leave slow start
        one(k, min(nbytes, 8 * MiB))(1)
    before = {k: rail_bytes(comms[k]) for k in counts}
    ctl = world.Dup()
    stats = Interleaved(ctl, args.rounds).measure({str(k): one(k, nbytes) for k in counts}, 1)
    ctl.Free()
    ok = rank == 0 or bool(np.array_equal(got, data))
    ok = bool(world.allreduce(ok, op=MPI.LAND))
    sent = {}
    for k in counts:
        after = rail_bytes(comms[k])
        sent[k] = world.bcast(
            shares({n: v - before[k].get(n, 0) for n, v in after.items()}) if after else [],
            root=0,
        )
    for c in comms.values():
        c.close()
    if rank != 0:
        return None
    base = stats[str(counts[0])].median * counts[0]
    rate = os.environ.get("EMULATE_RAILS_RATE", "?")
    goals = GOALS if "," not in rate else {}
    rows = []
    for k in counts:
        s = stats[str(k)]
        rows.append(
            {
                "rails": k,
                "median_s": s.median,
                "min_s": min(s.rounds),
                "max_s": max(s.rounds),
                "gbit_s": nbytes * 8 / s.median / 1e9,
                "ratio": base / s.median,
                "goal": goals.get(k),
                "shares": sent[k],
                "samples": list(s.rounds),
            }
        )
    return {"bytes": nbytes, "rate": rate, "repeats": args.rounds, "correct": ok, "rows": rows}


def table(result: dict[str, Any]) -> str:
    """Markdown of the result."""
    lines = [
        f"send/recv of {result['bytes'] / MiB:g} MiB, 2 ranks as 2 hosts, emulated rails at "
        f"{result['rate']}, median of {result['repeats']}; data verified: "
        f"{'yes' if result['correct'] else 'NO'}",
        "",
        "| rails | median time (s) | min..max (s) | Gbit/s | ratio to 1 rail | goal "
        "| bytes per rail |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in result["rows"]:
        goal = f">= {r['goal']}x" if r["goal"] else ""
        per = " / ".join(f"{s:.0%}" for s in r["shares"])
        lines.append(
            f"| {r['rails']} | {r['median_s']:.3f} | {r['min_s']:.3f}..{r['max_s']:.3f} "
            f"| {r['gbit_s']:.3f} | {r['ratio']:.2f}x | {goal} | {per} |"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """`hetcomm bench --study rails [--rails 1,2,4] [--mib 64] [--rounds N] [--json FILE|-]`;
    `--json -` prints the result as one JSON line instead of the table."""
    result = measure(args)
    if result is not None:
        if args.json == "-":
            print(json.dumps(result), flush=True)
        else:
            print(table(result), flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(result, f, indent=1)
        sys.stdout.flush()
    from mpi4py import MPI

    ok = MPI.COMM_WORLD.bcast(None if result is None else result["correct"], root=0)
    return 0 if ok else 1
