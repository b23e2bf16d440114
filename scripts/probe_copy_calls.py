"""How long queueing one copy between the GPU and host memory keeps the calling thread.

mpirun -n 2 python -m mpi4py scripts/probe_copy_calls.py OUT.json

The staged pipeline queues every chunk's copy with cudaMemcpyAsync and goes on; the call itself
should take microseconds. This times the call alone (the CPU time until it returns, not the
copy), median and 90th percentile of 40, for:
- host memory pinned by cudaMallocHost, and a /dev/shm segment registered with the GPU (the
  shm rail's slots);
- device->host and host->device, 64 KiB, 1 MiB and 8 MiB;
- the thread alone, or while another thread of the process waits on an event of a long copy
  (as the staged signaller and completer threads do), that event made spinning (the default
  scheduling) or blocking (cudaEventBlockingSync);
- the other rank idle, or queueing copies of its own on the same GPU meanwhile.
Rank 0 measures; rank 1 is the other process.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time

import cupy
from mpi4py import MPI

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

MiB = 1 << 20
SIZES = (64 << 10, 1 * MiB, 8 * MiB)
CALLS = 40


class Waiter:
    """A thread that keeps waiting on the events of long device copies (as the signaller does)."""

    def __init__(self, blocking: bool) -> None:
        self.blocking, self.stop = blocking, False
        self.a = cupy.empty(256 * MiB, dtype=cupy.uint8)
        self.b = cupy.empty_like(self.a)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        stream = cupy.cuda.Stream(non_blocking=True)
        while not self.stop:
            for _ in range(8):  # about 1 ms of copying, then one wait for all of it
                cupy.cuda.runtime.memcpyAsync(
                    self.b.data.ptr, self.a.data.ptr, self.a.nbytes, 3, stream.ptr
                )
            event = cupy.cuda.Event(block=self.blocking, disable_timing=True)
            event.record(stream)
            event.synchronize()

    def close(self) -> None:
        self.stop = True
        self.thread.join()


def call_times(dst: int, src: int, n: int, kind: int, stream) -> tuple[float, float]:
    """Median and 90th percentile of the time one memcpyAsync call takes (us)."""
    times = []
    for _ in range(CALLS):
        t0 = time.perf_counter()
        cupy.cuda.runtime.memcpyAsync(dst, src, n, kind, stream.ptr)
        times.append(time.perf_counter() - t0)
        stream.synchronize()
    times.sort()
    return statistics.median(times) * 1e6, times[int(0.9 * len(times))] * 1e6


def queued_times(dst: int, src: int, n: int, kind: int, stream, ready: bool) -> list[float]:
    """The time each of 8 memcpyAsync calls takes (us) when they are queued back to back on one
    stream (each after an event of the default stream where `ready`), as the staged pipeline
    queues its chunks; then one wait for all."""
    times = []
    for _ in range(8):
        if ready:
            event = cupy.cuda.Event(disable_timing=True)
            event.record(cupy.cuda.Stream.null)
            stream.wait_event(event)
        t0 = time.perf_counter()
        cupy.cuda.runtime.memcpyAsync(dst, src, n, kind, stream.ptr)
        times.append((time.perf_counter() - t0) * 1e6)
    stream.synchronize()
    return times


def main(out: str) -> None:
    from hetcomm.topology import use_local_device
    from hetcomm.transports.shm import SharedSlots

    use_local_device()
    world = MPI.COMM_WORLD
    r = world.Get_rank()
    dev = cupy.cuda.Device().id
    seg = SharedSlots(f"hetcomm-probe-calls-{os.getpid()}", 1, 8 * MiB, create=True)
    seg.unlink()
    seg.register_with_gpu(dev)
    pinned = cupy.cuda.alloc_pinned_memory(8 * MiB)
    d = cupy.ones(8 * MiB, dtype=cupy.uint8)
    stream = cupy.cuda.Stream(non_blocking=True)
    rows = []
    for peer_busy in (False, True):
        for waiter_kind in ("none", "spinning", "blocking"):
            world.Barrier()
            waiter = None if waiter_kind == "none" else Waiter(waiter_kind == "blocking")
            if r == 1:
                flag = world.irecv(source=0, tag=7)
                while not flag.test()[0]:
                    if peer_busy:
                        for n in SIZES:
                            call_times(seg.ptr, d.data.ptr, n, 2, stream)
                            call_times(d.data.ptr, seg.ptr, n, 1, stream)
                    else:
                        time.sleep(1e-3)
            else:
                time.sleep(0.05)
                for mem, ptr in (("pinned", pinned.ptr), ("/dev/shm segment", seg.ptr)):
                    for n in SIZES:
                        for way, kind in (("device->host", 2), ("host->device", 1)):
                            dst, src = (ptr, d.data.ptr) if kind == 2 else (d.data.ptr, ptr)
                            med, p90 = call_times(dst, src, n, kind, stream)
                            row = {
                                "memory": mem,
                                "way": way,
                                "bytes": n,
                                "waiter": waiter_kind,
                                "peer_busy": peer_busy,
                                "call_us_median": round(med, 1),
                                "call_us_p90": round(p90, 1),
                            }
                            rows.append(row)
                            print(row, flush=True)
                world.send(True, dest=1, tag=7)
            if waiter is not None:
                waiter.close()
    # back to back on one stream, as the pipeline queues them
    for ready in (False, True):
        for n in (1 * MiB, 8 * MiB):
            for way, kind in (("device->host", 2), ("host->device", 1)):
                world.Barrier()
                if r == 0:
                    dst, src = (seg.ptr, d.data.ptr) if kind == 2 else (d.data.ptr, seg.ptr)
                    runs = [queued_times(dst, src, n, kind, stream, ready) for _ in range(5)]
                    row = {
                        "memory": "/dev/shm segment",
                        "way": way,
                        "bytes": n,
                        "queued": "8 back to back" + (", each after an event" if ready else ""),
                        "call_us_each": [round(statistics.median(c), 1) for c in zip(*runs)],
                    }
                    rows.append(row)
                    print(row, flush=True)
    world.Barrier()
    seg.close()
    if r == 0:
        with open(out, "w") as f:
            json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
