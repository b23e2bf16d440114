"""The wake study (`hetcomm bench --study wake`): a message that comes after a pause, host
memory, hetcomm beside raw mpi4py in one run.

A ping-pong between ranks 2k and 2k+1 where each rank computes (sleeps) `--pause` ms before it
sends: its receiver has long stopped yielding the core and waits the way a long wait waits.
What a message costs then, over the pause, is how soon that wait notices it (MPI's ranks poll
without end, holding a core each). Every implementation does the same pauses, so the
difference of their medians per message is what their waits cost beyond each other.

Rows per size: each way's one-way time minus the pause (median of interleaved rounds, the
slowest rank's time), its spread, and hetcomm minus mpi4py. Then an 8-byte all_reduce that
rank 0 reaches `--pause` ms after the others: the call's time past the pause with the default
check, without it (`Config(check=False)`), and mpi4py's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .timing import Interleaved, Run, paired_difference

SIZES = (8, 64 << 10, 1 << 20)


def add_arguments(group: Any) -> None:
    """The options of the wake study."""
    group.add_argument(
        "--pause", type=float, default=5.0, help="--study wake: ms each rank computes first (5)"
    )


def run(args: argparse.Namespace) -> int:
    """`hetcomm bench --study wake [--pause MS] [--rounds N] [-n CALLS (20)]`."""
    from mpi4py import MPI

    import hetcomm

    world = hetcomm.init(name="bench-wake")
    raw = MPI.COMM_WORLD.Dup()
    rank, size = world.rank, world.size
    peer = rank ^ 1 if (rank ^ 1) < size else None
    first = rank % 2 == 0
    pause = args.pause / 1e3
    calls = args.iters or 20
    wrong = 0

    def way(name: str, x: np.ndarray, y: np.ndarray) -> Run:
        def send(to: int) -> None:
            if name == "hetcomm":
                world.send(x, to)
            else:
                raw.Send(x, to)

        def recv(src: int) -> None:
            if name == "hetcomm":
                world.recv(y, src)
            else:
                raw.Recv(y, src)

        def ping_pong(n: int) -> None:
            nonlocal wrong
            if peer is None:
                return
            for _ in range(n):
                if first:
                    time.sleep(pause)
                    send(peer)
                    recv(peer)
                else:
                    recv(peer)
                    time.sleep(pause)
                    send(peer)
                wrong += int(y[0] != peer)

        return ping_pong

    ctl = MPI.COMM_WORLD.Dup()
    timing = Interleaved(ctl, args.rounds)
    rows = []
    for nbytes in SIZES:
        x = np.full(max(1, nbytes // 8), float(rank))
        y = np.zeros_like(x)
        ways = {name: way(name, x, y) for name in ("hetcomm", "mpi4py")}
        stats = timing.measure(ways, calls, warmup=2)
        over = {n: s.median / 2 - pause for n, s in stats.items()}  # one way, past the pause
        rows.append(
            {
                "bytes": x.nbytes,
                "hetcomm_us": over["hetcomm"] * 1e6,
                "mpi4py_us": over["mpi4py"] * 1e6,
                "difference_us": paired_difference(stats["hetcomm"], stats["mpi4py"]) / 2 * 1e6,
                "spread": max(s.spread for s in stats.values()),
            }
        )
    unchecked = hetcomm.init(config=world.config.with_options(check=False), name="bench-wake-u")
    v = np.ones(1)

    def late(call: Callable[[], Any]) -> Run:
        def run_late(n: int) -> None:
            for _ in range(n):
                if rank == 0:
                    time.sleep(pause)
                call()

        return run_late

    ways = {
        "hetcomm": late(lambda: world.all_reduce(v)),
        "unchecked": late(lambda: unchecked.all_reduce(v)),
        "mpi4py": late(lambda: raw.Allreduce(MPI.IN_PLACE, v)),
    }
    stats = timing.measure(ways, calls, warmup=2)
    collective = {n: (s.median - pause) * 1e6 for n, s in stats.items()}
    collective_spread = max(s.spread for s in stats.values())
    unchecked.close()
    bad = ctl.allreduce(wrong, op=MPI.SUM)
    transport = ",".join(sorted({r["transport"] for r in world.routes()})) or "-"
    ctl.Free()
    raw.Free()
    world.close()
    if rank == 0:
        print(
            f"# --study wake: {size} ranks, transport {transport}, each send after a "
            f"{args.pause:g} ms pause, {args.rounds} interleaved rounds of {calls} calls; "
            f"wrong messages: {bad}"
        )
        print("| bytes | hetcomm over the pause | mpi4py over the pause | difference | spread |")
        print("|---:|---:|---:|---:|---:|")
        for r in rows:
            print(
                f"| {r['bytes']} | {r['hetcomm_us']:.1f} us | {r['mpi4py_us']:.1f} us | "
                f"{r['difference_us']:+.1f} us | {r['spread']:.0%} |"
            )
        print(
            f"all_reduce of 8 B, rank 0 {args.pause:g} ms late, past the pause: hetcomm "
            f"{collective['hetcomm']:.1f} us, unchecked {collective['unchecked']:.1f} us, mpi4py "
            f"{collective['mpi4py']:.1f} us (spread {collective_spread:.0%})"
        )
        if args.json:
            with open(args.json, "w") as f:
                doc = {"ranks": size, "pause_ms": args.pause, "rows": rows}
                json.dump({**doc, "all_reduce_late_us": collective}, f)
        sys.stdout.flush()
    MPI.COMM_WORLD.Barrier()
    return 0 if bad == 0 else 1
