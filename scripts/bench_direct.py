"""Device-direct transport on the GPU beside staged and the bare copy bandwidth, in one run.

mpirun -n 2 python -m mpi4py scripts/bench_direct.py p2p OUT.json
mpirun -n 4 python -m mpi4py scripts/bench_direct.py allreduce OUT.json
mpirun -n 2 python -m mpi4py scripts/bench_direct.py profile OUT.json   (where the time goes)
mpirun -n 2 python -m mpi4py scripts/bench_direct.py pieces OUT.json   (a send/recv's pieces)
mpirun -n 2 python -m mpi4py scripts/bench_direct.py latency OUT.json   (direct vs staged, rounds)
python scripts/bench_direct.py calls OUT.json   (the calling thread's costs, one rank)

Two timings per case: one operation at a time (barrier, the call, synchronize; the slowest
rank's time), and back to back as nccl-tests times (K operations issued with async_op=True,
then all waited for; the time per operation), where one operation's fixed costs overlap the
data movement of the others. The steady state is the time each further operation adds: from
back-to-back runs of K1 and K2 operations, (T(K2) - T(K1)) / (K2 - K1), which leaves out the
latency of the first operation and the wait for the last.

Rank r runs on device r % devices (hetcomm.topology.use_local_device). Where ranks share a GPU,
the copy bandwidth is that of a device-to-device cudaMemcpy of 256 MiB
(bytes copied per second; a copy reads and writes each byte, so memory traffic is twice that).
The all-reduce floor is the memory traffic the operation cannot avoid: every rank's input read
once and its output written once (2 x size bytes per rank), summed over the ranks, since they
share one GPU's memory, at the copy's traffic rate (twice the copy rate: a copy reads and writes).
Where every rank has a GPU of its own, the yardsticks are the copy through the IPC mapping (GPU to
GPU over their link) and NCCL on the same ranks.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import cupy
from mpi4py import MPI

import hetcomm

MiB = 1 << 20


def median_time(fn, comm: MPI.Intracomm, repeats: int = 7) -> tuple[float, float]:
    """Median seconds of `fn` (slowest rank each time) over repeats, and the relative spread."""
    fn()
    fn()
    times = []
    for _ in range(repeats):
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        cupy.cuda.Device().synchronize()
        times.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    med = statistics.median(times)
    return med, (max(times) - min(times)) / med


def gpu_seconds(fn, runs: int = 10) -> float:
    """Median seconds of the GPU work `fn` queues on the current stream, timed with events;
    the first run is a warm-up and is left out."""
    times = []
    for _ in range(runs):
        s, e = cupy.cuda.Event(), cupy.cuda.Event()
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(cupy.cuda.get_elapsed_time(s, e) / 1e3)
    return statistics.median(times[1:])


def memcpy(dst: int, src: int, nbytes: int, kind: int = 3) -> None:
    """cudaMemcpyAsync on the current stream (kind 3: device to device)."""
    cupy.cuda.runtime.memcpyAsync(dst, src, nbytes, kind, cupy.cuda.get_current_stream().ptr)


def copy16(dst: int, src: int, nbytes: int) -> None:
    """hetcomm's 16-byte copy kernel on the current stream."""
    from hetcomm.kernels.device import kernel

    kernel("copy16")(
        (2048,), (512,), (cupy.uint64(dst), cupy.uint64(src), cupy.uint64(nbytes // 16))
    )


def alone(world: MPI.Intracomm, fn, *args):
    """fn(*args) on rank 0 while the other ranks wait at a barrier, its result given to all:
    a yardstick copy timed while other ranks copy on the same GPU or link would be slowed."""
    world.Barrier()
    value = fn(*args) if world.Get_rank() == 0 else None
    world.Barrier()
    return world.bcast(value, root=0)


def copy_rate(nbytes: int) -> float:
    """Device-to-device copy: bytes copied per second (median of 9, events)."""
    a = cupy.ones(nbytes, dtype=cupy.uint8)
    b = cupy.empty_like(a)
    return nbytes / gpu_seconds(lambda: memcpy(b.data.ptr, a.data.ptr, nbytes))


def kernel_copy_rate(nbytes: int) -> float:
    """The same copy by hetcomm's 16-byte copy kernel."""
    a = cupy.ones(nbytes, dtype=cupy.uint8)
    b = cupy.empty_like(a)
    return nbytes / gpu_seconds(lambda: copy16(b.data.ptr, a.data.ptr, nbytes))


def ipc_copy_rates(world: MPI.Intracomm, nbytes: int) -> dict[str, float]:
    """Rank 1 copies rank 0's buffer through a CUDA IPC mapping: bytes per second by
    cudaMemcpyAsync and by the copy16 kernel (median of 9, events)."""
    r = world.Get_rank()
    a = cupy.ones(nbytes, dtype=cupy.uint8)
    handle = world.bcast(cupy.cuda.runtime.ipcGetMemHandle(a.data.ptr) if r == 0 else None)
    rates = {}
    if r == 1:
        src = cupy.cuda.runtime.ipcOpenMemHandle(handle)
        b = cupy.empty_like(a)
        for name, copy in (("memcpy", memcpy), ("kernel", copy16)):
            rates[name] = nbytes / gpu_seconds(lambda copy=copy: copy(b.data.ptr, src, nbytes))
        cupy.cuda.runtime.ipcCloseMemHandle(src)
    world.Barrier()
    return world.bcast(rates, root=1)


def back_to_back(start, comm: MPI.Intracomm, k: int, repeats: int) -> tuple[float, float]:
    """Seconds per operation with `k` operations in flight: `start()` issues one and returns
    its Work (or None on ranks without a part); all are waited for at the end."""

    def run() -> None:
        works = [start() for _ in range(k)]
        for w in works:
            if w is not None:
                w.wait()

    med, spread = median_time(run, comm, repeats)
    return med / k, spread


def own_gpus(world: MPI.Intracomm) -> bool:
    """Whether every rank has a device of its own (NCCL can join them)."""
    return world.Get_size() <= cupy.cuda.runtime.getDeviceCount()


def _comm(transport: str, r: int) -> hetcomm.Communicator:
    """Ranks of simulated vendors, except for nccl (one vendor's library)."""
    vendor = None if transport == "nccl" else ("nvidia", "amd")[r % 2]
    return hetcomm.init(config=hetcomm.Config.load(transport=transport, vendor=vendor))


def p2p(out: str) -> None:

    world = MPI.COMM_WORLD
    r = world.Get_rank()
    rows = []
    rate = alone(world, copy_rate, 256 * MiB)
    rows.append({"case": "device-to-device copy", "bytes": 256 * MiB, "GBps": rate / 1e9})
    rows.append(
        {
            "case": "copy16 kernel",
            "bytes": 256 * MiB,
            "GBps": alone(world, kernel_copy_rate, 256 * MiB) / 1e9,
        }
    )
    for how, ipc_rate in ipc_copy_rates(world, 256 * MiB).items():
        rows.append(
            {
                "case": f"copy through the IPC mapping ({how})",
                "bytes": 256 * MiB,
                "GBps": ipc_rate / 1e9,
            }
        )
    # the caller's arrays on the default stream, or on a stream of its own (then an operation
    # queued while the stream is idle waits for no event of it)
    own = cupy.cuda.Stream(non_blocking=True)
    cases = [
        ("direct", "kernel", None),
        ("direct", "memcpy", None),
        ("direct", "memcpy", own),
        ("staged", "", None),
    ]
    if own_gpus(world):
        cases.append(("nccl", "", None))
    for transport, how, stream in cases:
        comm = _comm(transport, r)
        name = f"{transport} ({how} copy{', own stream' if stream else ''})" if how else transport
        if stream is not None:
            stream.use()
        for size in (8, 64 * 1024, 1 * MiB, 16 * MiB, 256 * MiB):
            x = cupy.arange(size, dtype=cupy.uint8)
            y = cupy.zeros(size, dtype=cupy.uint8)

            def start(comm: hetcomm.Communicator = comm, x=x, y=y, async_op: bool = False):
                if r == 0:
                    return comm.send(x, 1, async_op=async_op)
                if r == 1:
                    return comm.recv(y, 0, async_op=async_op)
                return None

            med, spread = median_time(start, world, 25 if size <= MiB else 9)
            ok = r != 1 or bool((y == x).all())
            rows.append(
                {
                    "case": f"{name} send/recv",
                    "bytes": size,
                    "time_us": med * 1e6,
                    "GBps": size / med / 1e9,
                    "spread": round(spread, 3),
                    "ok": bool(world.allreduce(ok, op=MPI.LAND)),
                }
            )
            if size >= 64 * 1024:
                y[:] = 0
                few, many = (2, 6) if transport == "staged" and size > 16 * MiB else (8, 32)
                if transport == "nccl" and size > 16 * MiB:
                    few, many = (4, 12)
                reps = 9 if size <= 16 * MiB else 5

                def go(start=start):
                    return start(async_op=True)

                p1, _ = back_to_back(go, world, few, reps)
                per, spread = back_to_back(go, world, many, reps)
                ok = r != 1 or bool((y == x).all())
                steady = (many * per - few * p1) / (many - few)
                rows.append(
                    {
                        "case": f"{name} send/recv, {many} back to back",
                        "bytes": size,
                        "time_us": per * 1e6,
                        "GBps": size / per / 1e9,
                        "steady_us": steady * 1e6,
                        "steady_GBps": size / steady / 1e9,
                        "spread": round(spread, 3),
                        "ok": bool(world.allreduce(ok, op=MPI.LAND)),
                    }
                )
        cupy.cuda.Stream.null.use()
        comm.close()
    _save(out, rows, r)


def allreduce(out: str) -> None:
    world = MPI.COMM_WORLD
    r, n = world.Get_rank(), world.Get_size()
    rows = []
    rate = alone(world, copy_rate, 256 * MiB)
    rows.append({"case": "device-to-device copy", "bytes": 256 * MiB, "GBps": rate / 1e9})
    factor = 2 * (n - 1) / n
    sizes = [1 << k for k in range(10, 31, 2)]  # 1 KiB .. 1 GiB
    separate = own_gpus(world)
    if separate:
        for how, ipc_rate in ipc_copy_rates(world, 256 * MiB).items():
            rows.append(
                {
                    "case": f"copy through the IPC mapping ({how})",
                    "bytes": 256 * MiB,
                    "GBps": ipc_rate / 1e9,
                }
            )
    for transport in ("direct", "staged") + (("nccl",) if separate else ()):
        comm = _comm(transport, r)
        for nbytes in sizes:
            if transport == "staged" and nbytes > 256 * MiB:
                continue
            x = cupy.ones(nbytes // 4, dtype=cupy.float32)
            reps = 21 if nbytes <= MiB else (7 if nbytes <= 64 * MiB else 5)
            med, spread = median_time(lambda comm=comm, x=x: comm.all_reduce(x), world, reps)
            x[:] = 1
            comm.all_reduce(x)
            ok = bool(world.allreduce(bool((x == n).all()), op=MPI.LAND))
            row = {
                "case": f"{transport} all_reduce",
                "ranks": n,
                "bytes": nbytes,
                "time_us": med * 1e6,
                "algbw": nbytes / med / 1e9,
                "busbw": nbytes / med / 1e9 * factor,
                "spread": round(spread, 3),
                "ok": ok,
            }
            if transport == "direct" and nbytes >= 64 * MiB and not separate:
                floor = (
                    n * 2 * nbytes / (2 * rate)
                )  # each input read once, each output written once
                row["floor_us"] = floor * 1e6
                row["x_floor"] = med / floor
            rows.append(row)
            if transport == "direct" and nbytes >= 256 * MiB and not separate:

                def go(comm=comm, x=x):
                    return comm.all_reduce(x, async_op=True)

                p1, _ = back_to_back(go, world, 2, reps)
                per, spread3 = back_to_back(go, world, 8, reps)
                steady = (8 * per - 2 * p1) / 6
                rows.append(
                    {
                        **row,
                        "case": "direct all_reduce, 8 back to back",
                        "time_us": per * 1e6,
                        "algbw": nbytes / per / 1e9,
                        "busbw": nbytes / per / 1e9 * factor,
                        "spread": round(spread3, 3),
                        "x_floor": per / floor,
                        "steady_us": steady * 1e6,
                        "steady_x_floor": steady / floor,
                    }
                )
            if transport == "direct" and nbytes == 256 * MiB and not separate:
                # the same with every rank reducing its own shard (ranks on separate GPUs)
                t = comm._transports["direct"]
                t.shared, shared = False, t.shared
                med2, spread2 = median_time(lambda comm=comm, x=x: comm.all_reduce(x), world, reps)
                t.shared = shared
                rows.append(
                    {
                        **row,
                        "case": "direct all_reduce (two-shot, no leader)",
                        "time_us": med2 * 1e6,
                        "algbw": nbytes / med2 / 1e9,
                        "busbw": nbytes / med2 / 1e9 * factor,
                        "spread": round(spread2, 3),
                        "x_floor": med2 / floor,
                    }
                )
            del x
        if transport == "direct":
            t = comm._transports.get("direct")
            rows.append({"case": "direct registration cache", **(t.stats() if t else {})})
        comm.close()
    _save(out, rows, r)


def profile(out: str) -> None:
    """Where the time of one direct operation goes: the proxy's waits, each stamped."""
    from hetcomm.transports.direct import proxy as direct_proxy

    world = MPI.COMM_WORLD
    r = world.Get_rank()
    comm = _comm("direct", r)
    rows = []
    for case, size in (
        ("send/recv", 8),
        ("send/recv", 64 * 1024),
        ("send/recv", 256 * MiB),
        ("all_reduce", 1024),
        ("all_reduce", 256 * MiB),
    ):
        x = cupy.ones(max(size // 4, 2), dtype=cupy.float32)
        y = cupy.empty_like(x)
        for i in range(8):  # the last three are profiled
            direct_proxy.stamp.marks = [] if i >= 5 else None
            world.Barrier()
            t0 = time.perf_counter()
            if case == "all_reduce":
                comm.all_reduce(x)
            elif r == 0:
                comm.send(x, 1)
            elif r == 1:
                comm.recv(y, 0)
            t1 = time.perf_counter()
            if direct_proxy.stamp.marks is None:
                continue
            marks = [(round((t - t0) * 1e6, 1), what) for t, what in direct_proxy.stamp.marks]
            rows.append(
                {
                    "case": f"{case} {size} B",
                    "rank": r,
                    "total_us": round((t1 - t0) * 1e6, 1),
                    "marks_us": marks,
                }
            )
        direct_proxy.stamp.marks = None
    every = world.gather(rows, root=0)
    comm.close()
    if r == 0:
        flat = [row for rank_rows in every for row in rank_rows]
        _save(out, sorted(flat, key=lambda row: (row["case"], row["rank"])), 0)


def pieces(out: str) -> None:
    """The pieces a 64 KiB send/recv between two ranks is made of, each timed alone (medians
    of 5 rounds): a message each way between the ranks' Python threads, an event recorded on a
    stream and waited for, a copy through the IPC mapping and its wait, and hetcomm's send/recv
    as a ping-pong (half a round trip, as osu_latency), direct and staged."""
    world = MPI.COMM_WORLD
    r = world.Get_rank()
    svc = world.Dup()
    peer = 1 - r
    rows = []
    nbytes = 64 * 1024
    small = bytearray(8)

    def rounds(fn, n: int) -> float:
        times = []
        for _ in range(5):
            world.Barrier()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            times.append(world.allreduce(time.perf_counter() - t0, op=MPI.MAX) / n)
        return statistics.median(times)

    def spin(req) -> None:
        while not req.Test():
            pass

    def ping() -> None:  # a round trip of 8 bytes through Isend/Irecv and Test, as the proxy
        if r == 0:
            spin(svc.Isend(small, 1, 7))
            spin(svc.Irecv(small, 1, 8))
        else:
            spin(svc.Irecv(small, 0, 7))
            spin(svc.Isend(small, 0, 8))

    rows.append(
        {"case": "MPI message between Python threads, one way", "us": rounds(ping, 2000) / 2 * 1e6}
    )
    null, own = cupy.cuda.Stream.null, cupy.cuda.Stream(non_blocking=True)
    for name, stream in (("default stream", null), ("own stream", own)):

        def record(stream=stream) -> None:
            e = cupy.cuda.Event(disable_timing=True)
            e.record(stream)
            e.synchronize()

        rows.append(
            {
                "case": f"event recorded on the {name} and waited for",
                "us": rounds(record, 2000) * 1e6,
            }
        )
    rows.append(
        {
            "case": "Device().synchronize()",
            "us": rounds(lambda: cupy.cuda.Device().synchronize(), 2000) * 1e6,
        }
    )
    a = cupy.ones(nbytes, dtype=cupy.uint8)
    handle = svc.sendrecv(cupy.cuda.runtime.ipcGetMemHandle(a.data.ptr), peer, 0, None, peer, 0)
    src = cupy.cuda.runtime.ipcOpenMemHandle(handle)
    b = cupy.empty_like(a)

    def copy() -> None:
        with own:
            memcpy(b.data.ptr, src, nbytes)
        e = cupy.cuda.Event(disable_timing=True)
        e.record(own)
        e.synchronize()

    rows.append(
        {
            "case": "64 KiB copy through the IPC mapping, queued and waited for, both "
            "ranks at once",
            "us": rounds(copy, 1000) * 1e6,
        }
    )
    rows.append(
        {"case": "the same, one rank", "us": rounds(copy if r else (lambda: None), 1000) * 1e6}
    )

    def turns(both: bool) -> None:
        # a ping-pong of 64 KiB copies: each rank copies in its turn (both), or rank 0 copies
        # in both directions (through the mapping into rank 1's memory, and back)
        if r == 0:
            copy()
            spin(svc.Isend(small, 1, 7))
            spin(svc.Irecv(small, 1, 8))
            if not both:
                copy()
        else:
            spin(svc.Irecv(small, 0, 7))
            if both:
                copy()
            spin(svc.Isend(small, 0, 8))

    rows.append(
        {
            "case": "64 KiB copies, the ranks' processes in turn (a message between), per copy",
            "us": rounds(lambda: turns(True), 500) / 2 * 1e6,
        }
    )
    rows.append(
        {
            "case": "64 KiB copies, all by rank 0's process, per copy",
            "us": rounds(lambda: turns(False), 500) / 2 * 1e6,
        }
    )

    def launches(n: int = 500) -> None:  # queueing copies from the mapping, one wait at the end
        for _ in range(n):
            cupy.cuda.runtime.memcpyAsync(b.data.ptr, src, nbytes, 3, own.ptr)
        own.synchronize()

    rows.append(
        {
            "case": "queueing a 64 KiB copy from the IPC mapping (cudaMemcpyAsync), one rank",
            "us": rounds(launches if r else (lambda: None), 1) / 500 * 1e6,
        }
    )
    mark = cupy.cuda.Event(disable_timing=True)
    mark.record(null)
    rows.append(
        {
            "case": "a stream waiting for an event of the default stream (streamWaitEvent)",
            "us": rounds(lambda: own.wait_event(mark), 2000) * 1e6,
        }
    )
    own.synchronize()
    world.Barrier()
    cupy.cuda.runtime.ipcCloseMemHandle(src)
    for transport in ("direct", "staged"):
        comm = _comm(transport, r)
        for size in (8, nbytes):
            x = cupy.arange(size, dtype=cupy.uint8)
            y = cupy.zeros(size, dtype=cupy.uint8)

            def pingpong(comm=comm, x=x, y=y) -> None:
                _pingpong(comm, r, x, y)

            for _ in range(20):
                pingpong()

            def one(comm=comm, x=x, y=y) -> None:
                if r == 0:
                    comm.send(x, 1)
                else:
                    comm.recv(y, 0)

            med, spread = median_time(one, world, 41)
            rows.append(
                {
                    "case": f"{transport} send/recv, one at a time",
                    "bytes": size,
                    "us": med * 1e6,
                    "spread": round(spread, 3),
                }
            )
            if transport == "direct" and size == nbytes:
                rows.extend(_profiled(pingpong, world))
            rows.append(
                {
                    "case": f"{transport} send/recv ping-pong, half a round trip",
                    "bytes": size,
                    "us": rounds(pingpong, 200) / 2 * 1e6,
                    "ok": bool(world.allreduce(bool((y == x).all()), op=MPI.LAND)),
                }
            )
        comm.close()
    svc.Free()
    _save(out, rows, r)


def _pingpong(comm: hetcomm.Communicator, r: int, x, y) -> None:
    """One round trip: rank 0 sends `x` and receives into `y`, rank 1 sends back what it got."""
    if r == 0:
        comm.send(x, 1)
        comm.recv(y, 1)
    else:
        comm.recv(y, 0)
        comm.send(y, 0)


def latency(out: str) -> None:
    """Small send/recv latency, direct beside staged, in rounds (each round runs every case once,
    so that a ratio compares runs of the same minute): a ping-pong (half a round trip, as
    osu_latency reports) and one message at a time (a barrier before each), with the arrays on
    the default stream and on a stream of each rank's own; the per-round ratio staged / direct."""

    world = MPI.COMM_WORLD
    r = world.Get_rank()
    made = {t: _comm(t, r) for t in ("direct", "staged")}
    # name -> (communicator, whether a blocking call leaves the idle proxy asleep)
    comms = {
        "direct": (made["direct"], True),
        "direct, proxy woken by every call": (made["direct"], False),
        "staged": (made["staged"], True),
    }
    own = cupy.cuda.Stream(non_blocking=True)
    null = cupy.cuda.Stream.null
    cases = [
        (size, name, stream)
        for size in (8, 64 * 1024)
        for name, stream in (("default stream", null), ("own stream", own))
    ]
    arrays = {
        size: (cupy.arange(size, dtype=cupy.uint8), cupy.zeros(size, dtype=cupy.uint8))
        for size in (8, 64 * 1024)
    }
    times: dict[tuple, list[float]] = {}
    oks = []

    def timed(fn, n: int) -> float:
        world.Barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return world.allreduce(time.perf_counter() - t0, op=MPI.MAX) / n

    for _ in range(7):
        for size, name, stream in cases:
            x, y = arrays[size]
            for transport, (comm, _lazy) in comms.items():
                with stream:

                    def pingpong(comm=comm, x=x, y=y) -> None:
                        _pingpong(comm, r, x, y)

                    def one(comm=comm, x=x, y=y, stream=stream) -> None:
                        world.Barrier()
                        if r == 0:
                            comm.send(x, 1)
                        else:
                            comm.recv(y, 0)
                        stream.synchronize()

                    for _ in range(10):
                        pingpong()
                    y.fill(0)
                    key = (transport, size, name)
                    times.setdefault((*key, "ping-pong"), []).append(timed(pingpong, 100) / 2)
                    stream.synchronize()
                    oks.append(bool((y == x).all()))
                    times.setdefault((*key, "one at a time"), []).append(timed(one, 50))
    ok = bool(world.allreduce(all(oks), op=MPI.LAND))
    rows = []
    for (transport, size, name, how), ts in times.items():
        row = {
            "case": f"{transport} send/recv, {how}, {name}",
            "bytes": size,
            "us": statistics.median(ts) * 1e6,
            "min_us": min(ts) * 1e6,
            "max_us": max(ts) * 1e6,
            "ok": ok,
        }
        if transport != "staged":
            ratios = [s / d for s, d in zip(times[("staged", size, name, how)], ts)]
            row["staged_over_direct_per_round"] = [round(q, 2) for q in ratios]
            row["staged_over_direct_median"] = statistics.median(ratios)
        rows.append(row)
        if r == 0:
            print({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()})
    for comm in made.values():
        comm.close()
    _save(out, rows, r)


def _profiled(fn, world: MPI.Intracomm, n: int = 300) -> list[dict]:
    """cProfile of `n` calls of `fn` on every rank (the calling thread only), the functions
    that took most time of their own first; one row per rank."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    world.Barrier()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    texts = world.gather(text.getvalue(), root=0) or []
    return [
        {"case": f"cProfile of {n} ping-pongs, rank {i}", "text": t} for i, t in enumerate(texts)
    ]


def calls(out: str) -> None:
    """What the calling thread spends per operation: the pieces it is made of, each timed alone
    (median of 5 rounds of 2000), and a cProfile of blocking all_reduces on a one-rank group."""
    import cProfile
    import io
    import pstats

    from hetcomm.kernels import device as kd

    from hetcomm.arrays import as_buffer

    comm = hetcomm.init(MPI.COMM_SELF, config=hetcomm.Config.load(transport="direct"))
    x = cupy.ones(256, dtype=cupy.float32)
    buf = as_buffer(x)
    stream = kd.external_stream(kd.current_stream(buf), buf.device_index)
    dev = cupy.cuda.Device(buf.device_index)

    def event() -> None:
        with dev:
            cupy.cuda.Event(disable_timing=True).record(stream)

    def device() -> None:
        with dev:
            pass

    pieces = {
        "as_buffer(cupy array)": lambda: as_buffer(x),
        "__cuda_array_interface__": lambda: x.__cuda_array_interface__,
        "current_stream + external_stream": lambda: kd.external_stream(
            kd.current_stream(buf), buf.device_index
        ),
        "stream.done": lambda: stream.done,
        "with Device(d)": device,
        "Event() + record": event,
        "comm._transport (route lookup)": lambda: comm._transport("all_reduce", buf),
        "all_reduce, 1 rank, blocking": lambda: comm.all_reduce(x),
        "all_reduce, 1 rank, async + wait": lambda: comm.all_reduce(x, async_op=True).wait(),
    }
    rows = []
    for name, fn in pieces.items():
        rounds = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(2000):
                fn()
            rounds.append((time.perf_counter() - t0) / 2000)
        rows.append({"case": name, "us": statistics.median(rounds) * 1e6})
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(2000):
        comm.all_reduce(x)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    rows.append({"case": "cProfile, 2000 blocking all_reduces", "text": text.getvalue()})
    comm.close()
    _save(out, rows, 0)


def _save(out: str, rows: list[dict], rank: int) -> None:
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
        for row in rows:
            print(row, flush=True)


if __name__ == "__main__":
    from hetcomm.topology import use_local_device

    use_local_device()
    {
        "p2p": p2p,
        "allreduce": allreduce,
        "profile": profile,
        "pieces": pieces,
        "calls": calls,
        "latency": latency,
    }[sys.argv[1]](sys.argv[2])
