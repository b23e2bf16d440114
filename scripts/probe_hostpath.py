"""How fast bytes cross between the GPU and host memory, by each engine, one process.

python3 scripts/probe_hostpath.py OUT.json

A staged message crosses PCIe twice: device->host on the sender, host->device on the receiver.
This times 256 MiB each way through three kinds of host memory (pinned by cudaMallocHost; a
/dev/shm segment registered with the GPU, as the shm rail's slots are; host memory made by the
driver's virtual memory API, cuMemCreate on the GPU's NUMA node, which can be shared between
processes by a file descriptor) and by two engines: the copy engines (cudaMemcpyAsync) and the
SMs (a kernel that loads and stores through the mapped host pages), with several grid shapes,
and both engines at once on halves of the message. Then, by the copy engines alone, 9 rounds
that take the memory kinds in turn: each way alone and both ways at once (256 MiB out of the
GPU into one buffer while 256 MiB come in from another), as a staged pipeline runs them.
Medians of 7 timed by CUDA events; the rounds give medians and spreads.
"""

from __future__ import annotations

import ctypes
import json
import os
import statistics
import sys
from typing import Any

import cupy
import numpy as np

MiB = 1 << 20
NBYTES = 256 * MiB

_SRC = r"""
extern "C" __global__ void copy_ilp(uint4* dst, const uint4* src, unsigned long long n) {
    const unsigned long long stride = (unsigned long long)blockDim.x * gridDim.x;
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n; i += 4 * stride) {
        uint4 a = src[i], b = src[i + stride], c = src[i + 2 * stride], d = src[i + 3 * stride];
        dst[i] = a; dst[i + stride] = b; dst[i + 2 * stride] = c; dst[i + 3 * stride] = d;
    }
    for (; i < n; i += stride) dst[i] = src[i];
}
extern "C" __global__ void copy_plain(uint4* dst, const uint4* src, unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
         i < n; i += (unsigned long long)blockDim.x * gridDim.x) dst[i] = src[i];
}
"""


def timed(fn: Any, runs: int = 7) -> float:
    """Seconds per call, median of `runs` after one warm-up, by events on the null stream's
    view of the device (every stream used is synchronised inside fn's span)."""
    fn()
    cupy.cuda.Device().synchronize()
    out = []
    for _ in range(runs):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        cupy.cuda.Device().synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(cupy.cuda.get_elapsed_time(start, end) / 1e3)
    return statistics.median(out)


class VmmHost:
    """Pinned host memory from cuMemCreate (location: a host NUMA node), mapped for the GPU,
    exportable as a POSIX file descriptor."""

    def __init__(self, nbytes: int, numa: int, dev: int) -> None:
        cu = self.cu = ctypes.CDLL("libcuda.so.1")

        class Loc(ctypes.Structure):
            _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]

        class Flags(ctypes.Structure):
            _fields_ = [
                ("compressionType", ctypes.c_ubyte),
                ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort),
                ("reserved", ctypes.c_ubyte * 4),
            ]

        class Prop(ctypes.Structure):
            _fields_ = [
                ("type", ctypes.c_int),
                ("requestedHandleTypes", ctypes.c_int),
                ("location", Loc),
                ("win32HandleMetaData", ctypes.c_void_p),
                ("allocFlags", Flags),
            ]

        class Access(ctypes.Structure):
            _fields_ = [("location", Loc), ("flags", ctypes.c_int)]

        prop = Prop()
        prop.type = 1  # pinned
        prop.requestedHandleTypes = 1  # POSIX file descriptor
        prop.location.type, prop.location.id = 3, numa  # CU_MEM_LOCATION_TYPE_HOST_NUMA
        gran = ctypes.c_size_t()
        self._check(
            cu.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(prop), 1),
            "cuMemGetAllocationGranularity",
        )
        self.granularity = gran.value
        size = (nbytes + gran.value - 1) // gran.value * gran.value
        self.size = size
        handle = ctypes.c_ulonglong()
        self._check(
            cu.cuMemCreate(
                ctypes.byref(handle),
                ctypes.c_size_t(size),
                ctypes.byref(prop),
                ctypes.c_ulonglong(0),
            ),
            "cuMemCreate",
        )
        self.handle = handle
        ptr = ctypes.c_ulonglong()
        self._check(
            cu.cuMemAddressReserve(
                ctypes.byref(ptr),
                ctypes.c_size_t(size),
                ctypes.c_size_t(0),
                ctypes.c_ulonglong(0),
                ctypes.c_ulonglong(0),
            ),
            "cuMemAddressReserve",
        )
        self.ptr = ptr.value
        self._check(
            cu.cuMemMap(
                ptr, ctypes.c_size_t(size), ctypes.c_size_t(0), handle, ctypes.c_ulonglong(0)
            ),
            "cuMemMap",
        )
        acc = Access()
        acc.location.type, acc.location.id, acc.flags = 1, dev, 3
        self._check(
            cu.cuMemSetAccess(ptr, ctypes.c_size_t(size), ctypes.byref(acc), ctypes.c_size_t(1)),
            "cuMemSetAccess(device)",
        )
        host = Access()
        host.location.type, host.location.id, host.flags = 3, numa, 3
        rc = cu.cuMemSetAccess(ptr, ctypes.c_size_t(size), ctypes.byref(host), ctypes.c_size_t(1))
        self.host_access = rc == 0
        self.host_access_rc = rc
        fd = ctypes.c_int(-1)
        rc = cu.cuMemExportToShareableHandle(ctypes.byref(fd), handle, 1, ctypes.c_ulonglong(0))
        self.export_rc = rc
        if rc == 0:
            os.close(fd.value)

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} returned CUresult {rc}")


def numa_node(dev: int) -> int:
    bus = cupy.cuda.runtime.deviceGetPCIBusId(dev).lower()
    for cand in (bus, bus[4:] if bus.count(":") == 2 else bus):
        path = f"/sys/bus/pci/devices/{cand}/numa_node"
        if os.path.exists(path):
            return max(0, int(open(path).read().strip()))
    return 0


def main(out: str) -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from hetcomm.transports.shm import SharedSlots

    dev = cupy.cuda.Device().id
    props = cupy.cuda.runtime.getDeviceProperties(dev)
    sms = props["multiProcessorCount"]
    mod = cupy.RawModule(code=_SRC, options=("-std=c++14",))
    kernels = {"plain": mod.get_function("copy_plain"), "ilp4": mod.get_function("copy_ilp")}
    can_use_host_ptr = cupy.cuda.runtime.deviceGetAttribute(91, dev)
    d = cupy.arange(NBYTES // 4, dtype=cupy.uint32).view(cupy.uint8)
    back = cupy.empty_like(d)
    rows: list[dict[str, Any]] = []
    info: dict[str, Any] = {
        "sms": sms,
        "can_use_host_pointer_for_registered_mem": can_use_host_ptr,
        "numa": numa_node(dev),
    }
    kinds: list[tuple[str, int]] = []
    pinned = cupy.cuda.alloc_pinned_memory(2 * NBYTES)
    kinds.append(("pinned (cudaMallocHost)", pinned.ptr))
    seg = SharedSlots(f"hetcomm-probe-{os.getpid()}", 2, NBYTES, create=True)
    seg.unlink()
    seg.register_with_gpu(dev)
    kinds.append(("/dev/shm segment, registered", seg.ptr))
    try:
        vmm = VmmHost(2 * NBYTES, info["numa"], dev)
        kinds.append(("cuMemCreate host NUMA", vmm.ptr))
        info.update(
            vmm_granularity=vmm.granularity,
            vmm_host_access_rc=vmm.host_access_rc,
            vmm_export_rc=vmm.export_rc,
        )
    except Exception as exc:  # record why, go on with the others
        info["vmm_error"] = repr(exc)
    s1, s2 = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)

    def ce(dst: int, src: int, nbytes: int, kind: int, stream: Any) -> None:
        cupy.cuda.runtime.memcpyAsync(dst, src, nbytes, 4, stream.ptr)  # cudaMemcpyDefault

    def sm(
        dst: int, src: int, nbytes: int, name: str, blocks: int, threads: int, stream: Any
    ) -> None:
        with stream:
            kernels[name](
                (blocks,), (threads,), (np.uint64(dst), np.uint64(src), np.uint64(nbytes // 16))
            )

    def run_sync(fn: Any) -> Any:
        def go() -> None:
            fn()
            s1.synchronize()
            s2.synchronize()

        return go

    shapes = [
        ("plain", sms * 4, 256),
        ("plain", sms * 16, 256),
        ("ilp4", sms * 2, 512),
        ("ilp4", sms * 4, 512),
        ("ilp4", sms * 8, 256),
        ("ilp4", 32, 1024),
        ("ilp4", 64, 512),
    ]
    for kname, ptr in kinds:
        cupy.cuda.runtime.memcpy(ptr, d.data.ptr, NBYTES, 2)
        for way, (dst, src, kind) in (
            ("device->host", (ptr, d.data.ptr, 2)),
            ("host->device", (back.data.ptr, ptr, 1)),
        ):
            t = timed(run_sync(lambda dst=dst, src=src, kind=kind: ce(dst, src, NBYTES, kind, s1)))
            rows.append(
                {"memory": kname, "way": way, "engine": "copy engine", "GBps": NBYTES / t / 1e9}
            )
            for name, blocks, threads in shapes:
                t = timed(
                    run_sync(
                        lambda dst=dst, src=src, name=name, blocks=blocks, threads=threads: sm(
                            dst, src, NBYTES, name, blocks, threads, s1
                        )
                    )
                )
                rows.append(
                    {
                        "memory": kname,
                        "way": way,
                        "engine": f"SM {name} {blocks}x{threads}",
                        "GBps": NBYTES / t / 1e9,
                    }
                )
            for share in (0.25, 0.5):
                cut = int(NBYTES * share) // 16 * 16

                def both(dst: int = dst, src: int = src, cut: int = cut, kind: int = kind) -> None:
                    ce(dst, src, cut, kind, s1)
                    sm(dst + cut, src + cut, NBYTES - cut, "ilp4", sms * 4, 512, s2)

                t = timed(run_sync(both))
                rows.append(
                    {
                        "memory": kname,
                        "way": way,
                        "engine": f"copy engine {share:.0%} + SM ilp4 rest",
                        "GBps": NBYTES / t / 1e9,
                    }
                )
        back.fill(0)
        cupy.cuda.runtime.memcpy(back.data.ptr, ptr, NBYTES, 1)
        rows.append(
            {"memory": kname, "way": "check", "engine": "-", "GBps": float(bool((back == d).all()))}
        )
        # both ways at once: device->host by the copy engine, host->device by each engine
        half = NBYTES // 2
        for eng in ("copy engine", "SM ilp4"):

            def both_ways(eng: str = eng, ptr: int = ptr, half: int = half) -> None:
                ce(ptr, d.data.ptr, half, 2, s1)
                if eng == "copy engine":
                    ce(back.data.ptr, ptr + half, half, 1, s2)
                else:
                    sm(back.data.ptr, ptr + half, half, "ilp4", sms * 4, 512, s2)

            t = timed(run_sync(both_ways))
            rows.append(
                {
                    "memory": kname,
                    "way": "both ways at once, half each (each way)",
                    "engine": f"out by copy engine, in by {eng}",
                    "GBps": half / t / 1e9,
                }
            )
    rounds: dict[tuple[str, str], list[float]] = {}
    for _ in range(9):
        for kname, ptr in kinds:
            out_only = timed(run_sync(lambda ptr=ptr: ce(ptr, d.data.ptr, NBYTES, 2, s1)))
            in_only = timed(
                run_sync(lambda ptr=ptr: ce(back.data.ptr, ptr + NBYTES, NBYTES, 1, s1))
            )

            def both_full(ptr: int = ptr) -> None:
                ce(ptr, d.data.ptr, NBYTES, 2, s1)
                ce(back.data.ptr, ptr + NBYTES, NBYTES, 1, s2)

            both_t = timed(run_sync(both_full))
            for way, t in (
                ("device->host alone", out_only),
                ("host->device alone", in_only),
                ("both ways at once, 256 MiB each (each way)", both_t),
            ):
                rounds.setdefault((kname, way), []).append(NBYTES / t / 1e9)
    for (kname, way), rates in rounds.items():
        med = statistics.median(rates)
        rows.append(
            {
                "memory": kname,
                "way": way,
                "engine": "copy engine, 9 rounds",
                "GBps": med,
                "min": min(rates),
                "max": max(rates),
                "spread": (max(rates) - min(rates)) / med,
            }
        )
    seg.close()
    for row in rows:
        print(f"{row['memory']:32s} {row['way']:42s} {row['engine']:36s} {row['GBps']:7.2f}")
    print(info)
    with open(out, "w") as f:
        json.dump({"info": info, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
