"""The GPU studies (`--study staged`, `--study direct`): send/recv and all_reduce on device
buffers beside the copy rates that bound them, in one run (CuPy; written for the GPU machine).

`--mode p2p` (2 ranks): rank 0 sends, rank 1 receives, at each size; one operation at a time
(barrier, the call, a device synchronize: the slowest rank's time) and back to back as
nccl-tests times (K operations issued with async_op=True, then all waited for; the time per
operation), and the steady state, the time each further operation adds: from K1 and K2 back
to back, (K2 T(K2) - K1 T(K1)) / (K2 - K1). Beside them: the device-to-device copy rate and
the copy through a CUDA IPC mapping (direct's bounds), the pinned device->host copy rate and
both directions at once (staged's bounds), and naive staging (pageable copy, MPI, copy back).
`--mode allreduce` (any ranks): all_reduce from 1 KiB to 1 GiB (staged to 256 MiB), one at a
time and back to back, beside naive staging and, where the ranks share one GPU, the memory
traffic floor (every input read once, every output written once, at the copy's rate).

Ranks simulate two vendors (even ranks nvidia, odd amd) so that the plan treats every pair as
a vendor boundary, except for nccl (one vendor's library), which runs only where every rank
has a GPU of its own. Interleaved rounds, medians and spread come from timing.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from .report import bus_factor, parse_size, size_steps
from .timing import Interleaved, Run, Stat, cupy_event_seconds

MiB = 1 << 20
P2P_SIZES = (8, 64 << 10, 1 * MiB, 16 * MiB, 256 * MiB)
ALLREDUCE_SIZES = tuple(1 << k for k in range(10, 31, 2))  # 1 KiB .. 1 GiB
STAGED_MAX_ALLREDUCE = 256 * MiB
MODES = ("p2p", "allreduce")


def add_arguments(group: Any) -> None:
    """The options of the two GPU studies."""
    group.add_argument(
        "--compare",
        default=None,
        help="--study staged/direct: other transports timed beside it (default: direct "
        "beside staged, staged beside direct; nccl too where every rank has its own GPU)",
    )


def _cupy() -> Any:
    import cupy

    return cupy


def _use_local_device(mpi: Any) -> None:
    """Rank r of a host on its device local-rank mod device count."""
    from mpi4py import MPI

    cupy = _cupy()
    local = mpi.Split_type(MPI.COMM_TYPE_SHARED)
    cupy.cuda.Device(local.Get_rank() % cupy.cuda.runtime.getDeviceCount()).use()
    local.Free()


def _sync() -> None:
    _cupy().cuda.runtime.deviceSynchronize()


def own_gpus(mpi: Any) -> bool:
    """Whether every rank has a GPU of its own (NCCL can join them)."""
    from mpi4py import MPI

    local = mpi.Split_type(MPI.COMM_TYPE_SHARED)
    mine = local.Get_size() <= _cupy().cuda.runtime.getDeviceCount()
    local.Free()
    return bool(mpi.allreduce(mine, op=MPI.LAND))


def alone(mpi: Any, fn: Callable[[], float]) -> float:
    """fn() on rank 0 while the others wait, its value on every rank: a yardstick copy timed
    while other ranks copy on the same GPU would be slowed."""
    mpi.Barrier()
    value = fn() if mpi.Get_rank() == 0 else None
    mpi.Barrier()
    return float(mpi.bcast(value, root=0))


def copy_rate(nbytes: int) -> float:
    """Device-to-device cudaMemcpyAsync: bytes copied per second (CUDA events)."""
    cupy = _cupy()
    a = cupy.ones(nbytes, dtype=cupy.uint8)
    b = cupy.empty_like(a)
    rt = cupy.cuda.runtime
    stream = cupy.cuda.get_current_stream().ptr
    return nbytes / cupy_event_seconds(
        lambda: rt.memcpyAsync(b.data.ptr, a.data.ptr, nbytes, rt.memcpyDeviceToDevice, stream)
    )


def pinned_rates(nbytes: int) -> tuple[float, float]:
    """Bytes per second device->pinned host alone, and each way with both directions at once
    (two streams of one process): what PCIe gives staged's copies."""
    import time

    cupy = _cupy()
    import cupyx

    rt = cupy.cuda.runtime
    src = cupy.ones(nbytes, dtype=cupy.uint8)
    back = cupy.empty_like(src)
    down, up = cupyx.empty_pinned(nbytes, np.uint8), cupyx.empty_pinned(nbytes, np.uint8)
    stream = cupy.cuda.get_current_stream().ptr
    alone_s = cupy_event_seconds(
        lambda: rt.memcpyAsync(
            down.ctypes.data, src.data.ptr, nbytes, rt.memcpyDeviceToHost, stream
        )
    )
    a, b = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    times = []
    for _ in range(6):
        _sync()
        t0 = time.perf_counter()
        rt.memcpyAsync(down.ctypes.data, src.data.ptr, nbytes, rt.memcpyDeviceToHost, a.ptr)
        rt.memcpyAsync(back.data.ptr, up.ctypes.data, nbytes, rt.memcpyHostToDevice, b.ptr)
        a.synchronize()
        b.synchronize()
        times.append(time.perf_counter() - t0)
    return nbytes / alone_s, nbytes / float(np.median(times[1:]))


def ipc_copy_rate(mpi: Any, nbytes: int) -> float | None:
    """Rank 1 copies rank 0's buffer through a CUDA IPC mapping: bytes per second, or None
    where the two do not share a host."""
    from mpi4py import MPI

    cupy = _cupy()
    rt = cupy.cuda.runtime
    local = mpi.Split_type(MPI.COMM_TYPE_SHARED)
    neighbours = set(local.allgather(mpi.Get_rank()))
    local.Free()
    if not mpi.bcast(1 in neighbours if mpi.Get_rank() == 0 else None, root=0):
        return None
    mine = rt.malloc(nbytes)  # its own allocation: an IPC handle maps a whole allocation
    handle = mpi.bcast(rt.ipcGetMemHandle(mine) if mpi.Get_rank() == 0 else None, root=0)
    rate = None
    if mpi.Get_rank() == 1:
        src = rt.ipcOpenMemHandle(handle)
        dst = cupy.empty(nbytes, dtype=cupy.uint8)
        stream = cupy.cuda.get_current_stream().ptr
        rate = nbytes / cupy_event_seconds(
            lambda: rt.memcpyAsync(dst.data.ptr, src, nbytes, rt.memcpyDeviceToDevice, stream)
        )
        rt.ipcCloseMemHandle(src)
    mpi.Barrier()
    rt.free(mine)
    return mpi.bcast(rate, root=1)


def _comm(transport: str, rank: int) -> Any:
    """A Communicator of `transport`; ranks simulate two vendors except for nccl."""
    import hetcomm

    vendor = None if transport == "nccl" else ("nvidia", "amd")[rank % 2]
    config = hetcomm.Config.load(transport=transport, vendor=vendor)
    return hetcomm.init(config=config, name=f"bench-{transport}")


def _row(case: str, nbytes: int, stat: Stat | float, **extra: Any) -> dict[str, Any]:
    seconds = stat.median if isinstance(stat, Stat) else stat
    row = {"case": case, "bytes": nbytes, "time_us": seconds * 1e6}
    row["GBps"] = nbytes / seconds / 1e9 if seconds > 0 else 0.0
    if isinstance(stat, Stat):
        row["spread"] = round(stat.spread, 3)
    row.update(extra)
    return row


class DeviceStudy:
    """The p2p and allreduce modes for one transport and the ones compared with it."""

    def __init__(self, args: argparse.Namespace, transport: str) -> None:
        from mpi4py import MPI

        self.args = args
        self.mpi = MPI.COMM_WORLD.Dup()
        self.rank, self.ranks = self.mpi.Get_rank(), self.mpi.Get_size()
        _use_local_device(self.mpi)
        self.transport = transport
        other = "direct" if transport == "staged" else "staged"
        wanted = [transport, other] if args.compare is None else [transport, *_split(args.compare)]
        self.own_gpus = own_gpus(self.mpi)
        if args.compare is None and self.own_gpus:
            wanted.append("nccl")
        self.transports = list(dict.fromkeys(wanted))
        self.timing = Interleaved(self.mpi, args.rounds, sync=_sync)
        self.rows: list[dict[str, Any]] = []

    def sizes(self, default: tuple[int, ...]) -> list[int]:
        if self.args.minbytes is None and self.args.maxbytes is None:
            return list(default)
        lo = parse_size(self.args.minbytes or default[0])
        hi = parse_size(self.args.maxbytes or default[-1])
        return size_steps(lo, hi, self.args.stepfactor or 4)

    def _ok(self, good: bool) -> bool:
        from mpi4py import MPI

        return bool(self.mpi.allreduce(bool(good), op=MPI.LAND))

    def p2p(self) -> None:
        """Send/recv rank 0 -> rank 1 per transport and size, with the bounds and naive."""
        cupy = _cupy()
        if self.ranks < 2:
            raise SystemExit("--mode p2p needs 2 ranks (rank 0 sends to rank 1)")
        big = 256 * MiB
        rate = alone(self.mpi, lambda: copy_rate(big))
        self.rows.append(_row("device-to-device copy", big, big / rate))
        ipc = ipc_copy_rate(self.mpi, big)
        if ipc is not None:
            self.rows.append(_row("copy through the IPC mapping", big, big / ipc))
        d2h, both = self.mpi.bcast(pinned_rates(big) if self.rank == 0 else None, root=0)
        self.rows.append(_row("pinned device->host copy", big, big / d2h))
        self.rows.append(_row("pinned copies both ways at once (each way)", big, big / both))
        comms = {t: _comm(t, self.rank) for t in self.transports}
        try:
            for size in self.sizes(P2P_SIZES):
                x = cupy.arange(size, dtype=cupy.uint8)
                ys = {t: cupy.zeros(size, dtype=cupy.uint8) for t in [*comms, "naive"]}
                impls = {t: self._one_at_a_time(c, x, ys[t]) for t, c in comms.items()}
                impls["naive"] = self._naive(x, ys["naive"], np.empty(size, np.uint8))
                stats = self.timing.measure(impls, 1, warmup=2)
                for name, stat in stats.items():
                    ok = self.rank != 1 or bool((ys[name] == x).all())
                    self.rows.append(_row(f"{name} send/recv", size, stat, ok=self._ok(ok)))
                if size >= 64 << 10:
                    self._back_to_back(comms, x, ys, size)
        finally:
            for c in comms.values():
                c.close()

    def _one_at_a_time(self, comm: Any, x: Any, y: Any) -> Run:
        rank = self.rank

        def run(calls: int) -> None:
            for _ in range(calls):
                if rank == 0:
                    comm.send(x, 1)
                elif rank == 1:
                    comm.recv(y, 0)
                _sync()

        return run

    def _naive(self, x: Any, y: Any, host: np.ndarray) -> Run:
        """Pageable copy out, MPI, copy in."""
        cupy, mpi, rank = _cupy(), self.mpi, self.rank

        def run(calls: int) -> None:
            for _ in range(calls):
                if rank == 0:
                    mpi.Send(cupy.asnumpy(x), 1)
                elif rank == 1:
                    mpi.Recv(host, 0)
                    y.set(host)

        return run

    def _back_to_back(self, comms: dict[str, Any], x: Any, ys: dict[str, Any], size: int) -> None:
        """K operations in flight per transport, two values of K: per operation and steady."""
        rank = self.rank

        def issue(comm: Any, y: Any) -> Run:
            def run(calls: int) -> None:
                works = []
                for _ in range(calls):
                    if rank == 0:
                        works.append(comm.send(x, 1, async_op=True))
                    elif rank == 1:
                        works.append(comm.recv(y, 0, async_op=True))
                for w in works:
                    w.wait()

            return run

        few, many = (2, 6) if size > 16 * MiB else (8, 32)
        impls = {t: issue(c, ys[t]) for t, c in comms.items()}
        first = self.timing.measure(impls, few, warmup=1)
        then = self.timing.measure(impls, many)
        for t in comms:
            ok = self.rank != 1 or bool((ys[t] == x).all())
            steady = (many * then[t].median - few * first[t].median) / (many - few)
            self.rows.append(
                _row(
                    f"{t} send/recv, {many} back to back",
                    size,
                    then[t],
                    steady_us=steady * 1e6,
                    steady_GBps=size / steady / 1e9 if steady > 0 else None,
                    ok=self._ok(ok),
                )
            )

    def allreduce(self) -> None:
        """all_reduce per transport and size, beside naive staging and the traffic floor."""
        cupy = _cupy()
        n = self.ranks
        big = 256 * MiB
        rate = alone(self.mpi, lambda: copy_rate(big))
        self.rows.append(_row("device-to-device copy", big, big / rate))
        comms = {t: _comm(t, self.rank) for t in self.transports}
        factor = bus_factor("all_reduce", n)
        try:
            for nbytes in self.sizes(ALLREDUCE_SIZES):
                xs = {t: cupy.ones(nbytes // 4, dtype=cupy.float32) for t in comms}
                impls: dict[str, Run] = {
                    t: _repeat(c.all_reduce, xs[t])
                    for t, c in comms.items()
                    if not (t == "staged" and nbytes > STAGED_MAX_ALLREDUCE)
                }
                if nbytes <= STAGED_MAX_ALLREDUCE:  # above it naive takes seconds a call
                    naive = cupy.ones(nbytes // 4, dtype=cupy.float32)
                    host = np.empty(nbytes // 4, np.float32)
                    impls["naive"] = _repeat(self._naive_allreduce, naive, host)
                stats = self.timing.measure(impls, 1, warmup=1)
                # the floor where the ranks share one GPU: each input read, each output written
                floor = None if self.own_gpus else n * 2 * nbytes / (2 * rate)
                for name, stat in stats.items():
                    ok = True
                    if name in xs:
                        xs[name][:] = 1
                        comms[name].all_reduce(xs[name])
                        _sync()
                        ok = bool((xs[name] == n).all())
                    extra: dict[str, Any] = {"ranks": n, "ok": self._ok(ok)}
                    extra["busbw_GBps"] = nbytes / stat.median / 1e9 * factor
                    if floor is not None and name == "direct" and nbytes >= 64 * MiB:
                        extra.update(floor_us=floor * 1e6, x_floor=stat.median / floor)
                    self.rows.append(_row(f"{name} all_reduce", nbytes, stat, **extra))
                del xs
        finally:
            for c in comms.values():
                c.close()

    def _naive_allreduce(self, x: Any, host: np.ndarray) -> None:
        h = _cupy().asnumpy(x)
        self.mpi.Allreduce(h, host)
        x.set(host)

    def close(self) -> None:
        self.mpi.Free()


def _repeat(fn: Callable[..., Any], *args: Any) -> Run:
    def run(calls: int) -> None:
        for _ in range(calls):
            fn(*args)

    return run


def _split(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: one line per case and size."""
    out = [
        "| case | bytes | time (us) | GB/s | spread | steady GB/s | ok |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        steady = r.get("steady_GBps")
        out.append(
            f"| {r['case']} | {r['bytes']} | {r['time_us']:.1f} | {r['GBps']:.2f} | "
            f"{r.get('spread', 0):.0%} | {'' if steady is None else f'{steady:.2f}'} | "
            f"{'' if 'ok' not in r else ('yes' if r['ok'] else 'NO')} |"
        )
    return "\n".join(out)


def _run(args: argparse.Namespace, transport: str) -> int:
    from mpi4py import MPI

    mode = args.mode or "p2p"
    if mode not in MODES:
        raise SystemExit(
            f"--study {transport}: --mode {mode!r}; expected one of {', '.join(MODES)}"
        )
    study = DeviceStudy(args, transport)
    try:
        getattr(study, mode)()
    finally:
        study.close()
    rows = study.rows
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(
            f"# --study {transport} --mode {mode}: {MPI.COMM_WORLD.Get_size()} ranks, "
            f"{args.rounds} interleaved rounds, host {os.uname().nodename}"
        )
        print(table(rows))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"study": transport, "mode": mode, "rows": rows}, f, indent=1)
        sys.stdout.flush()
    MPI.COMM_WORLD.Barrier()
    return 0 if all(r.get("ok", True) for r in rows) else 1


def run_staged(args: argparse.Namespace) -> int:
    """`hetcomm bench --study staged --mode p2p|allreduce`."""
    return _run(args, "staged")


def run_direct(args: argparse.Namespace) -> int:
    """`hetcomm bench --study direct --mode p2p|allreduce`."""
    return _run(args, "direct")
