"""Small copies into and out of the GPU by two processes that share it, taking turns.

mpirun -n 2 python -m mpi4py scripts/probe_small_copies.py OUT.json

A staged ping-pong between two ranks on one GPU alternates their copies: one rank's copy out of
its GPU buffer into a shared slot, then the other's copy from the slot into its buffer. This
times such copies (queued on a non-blocking stream, an event recorded after and waited for),
the two ranks strictly in turn, for sizes from 8 B to 64 KiB and for several ways of queueing a
host->device copy from the slot, so that one can see which of them pay for the GPU switching
between the two processes. Every copied byte is checked.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import cupy
from mpi4py import MPI

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(out: str) -> None:
    from hetcomm.topology import use_local_device
    from hetcomm.transports.shm import SharedSlots

    use_local_device()
    world = MPI.COMM_WORLD
    r = world.Get_rank()
    dev = cupy.cuda.Device().id
    name = f"hetcomm-probe-turns-{os.getpid()}" if r == 0 else None
    name = world.bcast(name)
    if r == 0:
        seg = SharedSlots(name, 1, 1 << 20, create=True)
    world.Barrier()
    if r != 0:
        seg = SharedSlots(name, 1, 1 << 20, create=False)
    world.Barrier()
    if r == 0:
        seg.unlink()
    seg.register_with_gpu(dev)
    d = cupy.zeros(1 << 20, dtype=cupy.uint8)
    stream = cupy.cuda.Stream(non_blocking=True)
    legacy = cupy.cuda.Stream.null
    rows = []
    errors: set[str] = set()
    ways = {
        "host->device (cudaMemcpyHostToDevice)": 1,
        "cudaMemcpyDefault": 4,
        "host->device of 64 KiB, whatever the size": 1,
        "device->device on the mapped host pointer": 3,
    }
    for size in (8, 1024, 4096, 16384, 65536):
        for way, kind in ways.items():
            n = 65536 if way.endswith("whatever the size") else size
            times = []
            # no kernel inside the loop: the other process's GPU work is then its copies only
            pattern = cupy.arange(65536, dtype=cupy.uint8) * 7
            d[:65536] = pattern if r == 0 else 0
            cupy.cuda.Device().synchronize()
            for i in range(160):
                turn = i % 2
                world.Barrier()
                if r != turn:
                    continue
                ready = cupy.cuda.Event(disable_timing=True)
                ready.record(legacy)
                if r == 0:  # out of the GPU into the slot
                    t0 = time.perf_counter()
                    stream.wait_event(ready)
                    cupy.cuda.runtime.memcpyAsync(seg.ptr, d.data.ptr, size, 2, stream.ptr)
                else:  # from the slot into the GPU
                    t0 = time.perf_counter()
                    stream.wait_event(ready)
                    try:
                        cupy.cuda.runtime.memcpyAsync(d.data.ptr, seg.ptr, n, kind, stream.ptr)
                    except cupy.cuda.runtime.CUDARuntimeError as exc:
                        errors.add(f"{way}: {exc}")
                done = cupy.cuda.Event(disable_timing=True)
                done.record(stream)
                done.synchronize()
                times.append(time.perf_counter() - t0)
            ok = r == 0 or (
                not any(e.startswith(way) for e in errors)
                and bool((d[:size] == pattern[:size]).all())
            )
            t = world.gather((times[10:], ok))
            if r == 0:
                out_t, in_t = t[0][0], t[1][0]
                rows.append(
                    {
                        "bytes": size,
                        "way in": way,
                        "out_us": statistics.median(out_t) * 1e6,
                        "in_us": statistics.median(in_t) * 1e6,
                        "ok": t[1][1],
                    }
                )
    seg.close()
    if r == 0:
        for row in rows:
            print(
                f"{row['bytes']:6d} out {row['out_us']:7.1f} us  in {row['in_us']:7.1f} us"
                f"  {row['way in']}  ok={row['ok']}"
            )
    errors_all = world.gather(sorted(errors))
    if r == 0:
        print("errors:", errors_all)
        with open(out, "w") as f:
            json.dump({"rows": rows, "errors": errors_all}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
