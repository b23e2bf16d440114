"""A staged send/recv whose chunks are ordered by the GPUs alone, through flags in shared host
memory: how fast the shm rail's pipeline could go with no thread between its copies.

mpirun -n 2 python -m mpi4py scripts/probe_gpu_flags.py OUT.json

Rank 0 sends 256 MiB to rank 1 through SLOTS slots of a shared /dev/shm segment, as the shm
rail does, but both ranks queue every step of the message at once:
- rank 0, for chunk i into slot s: wait until flag free[s] says rank 1 has copied the slot's
  previous chunk out (cuStreamWaitValue32), copy the chunk in, then set ready[s]
  (cuStreamWriteValue32);
- rank 1: wait for ready[s], copy the chunk out, set free[s].
The flags live in a second shared segment registered with the GPU; stream memory operations
exist on CUDA and on ROCm (hipStreamWaitValue32), so the two ranks could be of two vendors.
One message at a time (median of 9) and 20 back to back, beside the pinned device->host copy
alone and both ways at once; every byte is checked. A wait that does not end within 10 s
releases its stream by writing the flags from the host, and the run says so.
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

MiB = 1 << 20
NBYTES = 256 * MiB
STRIDE = 64  # bytes between two flags


class Pipe:
    """One direction of the flag-ordered pipeline between rank 0 (sender) and rank 1."""

    def __init__(self, world: MPI.Intracomm, slots: int, chunk: int) -> None:
        from hetcomm.transports.shm import SharedSlots

        self.r, self.slots, self.chunk = world.Get_rank(), slots, chunk
        base = world.bcast(f"hetcomm-probe-flags-{os.getpid()}" if self.r == 0 else None)
        create = self.r == 0
        if create:
            self.data = SharedSlots(base + "-data", slots, chunk, create=True)
            self.flags = SharedSlots(base + "-flags", 1, 2 * slots * STRIDE, create=True)
        world.Barrier()
        if not create:
            self.data = SharedSlots(base + "-data", slots, chunk, create=False)
            self.flags = SharedSlots(base + "-flags", 1, 2 * slots * STRIDE, create=False)
        world.Barrier()
        if create:
            self.data.unlink()
            self.flags.unlink()
        dev = cupy.cuda.Device().id
        self.data.register_with_gpu(dev)
        self.flags.register_with_gpu(dev)
        from hetcomm.kernels.device import StreamFlags

        self.drv = StreamFlags()  # the staged transport's own access to the driver's calls
        self.flag_dev = self.drv.device_pointer(self.flags.ptr)
        self.uses = [0] * slots  # how many chunks each slot has carried (the same on both ranks)
        self.stream = cupy.cuda.Stream(non_blocking=True)

    def _ready(self, s: int) -> int:
        return self.flag_dev + s * STRIDE

    def _free(self, s: int) -> int:
        return self.flag_dev + (self.slots + s) * STRIDE

    def queue(self, buf: cupy.ndarray, nbytes: int) -> None:
        """Queue one message's every step on this rank's stream."""
        st, stream = self.stream.ptr, self.stream
        for i, off in enumerate(range(0, nbytes, self.chunk)):
            n = min(self.chunk, nbytes - off)
            s = i % self.slots
            self.uses[s] += 1
            k = self.uses[s]
            slot_ptr = self.data.ptr + s * self.chunk
            if self.r == 0:
                if k > 1:
                    self.drv.wait(stream, self._free(s), k - 1)
                cupy.cuda.runtime.memcpyAsync(slot_ptr, buf.data.ptr + off, n, 2, st)
                self.drv.write(stream, self._ready(s), k)
            else:
                self.drv.wait(stream, self._ready(s), k)
                cupy.cuda.runtime.memcpyAsync(buf.data.ptr + off, slot_ptr, n, 1, st)
                self.drv.write(stream, self._free(s), k)

    def finish(self, limit: float = 10.0) -> bool:
        """Wait for this rank's stream; False (and the stream released) after `limit` s."""
        event = cupy.cuda.Event(disable_timing=True)
        event.record(self.stream)
        deadline = time.monotonic() + limit
        while not event.done:
            if time.monotonic() > deadline:
                flags = self.flags.view(0, 2 * self.slots * STRIDE).view("uint32")
                flags[:] = 1 << 30  # every wait passes: the stream runs to its end
                self.stream.synchronize()
                return False
            time.sleep(2e-6)
        return True


def main(out: str) -> None:
    from bench_direct import alone
    from bench_staged import pinned_both_ways, pinned_copy_rate

    from hetcomm.topology import use_local_device

    use_local_device()
    world = MPI.COMM_WORLD
    r = world.Get_rank()
    copy = alone(world, pinned_copy_rate, NBYTES)
    both = alone(world, pinned_both_ways, NBYTES)
    x = cupy.arange(NBYTES, dtype=cupy.uint8) * 3
    y = cupy.zeros(NBYTES, dtype=cupy.uint8)
    rows = [
        {"case": "pinned device->host copy", "GBps": copy / 1e9},
        {"case": "pinned copies both ways at once (each way)", "GBps": both / 1e9},
    ]
    stalled = False
    for chunk in (2 * MiB, 4 * MiB, 8 * MiB):
        pipe = Pipe(world, 8, chunk)
        buf = x if r == 0 else y

        def once(k: int = 1, pipe: Pipe = pipe, buf: cupy.ndarray = buf) -> float:
            nonlocal stalled
            y.fill(0)
            cupy.cuda.Device().synchronize()
            world.Barrier()
            t0 = time.perf_counter()
            for _ in range(k):
                pipe.queue(buf, NBYTES)
            stalled |= not pipe.finish()
            return world.allreduce(time.perf_counter() - t0, op=MPI.MAX)

        once()
        once()
        single = statistics.median(once() for _ in range(9))
        ok = world.allreduce(r != 1 or bool((y == x).all()), op=MPI.LAND)
        b2b = statistics.median(once(20) for _ in range(3)) / 20
        ok &= world.allreduce(r != 1 or bool((y == x).all()), op=MPI.LAND)
        for case, sec in (
            ("one at a time (median of 9)", single),
            ("20 back to back, per message", b2b),
        ):
            rows.append(
                {
                    "case": f"256 MiB, {chunk // MiB} MiB chunks, 8 slots, {case}",
                    "time_ms": sec * 1e3,
                    "GBps": NBYTES / sec / 1e9,
                    "of_pinned_copy": NBYTES / sec / copy,
                    "ok": bool(ok),
                }
            )
        pipe.data.close()
        pipe.flags.close()
    rows.append(
        {
            "case": "a wait had to be released from the host",
            "stalled": bool(world.allreduce(stalled, op=MPI.LOR)),
        }
    )
    if r == 0:
        for row in rows:
            print(row, flush=True)
        with open(out, "w") as f:
            json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main(sys.argv[1])
