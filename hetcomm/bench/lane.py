"""The lane study (`hetcomm bench --study lane`): a large blocking host collective made on the
calling thread, handed to a thread, or made non-blocking, beside hetcomm's mpi transport.

A blocking MPI collective cannot be waited for with a bound on the thread that makes it (MPI
has no call that ends it early), so the mpi transport makes a large all_reduce, reduce,
broadcast or reduce_scatter either as the non-blocking call, Tested by the calling thread, or
as the blocking call on its lane thread while the calling thread waits for it, bounded; which
one by op and size (`LANE_MIN`, or what `hetcomm tune` measured). The four ways, per op and
size, host float32 arrays, in interleaved rounds:

- direct:      the blocking call on the calling thread (mpi4py): the floor, unbounded;
- thread:      the same call handed to a bare Python thread (a SimpleQueue, and a Lock the
               caller blocks on until the thread releases it): the floor of any bounded wait
               over a blocking MPI call;
- nonblocking: the non-blocking call, Tested by the calling thread until it completes;
- hetcomm:     the Communicator's call (`Config(check=False)`: the check's cost is the
               latency table's `--check-cost`), through the way its `way` column names.

Times are per call, the slowest rank's, medians over the rounds; each ratio is the median of
the per-round ratios to direct. Every way's result is compared with numpy's once per size.
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from .report import parse_size, size_steps
from .timing import Interleaved, Run, paired_ratio

OPS = ("all_reduce", "reduce", "broadcast", "reduce_scatter")
SIZES = (256 << 10, 1 << 20, 4 << 20, 16 << 20)
WAYS = ("direct", "thread", "nonblocking", "hetcomm")


class _Thread:
    """A thread that makes the calls handed to it, one at a time; `call` blocks until done."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        threading.Thread(target=self._loop, name="bench-lane", daemon=True).start()

    def _loop(self) -> None:
        while True:
            fn, done = self._jobs.get()
            if fn is None:
                return
            fn()
            done.release()

    def call(self, fn: Callable[[], Any]) -> None:
        done = threading.Lock()
        done.acquire()
        self._jobs.put((fn, done))
        done.acquire()

    def stop(self) -> None:
        self._jobs.put((None, None))


def _repeat(call: Callable[[], Any]) -> Run:
    def run(n: int) -> None:
        for _ in range(n):
            call()

    return run


def _calls(nbytes: int) -> int:
    return max(4, (32 << 20) // nbytes)


def run(args: argparse.Namespace) -> int:
    """`hetcomm bench --study lane [--op OPS] [-b MIN] [-e MAX] [--rounds N] [-n CALLS]`."""
    from mpi4py import MPI

    import hetcomm

    from ..introspect import transport_of
    from ..transports.mpi.schedule import laned

    ops = tuple(args.op.split(",")) if args.op else OPS
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        raise SystemExit(f"--study lane: --op takes {', '.join(OPS)}; got {', '.join(unknown)}")
    sizes: list[int] = list(SIZES)
    if args.minbytes or args.maxbytes:
        lo, hi = parse_size(args.minbytes or SIZES[0]), parse_size(args.maxbytes or SIZES[-1])
        sizes = size_steps(lo, hi, args.stepfactor or 4)
    world = hetcomm.init(config=hetcomm.Config.load(transport="mpi", check=False), name="lane")
    raw, ctl = MPI.COMM_WORLD.Dup(), MPI.COMM_WORLD.Dup()
    rank, size = raw.Get_rank(), raw.Get_size()
    timing = Interleaved(ctl, args.rounds)
    helper = _Thread()
    rows: list[dict[str, Any]] = []
    wrong = 0
    for op in ops:
        for nbytes in sizes:
            count = max(1, nbytes // 4)
            if op == "reduce_scatter":  # whole blocks, one per rank
                count = max(size, count // size * size)
            x = np.empty(count, np.float32)
            out = np.empty(count // size, np.float32)
            direct, nonblocking, call = _forms(op, raw, world, x, out, rank)
            ways = {
                "direct": _repeat(direct),
                "thread": _repeat(partial(helper.call, direct)),
                "nonblocking": _repeat(nonblocking),
                "hetcomm": _repeat(call),
            }
            x[...] = 1.0  # sums stay exact over the calls
            calls = args.iters or _calls(nbytes)
            stats = timing.measure(ways, calls, warmup=1)
            for way in WAYS:
                wrong += _wrong(op, ways[way], x, out, rank, size)
            row: dict[str, Any] = {"op": op, "bytes": x.nbytes, "calls": calls}
            for way, stat in stats.items():
                row[f"{way}_us"] = stat.median * 1e6
                row[f"{way}/direct"] = paired_ratio(stat, stats["direct"])
            row["spread"] = max(s.spread for s in stats.values())
            lane_min = getattr(transport_of(world, op, x), "lane_min", {})  # the mpi transport's
            row["way"] = "lane" if laned(lane_min, op, x.nbytes) else "calling thread"
            rows.append(row)
    bad = ctl.allreduce(wrong, op=MPI.SUM)
    helper.stop()
    ctl.Free()
    raw.Free()
    world.close()
    if rank == 0:
        _report(args, size, rows, bad)
    MPI.COMM_WORLD.Barrier()
    return 0 if bad == 0 else 1


def _forms(
    op: str, raw: Any, world: Any, x: np.ndarray, out: np.ndarray, rank: int
) -> tuple[Callable[[], Any], Callable[[], Any], Callable[[], Any]]:
    """`op` on x (in place; reduce_scatter into `out`), root 0: the blocking mpi4py call, the
    non-blocking one waited for by Tests, and hetcomm's."""
    from mpi4py import MPI

    def tested(start: Callable[[], Any]) -> Callable[[], None]:
        def wait() -> None:
            request = start()
            while not request.Test():
                pass

        return wait

    if op == "all_reduce":
        return (
            lambda: raw.Allreduce(MPI.IN_PLACE, x),
            tested(lambda: raw.Iallreduce(MPI.IN_PLACE, x)),
            lambda: world.all_reduce(x),
        )
    if op == "reduce":
        send, recv = (MPI.IN_PLACE, x) if rank == 0 else (x, None)
        return (
            lambda: raw.Reduce(send, recv, root=0),
            tested(lambda: raw.Ireduce(send, recv, root=0)),
            lambda: world.reduce(x, root=0),
        )
    if op == "broadcast":
        return (
            lambda: raw.Bcast(x, 0),
            tested(lambda: raw.Ibcast(x, 0)),
            lambda: world.broadcast(x, root=0),
        )
    return (
        lambda: raw.Reduce_scatter_block(x, out),
        tested(lambda: raw.Ireduce_scatter_block(x, out)),
        lambda: world.reduce_scatter(out, x),
    )


def _wrong(op: str, way: Run, x: np.ndarray, out: np.ndarray, rank: int, size: int) -> int:
    """One call of `way` on fresh data of this rank: the elements that differ from numpy's
    float64 reference (every rank computes every rank's data from the same seeds)."""
    data = [np.random.default_rng([9, q]).integers(-8, 8, x.size) for q in range(size)]
    x[...] = data[rank]
    out[...] = np.nan
    total = np.asarray(np.sum(data, axis=0, dtype=np.float64))
    way(1)
    got: np.ndarray
    want: np.ndarray
    if op == "all_reduce":
        got, want = x, total
    elif op == "reduce":
        got, want = x, (total if rank == 0 else data[rank])
    elif op == "broadcast":
        got, want = x, data[0]
    else:
        n = out.size
        got, want = out, total[rank * n : (rank + 1) * n]
        if not np.array_equal(x, data[rank]):  # the input is not the output here
            return x.size
    return int(np.count_nonzero(got != want))


def _report(args: argparse.Namespace, size: int, rows: list[dict[str, Any]], bad: int) -> None:
    print(
        f"# --study lane: {size} ranks, host float32, in place (reduce_scatter into its "
        f"block), root 0; {args.rounds} interleaved rounds; ratios to direct (median of the "
        f"per-round ratios); wrong elements: {bad}"
    )
    print("| op | bytes | direct | thread | nonblocking | hetcomm | hetcomm's way | spread |")
    print("|---|---:|---:|---:|---:|---:|---|---:|")
    for r in rows:
        cells = [f"{r['direct_us']:.1f} us"] + [
            f"{r[f'{w}_us']:.1f} us ({r[f'{w}/direct']:.2f}x)" for w in WAYS[1:]
        ]
        print(
            f"| {r['op']} | {r['bytes']} | {' | '.join(cells)} | {r['way']} | {r['spread']:.0%} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": size, "rounds": args.rounds, "wrong": bad, "rows": rows}, f)
    sys.stdout.flush()
