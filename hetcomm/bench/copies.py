"""The copies study (`hetcomm bench --study copies`): what one copy between host and device
costs on a GPU that the ranks share, queued as one 1D copy beside the 2D rows that hetcomm
queues (hetcomm.kernels.host_copies), with one process copying and with every one at once.

Each sample is a device -> pinned host copy, then a pinned host -> device copy, each waited
for (a spinning event), on a stream of its own: on rank 0 while the other ranks wait
("alone"), and on every rank at the same time ("together"). A device-to-device copy on every
rank at once stands beside them ("d2d together"). Every way runs in the same interleaved
rounds; the times are per pair of copies, the slowest rank's, medians over the rounds. Each
copy's bytes are checked against what was written, at every size and way.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

import numpy as np

from .timing import Interleaved, Run, paired_ratio

SIZES = (8, 1024, 16384, 24576, 32768, 65536)


def run(args: argparse.Namespace) -> int:
    """`hetcomm bench --study copies [-b MIN -e MAX -f FACTOR] [--rounds N] [-n CALLS (50)]`,
    on a GPU (each rank on GPU local rank mod GPU count)."""
    from ..kernels import device

    why = device.unavailable()
    if why is not None:
        raise SystemExit(f"hetcomm bench --study copies: times copies on a GPU: {why}")
    import cupy
    from mpi4py import MPI

    from ..kernels.host_copies import memcpy_async
    from .sweep import sizes_of

    ctl = MPI.COMM_WORLD.Dup()
    rank, ranks = ctl.Get_rank(), ctl.Get_size()
    local = ctl.Split_type(MPI.COMM_TYPE_SHARED)
    gpus = cupy.cuda.runtime.getDeviceCount()
    cupy.cuda.Device(local.Get_rank() % gpus).use()
    sharing = local.Get_size() // gpus if gpus else 0
    local.Free()
    rt = cupy.cuda.runtime
    stream = cupy.cuda.Stream(non_blocking=True)
    sizes = list(SIZES)
    if args.minbytes is not None or args.maxbytes is not None:
        low, high = args.minbytes or args.maxbytes, args.maxbytes or args.minbytes
        sizes = sizes_of(argparse.Namespace(**{**vars(args), "minbytes": low, "maxbytes": high}))
    top = max(sizes)
    dev, back = cupy.empty(top, cupy.uint8), cupy.empty(top, cupy.uint8)
    host_mem = cupy.cuda.alloc_pinned_memory(top)
    host = np.frombuffer(host_mem, np.uint8, top)
    calls = args.iters or 50
    timing = Interleaved(ctl, args.rounds)
    wrong = 0

    def one_d(dst: int, src: int, n: int, kind: int) -> None:
        rt.memcpyAsync(dst, src, n, kind, stream.ptr)

    def as_rows(dst: int, src: int, n: int, kind: int) -> None:
        memcpy_async(rt, dst, src, n, kind, stream.ptr)

    def wait() -> None:
        event = cupy.cuda.Event(block=False, disable_timing=True)
        event.record(stream)
        event.synchronize()

    def pair(copy: Callable[[int, int, int, int], None], n: int, kinds: tuple[int, int]) -> None:
        down, up = kinds
        middle = host.ctypes.data if down == 2 else back.data.ptr
        copy(middle, dev.data.ptr, n, down)
        wait()
        copy(dev.data.ptr, middle, n, up)
        wait()

    def way(copy: Callable[..., None], n: int, who: str, kinds: tuple[int, int] = (2, 1)) -> Run:
        def sample(k: int) -> None:
            if who == "alone" and rank != 0:
                return
            for _ in range(k):
                pair(copy, n, kinds)

        return sample

    def checked(copy: Callable[..., None], n: int) -> bool:
        values = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
        dev[:n].set(values, stream=stream)
        host[:n] = values[::-1]
        copy(host.ctypes.data, dev.data.ptr, n, 2)
        wait()
        ok = bool((host[:n] == values).all())
        host[:n] = values[::-1]
        copy(dev.data.ptr, host.ctypes.data, n, 1)
        wait()
        return ok and bool((cupy.asnumpy(dev[:n], stream=stream) == values[::-1]).all())

    rows = []
    for n in sizes:
        wrong += sum(not checked(copy, n) for copy in (one_d, as_rows))
        ways = {
            "alone 1D": way(one_d, n, "alone"),
            "alone rows": way(as_rows, n, "alone"),
            "together 1D": way(one_d, n, "together"),
            "together rows": way(as_rows, n, "together"),
            "d2d together": way(one_d, n, "together", (3, 3)),
        }
        stats = timing.measure(ways, calls, warmup=3)
        ratio = paired_ratio(stats["together rows"], stats["together 1D"])
        rows.append(
            {
                "bytes": n,
                **{k: s.median * 1e6 for k, s in stats.items()},
                "rows_over_1d_together": ratio,
                "spread": max(s.spread for s in stats.values()),
            }
        )
    bad = ctl.allreduce(wrong, op=MPI.SUM)
    ctl.Free()
    if rank == 0:
        print(
            f"# --study copies: {ranks} ranks, {sharing or '?'} per GPU, {args.rounds} "
            f"interleaved rounds of {calls} pairs of copies (device -> pinned host -> device, "
            f"each waited for); us per pair, the slowest rank's; copies with wrong bytes: {bad}"
        )
        names = [k for k in rows[0] if k not in ("bytes", "rows_over_1d_together", "spread")]
        print("| bytes | " + " | ".join(names) + " | rows / 1D together | spread |")
        print("|---:|" + "---:|" * (len(names) + 2))
        for r in rows:
            cells = " | ".join(f"{r[k]:.1f}" for k in names)
            ratio = r["rows_over_1d_together"]
            shown = "-" if ratio is None else f"{ratio:.2f}"
            print(f"| {r['bytes']} | {cells} | {shown} | {r['spread']:.0%} |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ranks": ranks, "per_gpu": sharing, "rows": rows}, f)
        sys.stdout.flush()
    MPI.COMM_WORLD.Barrier()
    return 0 if bad == 0 else 1
