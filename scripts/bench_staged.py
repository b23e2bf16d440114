"""Staged transport on the GPU, beside the copy bandwidth and the naive path, in one run.

mpirun -n 2 python -m mpi4py scripts/bench_staged.py p2p OUT.json
mpirun -n 4 python -m mpi4py scripts/bench_staged.py allreduce OUT.json
mpirun -n 2 python -m mpi4py scripts/bench_staged.py latency OUT.json
mpirun -n 2 python -m mpi4py scripts/bench_staged.py timeline OUT.json   (one op's pipeline)
mpirun -n 2 python -m mpi4py scripts/bench_staged.py early OUT.json   (early chunks, ramps)
mpirun -n 2 python -m mpi4py scripts/bench_staged.py pingstamp OUT.json (small ping-pongs, stamped)
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from typing import Any

import cupy
import numpy as np
from bench_direct import _save, alone, back_to_back, gpu_seconds, median_time, memcpy
from mpi4py import MPI

import hetcomm

MiB = 1 << 20


def pinned_copy_rate(nbytes: int) -> float:
    """Device->pinned host bytes per second (median of 5)."""
    src = cupy.ones(nbytes, dtype=cupy.uint8)
    dst = cupy.cuda.alloc_pinned_memory(nbytes)
    return nbytes / gpu_seconds(lambda: memcpy(dst.ptr, src.data.ptr, nbytes, 2), runs=6)


def pinned_both_ways(nbytes: int, down: int = 0, up: int = 0) -> float:
    """Device->host (into `down`) and host->device (from `up`) at once, on two streams of one
    process: bytes per second each way (median of 5); what PCIe gives when both directions are
    busy. Host memory pinned by cudaMallocHost unless pointers to registered memory are given."""
    src = cupy.ones(nbytes, dtype=cupy.uint8)
    back = cupy.empty_like(src)
    keep = [cupy.cuda.alloc_pinned_memory(nbytes) for _ in range(0 if down else 2)]
    if keep:
        down, up = keep[0].ptr, keep[1].ptr
    a, b = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    times = []
    for _ in range(6):
        cupy.cuda.Device().synchronize()
        t0 = time.perf_counter()
        cupy.cuda.runtime.memcpyAsync(down, src.data.ptr, nbytes, 2, a.ptr)
        cupy.cuda.runtime.memcpyAsync(back.data.ptr, up, nbytes, 1, b.ptr)
        a.synchronize()
        b.synchronize()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times[1:])


def naive_p2p(world: MPI.Intracomm, x: Any, y: Any, repeats: int) -> dict[str, Any]:
    """The naive path from rank 0's `x` to rank 1's `y`: a pageable copy out, MPI, a copy in
    (median of `repeats`)."""
    r = world.Get_rank()
    host = np.empty(x.nbytes, dtype=np.uint8)

    def naive() -> None:
        if r == 0:
            world.Send(cupy.asnumpy(x), 1)
        elif r == 1:
            world.Recv(host, 0)
            y.set(host)

    med, spread = median_time(naive, world, repeats)
    return {
        "case": "naive (pageable copy, MPI, copy back)",
        "bytes": x.nbytes,
        "time_ms": med * 1e3,
        "GBps": x.nbytes / med / 1e9,
        "spread": spread,
        "ok": True,
    }


def host_memory_rates(nbytes: int) -> list[dict[str, Any]]:
    """Copy rates between the device and three kinds of host memory, one process: pinned by
    cudaMallocHost; a /dev/shm segment registered with the GPU (the shm rail's slots); anonymous
    memory asked for in huge pages (madvise) and registered. Each way alone, and both ways at
    once through the shared segment."""
    import mmap
    import os

    from hetcomm.kernels import device as kd

    from hetcomm.transports.shm import SharedSlots

    dev = cupy.cuda.Device().id
    src = cupy.ones(nbytes, dtype=cupy.uint8)
    back = cupy.empty_like(src)
    pinned = cupy.cuda.alloc_pinned_memory(nbytes)
    seg = SharedSlots(f"hetcomm-bench-{os.getpid()}", 2, nbytes, create=True)
    seg.unlink()
    seg.register_with_gpu(dev)
    huge = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advised = True
    try:
        huge.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):
        advised = False
    huge_arr = np.frombuffer(huge, dtype=np.uint8)
    huge_arr[:] = 1  # fault the pages in
    huge_ptr = huge_arr.__array_interface__["data"][0]
    kd.host_register(huge_ptr, nbytes, dev)
    rows = []
    hugename = "anonymous, huge pages " + ("asked" if advised else "not available")
    kinds = (
        ("pinned (cudaMallocHost)", pinned.ptr),
        ("shared /dev/shm segment, registered", seg.ptr),
        (hugename + ", registered", huge_ptr),
    )
    for name, ptr in kinds:
        d2h = gpu_seconds(lambda p=ptr: memcpy(p, src.data.ptr, nbytes, 2), runs=6)
        h2d = gpu_seconds(lambda p=ptr: memcpy(back.data.ptr, p, nbytes, 1), runs=6)
        rows.append({"case": f"device->host, {name}", "bytes": nbytes, "GBps": nbytes / d2h / 1e9})
        rows.append({"case": f"host->device, {name}", "bytes": nbytes, "GBps": nbytes / h2d / 1e9})
    rows.append(
        {
            "case": "both ways at once through the shared segment (each way)",
            "bytes": nbytes,
            "GBps": pinned_both_ways(nbytes, seg.ptr, seg.ptr + nbytes) / 1e9,
        }
    )
    kd.host_unregister(huge_ptr)
    seg.close()
    return rows


def p2p(out: str) -> None:
    world = MPI.COMM_WORLD
    r = world.Get_rank()
    rows = []
    nbytes = 256 * MiB
    copy = alone(world, pinned_copy_rate, nbytes)
    both = alone(world, pinned_both_ways, nbytes)
    x = cupy.arange(nbytes, dtype=cupy.uint8)
    y = cupy.zeros(nbytes, dtype=cupy.uint8)
    for chunk in (1 * MiB, 2 * MiB, 4 * MiB, 8 * MiB, 16 * MiB):
        comm = hetcomm.init(
            config=hetcomm.Config.load(transport="staged", vendor=("nvidia", "amd")[r % 2])
        )
        t = comm._transport("send", hetcomm.arrays.as_buffer(x))
        t.chunk_bytes = chunk

        def once(comm: hetcomm.Communicator = comm) -> None:
            if r == 0:
                comm.send(x, 1)
            elif r == 1:
                comm.recv(y, 0)

        med, spread = median_time(once, world)
        ok = r != 1 or bool((y == x).all())
        rows.append(
            {
                "case": "staged send/recv",
                "chunk_MiB": chunk // MiB,
                "bytes": nbytes,
                "time_ms": med * 1e3,
                "GBps": nbytes / med / 1e9,
                "spread": spread,
                "ok": bool(world.allreduce(ok, op=MPI.LAND)),
            }
        )
        if chunk >= 4 * MiB:
            # back to back: the time each further operation adds (see bench_direct.py)
            def start(comm: hetcomm.Communicator = comm) -> Any:
                if r == 0:
                    return comm.send(x, 1, async_op=True)
                return comm.recv(y, 0, async_op=True) if r == 1 else None

            p2, _ = back_to_back(start, world, 2, 5)
            p6, spread = back_to_back(start, world, 6, 5)
            steady = (6 * p6 - 2 * p2) / 4
            rows.append(
                {
                    "case": "staged send/recv, steady state back to back",
                    "chunk_MiB": chunk // MiB,
                    "bytes": nbytes,
                    "time_ms": steady * 1e3,
                    "GBps": nbytes / steady / 1e9,
                    "spread": spread,
                    "ok": True,
                }
            )
        comm.close()
    for size in (64 * 1024, 1 * MiB, 16 * MiB):
        comm = hetcomm.init(
            config=hetcomm.Config.load(transport="staged", vendor=("nvidia", "amd")[r % 2])
        )
        a = cupy.ones(size, dtype=cupy.uint8)

        def small(comm: hetcomm.Communicator = comm, a: cupy.ndarray = a) -> None:
            if r == 0:
                comm.send(a, 1)
            elif r == 1:
                comm.recv(a, 0)

        med, spread = median_time(small, world, 21)
        rows.append(
            {
                "case": "staged send/recv",
                "chunk_MiB": 4,
                "bytes": size,
                "time_ms": med * 1e3,
                "GBps": size / med / 1e9,
                "spread": spread,
                "ok": True,
            }
        )
        comm.close()
    rows.append(naive_p2p(world, x, y, 7))
    rows.append({"case": "pinned device->host copy", "bytes": nbytes, "GBps": copy / 1e9})
    rows.append(
        {"case": "pinned copies both ways at once (each way)", "bytes": nbytes, "GBps": both / 1e9}
    )
    _save(out, rows, r)


class SlowCalls:
    """Calls into C code (cupy, sockets, locks) that took longer than `limit` seconds, on every
    thread, while `on`: a profile hook (threading.setprofile) that sees each C call start and
    end. A call's time includes the wait for the interpreter lock after it, which is what a
    thread of the pipeline loses to the others."""

    def __init__(self, limit: float = 30e-6) -> None:
        self.limit, self.on = limit, False
        self.slow: list[tuple[float, str]] = []
        self._open: dict[int, float] = {}

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if not self.on:
            return
        if event == "c_call":
            self._open[threading.get_ident()] = time.perf_counter()
        elif event in ("c_return", "c_exception"):
            t0 = self._open.pop(threading.get_ident(), None)
            if t0 is not None and time.perf_counter() - t0 > self.limit:
                us = (time.perf_counter() - t0) * 1e6
                name = getattr(arg, "__qualname__", None) or getattr(arg, "__name__", "?")
                where = f"{frame.f_code.co_name}:{frame.f_lineno}"
                self.slow.append(
                    (t0, f"[{threading.current_thread().name}] {name} {us:.0f} us in {where}")
                )

    def install(self) -> None:
        threading.setprofile(self)
        sys.setprofile(self)


def timeline(out: str) -> None:
    """Where one 256 MiB send/recv spends its time: the pipeline's stamps on both ranks (chunk
    by chunk: slot taken, device->host copy queued and done, slot announced and landed,
    host->device copy done), for each chunk size, after five unprofiled runs. With
    TIMELINE_CALLS=1 the stamps also list every call into C code that took over 30 us
    (SlowCalls), on every thread."""
    from hetcomm.transports.staged import ops as staged_ops

    calls = SlowCalls() if os.environ.get("TIMELINE_CALLS") else None
    if calls is not None:
        calls.install()
    world = MPI.COMM_WORLD
    r = world.Get_rank()
    nbytes = 256 * MiB
    x = cupy.arange(nbytes, dtype=cupy.uint8)
    y = cupy.zeros(nbytes, dtype=cupy.uint8)
    rows = []
    for chunk in (4 * MiB, 8 * MiB):
        comm = hetcomm.init(
            config=hetcomm.Config.load(transport="staged", vendor=("nvidia", "amd")[r % 2])
        )
        t = comm._transport("send", hetcomm.arrays.as_buffer(x))
        t.chunk_bytes = chunk
        times = []
        for i in range(14):  # two warm-ups, nine timed, three profiled
            staged_ops.stamp.marks = [] if i >= 11 else None
            if calls is not None:
                calls.on, calls.slow = i >= 11, []
            world.Barrier()
            t0 = time.perf_counter()
            if r == 0:
                comm.send(x, 1)
            elif r == 1:
                comm.recv(y, 0)
            cupy.cuda.Device().synchronize()
            t1 = time.perf_counter()
            if 2 <= i < 11:
                times.append(world.allreduce(t1 - t0, op=MPI.MAX))
            if i == 10:
                ok = world.allreduce(r != 1 or bool((y == x).all()), op=MPI.LAND)
                med = statistics.median(times)
                rows.append(
                    {
                        "case": f"256 MiB send/recv, {chunk // MiB} MiB chunks, one at a "
                        "time (median of 9, slowest rank)",
                        "time_ms": med * 1e3,
                        "GBps": nbytes / med / 1e9,
                        "min_ms": min(times) * 1e3,
                        "max_ms": max(times) * 1e3,
                        "ok": ok,
                    }
                )
            if staged_ops.stamp.marks is None:
                continue
            mine = staged_ops.stamp.marks + (calls.slow if calls is not None else [])
            marks = world.gather(([(t, r, what) for t, what in mine], t0, t1))
            if r == 0:
                start = min(m[1] for m in marks)
                merged = sorted(m for ms, _, _ in marks for m in ms)
                rows.append(
                    {
                        "case": f"256 MiB send/recv, {chunk // MiB} MiB chunks",
                        "total_us": [round((m[2] - start) * 1e6) for m in marks],
                        "marks": [
                            (round((t - start) * 1e6), rank, what) for t, rank, what in merged
                        ],
                    }
                )
        staged_ops.stamp.marks = None
        if calls is not None:
            calls.on = False
        comm.close()
    rows.append(
        {
            "case": "pinned device->host copy",
            "bytes": nbytes,
            "GBps": alone(world, pinned_copy_rate, nbytes) / 1e9,
        }
    )
    if r == 0:
        for row in rows:
            if "marks" not in row:
                print(row)
                continue
            print(row["case"], "total per rank", row["total_us"])
            for m in row["marks"]:
                print("   ", m)
    _save(out, rows, r)


def early(out: str) -> None:
    """One 256 MiB send/recv, GPU to GPU over shm, with and without the early chunks and the
    ramped chunk sizes (staged.EARLY_CHUNKS, staged.RAMP), the variants taking turns round by
    round; then 20 operations back to back, timed as nccl-tests does (the whole run over 20),
    and the steady state, for the first three variants; the pinned copies and the naive path
    beside them. The default settings are "early chunks"; "ordered by flags" orders the two
    ranks' copies by the shared slots' flags instead of threads waiting on every copy
    (staged.GPU_FLAGS)."""

    world = MPI.COMM_WORLD
    r = world.Get_rank()
    nbytes = 256 * MiB
    copy = alone(world, pinned_copy_rate, nbytes)
    both = alone(world, pinned_both_ways, nbytes)
    x = cupy.arange(nbytes, dtype=cupy.uint8)
    y = cupy.zeros(nbytes, dtype=cupy.uint8)
    # name -> (chunk, early chunks, ramp, flags); a communicator per chunk size and flags
    # setting (the shared slots are as large as the chunks of the transport's first operation,
    # and a channel decides on flags when it opens)
    variants = {
        "before: plain 8 MiB chunks": (8 * MiB, 0, (0, 0), False),
        "early chunks": (8 * MiB, 4, (0, 0), False),
        "early chunks, copies ordered by flags": (8 * MiB, 4, (0, 0), True),
        "early chunks, 4 MiB chunks": (4 * MiB, 4, (0, 0), False),
        "early + ramp 3/2": (8 * MiB, 4, (3, 2), False),
    }
    comms = {}
    for chunk, flags in sorted({(v[0], v[3]) for v in variants.values()}):
        c = comms[chunk, flags] = hetcomm.init(
            config=hetcomm.Config.load(transport="staged", vendor=("nvidia", "amd")[r % 2])
        )
        c._transport("send", hetcomm.arrays.as_buffer(x)).chunk_bytes = chunk
        if r < 2:  # open the channel now, with this setting
            c.send(x[:1], 1) if r == 0 else c.recv(y[:1], 0)
    comm = comms[8 * MiB, False]

    def use(name: str) -> None:
        nonlocal comm
        chunk, early_chunks, ramp, flags = variants[name]
        comm = comms[chunk, flags]
        t = comm._transport("send", hetcomm.arrays.as_buffer(x))
        t.early_chunks, t.ramp = early_chunks, ramp

    def once() -> None:
        if r == 0:
            comm.send(x, 1)
        elif r == 1:
            comm.recv(y, 0)

    def start() -> Any:
        if r == 0:
            return comm.send(x, 1, async_op=True)
        return comm.recv(y, 0, async_op=True) if r == 1 else None

    times: dict[str, list[float]] = {name: [] for name in variants}
    oks = []
    for _ in range(9):
        for name in variants:
            use(name)
            y.fill(0)
            med, _ = median_time(once, world, 5)
            times[name].append(med)
            oks.append(r != 1 or bool((y == x).all()))
    ok = bool(world.allreduce(all(oks), op=MPI.LAND))
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        rows.append(
            {
                "case": f"256 MiB send/recv one at a time, {name}",
                "bytes": nbytes,
                "time_ms": med * 1e3,
                "GBps": nbytes / med / 1e9,
                "of_pinned_copy": nbytes / med / copy,
                "min_ms": min(ts) * 1e3,
                "max_ms": max(ts) * 1e3,
                "spread": (max(ts) - min(ts)) / med,
                "ok": ok,
            }
        )
    for name in (next(iter(variants)), "early chunks", "early chunks, copies ordered by flags"):
        use(name)
        p20, spread = back_to_back(start, world, 20, 5)
        p2, _ = back_to_back(start, world, 2, 5)
        p6, _ = back_to_back(start, world, 6, 5)
        steady = (6 * p6 - 2 * p2) / 4
        for case, sec in (
            (f"20 back to back, per operation, {name}", p20),
            (f"steady state, {name}", steady),
        ):
            rows.append(
                {
                    "case": f"256 MiB send/recv {case}",
                    "bytes": nbytes,
                    "time_ms": sec * 1e3,
                    "GBps": nbytes / sec / 1e9,
                    "of_pinned_copy": nbytes / sec / copy,
                    "spread": spread,
                    "ok": ok,
                }
            )
    for c in comms.values():
        c.close()
    rows.append(naive_p2p(world, x, y, 5))
    rows.append({"case": "pinned device->host copy", "bytes": nbytes, "GBps": copy / 1e9})
    rows.append(
        {"case": "pinned copies both ways at once (each way)", "bytes": nbytes, "GBps": both / 1e9}
    )
    rows.extend(alone(world, host_memory_rates, nbytes))
    if r == 0:
        for row in rows:
            print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
    _save(out, rows, r)


def pingstamp(out: str) -> None:
    """Small staged messages as a ping-pong (half a round trip, median of 7 runs of 100), host
    and device arrays of 8 B and 64 KiB; then three round trips of each stamped step by step
    on both ranks (staged_ops.stamp), to see where a round trip's time goes."""
    from hetcomm.transports.staged import ops as staged_ops

    world = MPI.COMM_WORLD
    r = world.Get_rank()
    stamp = staged_ops.stamp
    comm = hetcomm.init(
        config=hetcomm.Config.load(transport="staged", vendor=("nvidia", "amd")[r % 2])
    )
    rows = []
    for memory in ("host", "device"):
        for size in (8, 64 * 1024, 8):
            lib = np if memory == "host" else cupy
            x, y = lib.ones(size, dtype=np.uint8), lib.zeros(size, dtype=np.uint8)

            def trip(x: Any = x, y: Any = y) -> None:
                if r == 0:
                    stamp("send call")
                    comm.send(x, 1)
                    stamp("send returned")
                    comm.recv(y, 1)
                    stamp("recv returned")
                else:
                    stamp("recv call")
                    comm.recv(y, 0)
                    stamp("recv returned")
                    comm.send(x, 0)
                    stamp("send returned")

            for _ in range(30):
                trip()
            runs = []
            for _ in range(7):
                world.Barrier()
                t0 = time.perf_counter()
                for _ in range(100):
                    trip()
                runs.append(world.allreduce(time.perf_counter() - t0, op=MPI.MAX) / 200)
            world.Barrier()
            stamp.marks = []
            t0 = time.perf_counter()
            for _ in range(3):
                trip()
            marks = world.gather([(t, r, what) for t, what in stamp.marks])
            stamp.marks = None
            if r == 0:
                start = min(m[0] for ms in marks for m in ms)
                merged = sorted(m for ms in marks for m in ms)
                rows.append(
                    {
                        "case": f"staged ping-pong, {memory} arrays",
                        "bytes": size,
                        "half_rtt_us": statistics.median(runs) * 1e6,
                        "min_us": min(runs) * 1e6,
                        "max_us": max(runs) * 1e6,
                        "marks": [
                            (round((t - start) * 1e6, 1), rank, what) for t, rank, what in merged
                        ],
                    }
                )
    comm.close()
    if r == 0:
        for row in rows:
            print(
                row["case"],
                row["bytes"],
                "B: half round trip",
                round(row["half_rtt_us"], 1),
                "us",
                round(row["min_us"], 1),
                "-",
                round(row["max_us"], 1),
            )
            for m in row["marks"]:
                print("   ", m)
    _save(out, rows, r)


def allreduce(out: str) -> None:
    world = MPI.COMM_WORLD
    r, n = world.Get_rank(), world.Get_size()
    rows = []
    count = 64 * MiB  # float32: 256 MiB
    comm = hetcomm.init(
        config=hetcomm.Config.load(transport="staged", vendor=("nvidia", "amd")[r % 2])
    )
    x = cupy.ones(count, dtype=cupy.float32)
    med, spread = median_time(lambda: comm.all_reduce(x), world, 5)
    x[:] = 1
    comm.all_reduce(x)
    ok = bool(world.allreduce(bool((x == n).all()), op=MPI.LAND))
    nbytes = count * 4
    factor = 2 * (n - 1) / n
    rows.append(
        {
            "case": f"staged all_reduce {n} ranks",
            "bytes": nbytes,
            "time_ms": med * 1e3,
            "algbw": nbytes / med / 1e9,
            "busbw": nbytes / med / 1e9 * factor,
            "spread": spread,
            "ok": ok,
        }
    )
    host = np.empty(count, dtype=np.float32)

    def naive() -> None:
        h = cupy.asnumpy(x)
        world.Allreduce(h, host)
        x.set(host)

    med, spread = median_time(naive, world, 5)
    rows.append(
        {
            "case": f"naive all_reduce {n} ranks",
            "bytes": nbytes,
            "time_ms": med * 1e3,
            "algbw": nbytes / med / 1e9,
            "busbw": nbytes / med / 1e9 * factor,
            "spread": spread,
            "ok": True,
        }
    )
    comm.close()
    _save(out, rows, r)


def latency(out: str) -> None:
    """send/recv over staged (shm between two ranks of this host), host arrays beside device
    arrays, in variants interleaved round by round: each op run by a driver thread, copies
    waited for by helper threads on sleeping events (as before); started on the calling
    thread; with events whose wait the CUDA runtime chooses; and short copies waited for by
    the rail thread itself (all three: the default now)."""

    from hetcomm.transports.staged import rails as sr
    from hetcomm.transports.staged import transport as st

    world = MPI.COMM_WORLD
    r = world.Get_rank()
    comm = hetcomm.init(
        config=hetcomm.Config.load(transport="staged", vendor=("nvidia", "amd")[r % 2])
    )
    calling, inline = st.StagedTransport._on_calling_thread, sr.INLINE_COPY_BYTES
    variants = {
        "driver thread, sleeping events, helper threads": (False, True, 0),
        "calling thread, sleeping events, helper threads": (True, True, 0),
        "calling thread, runtime-chosen events, helper threads": (True, False, 0),
        "calling thread, runtime-chosen events, short copies inline": (True, False, inline),
    }
    cases = [
        (size, memory)
        for size in (8, 64 * 1024, 1 * MiB, 16 * MiB)
        for memory in ("host", "device")
    ] + [(256 * MiB, "device")]
    times: dict[tuple[str, int, str], list[float]] = {}
    arrays = {
        (size, memory): (np if memory == "host" else cupy).ones(size, dtype=np.uint8)
        for size, memory in cases
    }
    for _ in range(15):
        for name, (on_calling, _blocking, _inline_bytes) in variants.items():
            st.StagedTransport._on_calling_thread = (
                calling if on_calling else (lambda self, peer: False)
            )
            for size, memory in cases:
                a = arrays[size, memory]

                def once(a: Any = a) -> None:
                    if r == 0:
                        comm.send(a, 1)
                    elif r == 1:
                        comm.recv(a, 0)

                med, _ = median_time(once, world, 5 if size < 256 * MiB else 3)
                times.setdefault((name, size, memory), []).append(med)
    st.StagedTransport._on_calling_thread = calling
    rows = []
    for (name, size, memory), ts in times.items():
        med = statistics.median(ts)
        rows.append(
            {
                "case": f"staged send/recv, {memory} arrays, {name}",
                "bytes": size,
                "time_us": med * 1e6,
                "GBps": size / med / 1e9,
                "spread": (max(ts) - min(ts)) / med,
                "ok": True,
            }
        )
    comm.close()
    _save(out, rows, r)


if __name__ == "__main__":
    from hetcomm.topology import use_local_device

    use_local_device()  # rank r on device r % devices
    if os.environ.get("SWITCH_INTERVAL"):  # the interpreter's switch interval, in seconds
        sys.setswitchinterval(float(os.environ["SWITCH_INTERVAL"]))
    modes = {
        "p2p": p2p,
        "allreduce": allreduce,
        "latency": latency,
        "timeline": timeline,
        "early": early,
        "pingstamp": pingstamp,
    }
    modes[sys.argv[1]](sys.argv[2])
