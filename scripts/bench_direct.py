"""Device-direct transport on the GPU beside staged and the bare copy bandwidth, in one run.

mpirun -n 2 python -m mpi4py scripts/bench_direct.py p2p OUT.json
mpirun -n 4 python -m mpi4py scripts/bench_direct.py allreduce OUT.json
mpirun -n 2 python -m mpi4py scripts/bench_direct.py profile OUT.json   (where the time goes)

Ranks share the GPU. The copy bandwidth is that of a device-to-device cudaMemcpy of 256 MiB
(bytes copied per second; a copy reads and writes each byte, so memory traffic is twice that).
The all-reduce floor is the memory traffic the operation cannot avoid: every rank's input read
once and its output written once (2 x size bytes per rank), summed over the ranks, since they
share one GPU's memory, at the copy's traffic rate (twice the copy rate: a copy reads and writes).
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


def median_time(fn, comm: MPI.Intracomm, repeats: int) -> tuple[float, float]:
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


def copy_rate(nbytes: int) -> float:
    """Device-to-device copy: bytes copied per second (median of 9, events)."""
    a = cupy.ones(nbytes, dtype=cupy.uint8)
    b = cupy.empty_like(a)
    times = []
    for _ in range(10):
        s, e = cupy.cuda.Event(), cupy.cuda.Event()
        s.record()
        cupy.cuda.runtime.memcpyAsync(b.data.ptr, a.data.ptr, nbytes, 3,
                                      cupy.cuda.get_current_stream().ptr)
        e.record()
        e.synchronize()
        times.append(cupy.cuda.get_elapsed_time(s, e) / 1e3)
    return nbytes / statistics.median(times[1:])


def kernel_copy_rate(nbytes: int) -> float:
    """The same copy by hetcomm's 16-byte copy kernel (what direct uses between peers)."""
    from hetcomm.kernels.device import kernel

    a = cupy.ones(nbytes, dtype=cupy.uint8)
    b = cupy.empty_like(a)
    words = nbytes // 16
    args = (cupy.uint64(b.data.ptr), cupy.uint64(a.data.ptr), cupy.uint64(words))
    times = []
    for _ in range(10):
        s, e = cupy.cuda.Event(), cupy.cuda.Event()
        s.record()
        kernel("copy16")((2048,), (512,), args)
        e.record()
        e.synchronize()
        times.append(cupy.cuda.get_elapsed_time(s, e) / 1e3)
    return nbytes / statistics.median(times[1:])


def _comm(transport: str, r: int) -> hetcomm.Communicator:
    return hetcomm.init(config=hetcomm.Config.load(transport=transport,
                                                   vendor=("nvidia", "amd")[r % 2]))


def p2p(out: str) -> None:
    world = MPI.COMM_WORLD
    r = world.Get_rank()
    rows = []
    rate = copy_rate(256 * MiB)
    rows.append({"case": "device-to-device copy", "bytes": 256 * MiB, "GBps": rate / 1e9})
    rows.append({"case": "copy16 kernel", "bytes": 256 * MiB,
                 "GBps": kernel_copy_rate(256 * MiB) / 1e9})
    for transport in ("direct", "staged"):
        comm = _comm(transport, r)
        for size in (8, 64 * 1024, 1 * MiB, 16 * MiB, 256 * MiB):
            x = cupy.arange(size, dtype=cupy.uint8)
            y = cupy.zeros(size, dtype=cupy.uint8)

            def once(comm: hetcomm.Communicator = comm, x=x, y=y) -> None:
                if r == 0:
                    comm.send(x, 1)
                elif r == 1:
                    comm.recv(y, 0)

            med, spread = median_time(once, world, 25 if size <= MiB else 9)
            ok = r != 1 or bool((y == x).all())
            rows.append({"case": f"{transport} send/recv", "bytes": size, "time_us": med * 1e6,
                         "GBps": size / med / 1e9, "spread": round(spread, 3),
                         "ok": bool(world.allreduce(ok, op=MPI.LAND))})  # fmt: skip
        comm.close()
    _save(out, rows, r)


def allreduce(out: str) -> None:
    world = MPI.COMM_WORLD
    r, n = world.Get_rank(), world.Get_size()
    rows = []
    rate = copy_rate(256 * MiB)
    rows.append({"case": "device-to-device copy", "bytes": 256 * MiB, "GBps": rate / 1e9})
    factor = 2 * (n - 1) / n
    sizes = [1 << k for k in range(10, 31, 2)]  # 1 KiB .. 1 GiB
    for transport in ("direct", "staged"):
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
            row = {"case": f"{transport} all_reduce", "ranks": n, "bytes": nbytes,
                   "time_us": med * 1e6, "algbw": nbytes / med / 1e9,
                   "busbw": nbytes / med / 1e9 * factor, "spread": round(spread, 3), "ok": ok}
            if transport == "direct" and nbytes >= 64 * MiB:
                floor = n * 2 * nbytes / (2 * rate)  # each input read once, each output written once
                row["floor_us"] = floor * 1e6
                row["x_floor"] = med / floor
            rows.append(row)
            if transport == "direct" and nbytes == 256 * MiB:
                # the same with every rank reducing its own shard (ranks on separate GPUs)
                t = comm._transports["direct"]
                t.shared, shared = False, t.shared
                med2, spread2 = median_time(lambda comm=comm, x=x: comm.all_reduce(x), world, reps)
                t.shared = shared
                rows.append({**row, "case": "direct all_reduce (two-shot, no leader)",
                             "time_us": med2 * 1e6, "algbw": nbytes / med2 / 1e9,
                             "busbw": nbytes / med2 / 1e9 * factor, "spread": round(spread2, 3),
                             "x_floor": med2 / floor})  # fmt: skip
            del x
        if transport == "direct":
            t = comm._transports.get("direct")
            rows.append({"case": "direct registration cache", **(t.stats() if t else {})})
        comm.close()
    _save(out, rows, r)


def profile(out: str) -> None:
    """Where the time of one direct operation goes: the proxy's waits, each stamped."""
    from hetcomm.transports import direct

    world = MPI.COMM_WORLD
    r = world.Get_rank()
    comm = _comm("direct", r)
    rows = []
    for case, size in (("send/recv", 8), ("send/recv", 256 * MiB), ("all_reduce", 1024),
                       ("all_reduce", 256 * MiB)):  # fmt: skip
        x = cupy.ones(max(size // 4, 2), dtype=cupy.float32)
        y = cupy.empty_like(x)
        for i in range(6):
            direct.PROFILE = [] if i == 5 else None
            world.Barrier()
            t0 = time.perf_counter()
            if case == "all_reduce":
                comm.all_reduce(x)
            elif r == 0:
                comm.send(x, 1)
            elif r == 1:
                comm.recv(y, 0)
            t1 = time.perf_counter()
        marks = [(round((t - t0) * 1e6, 1), what) for t, what in direct.PROFILE or []]
        rows.append({"case": f"{case} {size} B", "rank": r, "total_us": round((t1 - t0) * 1e6, 1),
                     "marks_us": marks})
        direct.PROFILE = None
    every = world.gather(rows, root=0)
    comm.close()
    if r == 0:
        flat = [row for rank_rows in every for row in rank_rows]
        _save(out, sorted(flat, key=lambda row: (row["case"], row["rank"])), 0)


def _save(out: str, rows: list[dict], rank: int) -> None:
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
        for row in rows:
            print(row, flush=True)


if __name__ == "__main__":
    {"p2p": p2p, "allreduce": allreduce, "profile": profile}[sys.argv[1]](sys.argv[2])
