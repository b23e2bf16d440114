"""Per-rank facts (host, vendor, device, local rank, NICs, GPU-aware MPI), gathered over MPI."""

from __future__ import annotations

import ctypes
import hashlib
import os
import socket
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from .config import Config
from .nics import Nic, list_nics
from .plan import Member

NOT_PROBED = "peer mapping was not probed for this rank"


@dataclass(frozen=True)
class RankInfo:
    """What one rank is: where it runs, on what device, reaching which networks."""

    rank: int  # rank in the communicator this topology describes
    world_rank: int  # rank in the communicator hetcomm.init() wrapped
    host: str  # host name, or the HETCOMM_HOST override
    vendor: str  # nvidia, amd or cpu (HETCOMM_VENDOR overrides what was detected)
    detected_vendor: str
    device_index: int | None
    device_uuid: str | None
    local_rank: int  # rank among the members on the same host
    local_size: int
    node: int  # index of the real shared-memory node (simulated hosts may share one)
    nics: tuple[Nic, ...]
    gpu_aware: bool
    mpi_gpu: str  # what the MPI library said about device buffers
    # None when this rank can map the memory of its node's other device ranks, else why not
    # (the probe at init, hetcomm.transports.direct.peer.probe)
    peer_mapping: str | None = NOT_PROBED

    @property
    def simulated(self) -> bool:
        """True when the vendor differs from what was detected (a simulated vendor)."""
        return self.vendor != self.detected_vendor

    @property
    def device(self) -> str | None:
        """A stable identity of the device, for telling shared devices apart."""
        if self.device_uuid:
            return self.device_uuid
        if self.device_index is None:
            return None
        return f"node{self.node}:{self.detected_vendor}:{self.device_index}"

    def member(self) -> Member:
        """The facts the plan uses about this rank."""
        return Member(self.rank, self.host, self.vendor, self.device, self.gpu_aware)


class Topology:
    """The facts of every rank of a communicator, in rank order; prints as a table."""

    def __init__(self, ranks: Sequence[RankInfo]) -> None:
        self.ranks = tuple(ranks)

    def __len__(self) -> int:
        return len(self.ranks)

    def __getitem__(self, rank: int) -> RankInfo:
        return self.ranks[rank]

    def __iter__(self) -> Iterator[RankInfo]:
        return iter(self.ranks)

    def members(self) -> list[Member]:
        """The plan's facts of every rank, in rank order."""
        return [r.member() for r in self.ranks]

    def hosts(self) -> list[str]:
        """The host names of the group, sorted."""
        return sorted({r.host for r in self.ranks})

    def vendors(self) -> list[str]:
        """The vendors in the group, sorted."""
        return sorted({r.vendor for r in self.ranks})

    def share_one_device(self) -> bool:
        """Whether the group has several ranks, all on one and the same device."""
        devices = {r.device for r in self.ranks}
        return len(self.ranks) > 1 and len(devices) == 1 and None not in devices

    def islands(self) -> list[tuple[int, ...]]:
        """Ranks grouped by (host, vendor): members that a native library could serve together."""
        found: dict[tuple[str, str], list[int]] = {}
        for r in self.ranks:
            found.setdefault((r.host, r.vendor), []).append(r.rank)
        return [tuple(v) for v in found.values()]

    def subset(self, parent_ranks: Sequence[int]) -> Topology:
        """The topology of a sub-communicator whose rank i is `parent_ranks[i]` here."""
        picked = [self.ranks[p] for p in parent_ranks]
        by_host: dict[str, int] = {}
        local: list[int] = []
        for r in picked:
            local.append(by_host.get(r.host, 0))
            by_host[r.host] = local[-1] + 1
        return Topology(
            [
                replace(r, rank=i, local_rank=local[i], local_size=by_host[r.host])
                for i, r in enumerate(picked)
            ]
        )

    def with_peer_mapping(self, verdicts: Sequence[str | None] | None) -> Topology:
        """This topology with each rank's peer-mapping verdict (rank order; None: not probed)."""
        if verdicts is None:
            return self
        return Topology([replace(r, peer_mapping=v) for r, v in zip(self.ranks, verdicts)])

    def peer_mapping_unavailable(self) -> str | None:
        """Why these ranks cannot map each other's memory, from the probe; None when they can."""
        for r in self.ranks:
            if r.peer_mapping is not None:
                return f"rank {r.world_rank}: {r.peer_mapping}"
        return None

    def fingerprint(self) -> str:
        """A short hash of what shapes performance: hosts, vendors, devices, NICs per rank."""
        text = repr([(r.host, r.vendor, r.device, [n.ipv4 for n in r.nics]) for r in self.ranks])
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def table(self) -> str:
        """One row per rank: host, vendor, device, local rank, GPU-aware MPI and NICs."""
        head = ("rank", "host", "vendor", "device", "local", "gpu-aware MPI", "NICs")
        rows = [head]
        for r in self.ranks:
            vendor = r.vendor + (f" (sim; is {r.detected_vendor})" if r.simulated else "")
            device = "-" if r.device_index is None else str(r.device_index)
            if r.device_uuid:
                device += f" {r.device_uuid[:12]}"
            nics = ", ".join(f"{n.name} {n.ipv4}/{n.prefixlen}" for n in r.nics) or "-"
            rows.append(
                (
                    str(r.rank),
                    r.host,
                    vendor,
                    device,
                    f"{r.local_rank}/{r.local_size}",
                    "yes" if r.gpu_aware else "no",
                    nics,
                )
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
        return "\n".join(
            "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows
        )

    def __str__(self) -> str:
        return self.table()


def detect_vendor() -> tuple[str, int]:
    """(vendor, number of visible devices) from the driver files, importing no GPU library."""
    if os.path.isdir("/proc/driver/nvidia/gpus") or os.path.exists("/dev/nvidia0"):
        total = (
            len(os.listdir("/proc/driver/nvidia/gpus"))
            if os.path.isdir("/proc/driver/nvidia/gpus")
            else 1
        )
        return "nvidia", _visible(("CUDA_VISIBLE_DEVICES",), total)
    if os.path.exists("/dev/kfd"):
        total = _amd_gpu_count()
        if total:
            return "amd", _visible(("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"), total)
    return "cpu", 0


def use_local_device(comm: Any = None) -> int | None:
    """Make the device hetcomm's topology gives this rank its current one, in CuPy and torch
    (those of them that are installed): its rank among the processes of its node, modulo the
    devices it can see, as `torch.cuda.set_device(local_rank)` does in a torch job. Collective
    over `comm` (default COMM_WORLD). Returns the index, or None on a rank without a GPU."""
    import importlib.util

    from mpi4py import MPI

    comm = MPI.COMM_WORLD if comm is None else comm
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    node_rank = node.Get_rank()
    node.Free()
    detected, visible = detect_vendor()
    if detected == "cpu" or not visible:
        return None
    index = node_rank % visible
    if importlib.util.find_spec("cupy") is not None:
        import cupy

        cupy.cuda.Device(index).use()
    if importlib.util.find_spec("torch") is not None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.set_device(index)
    return index


def _visible(names: Sequence[str], total: int) -> int:
    for name in names:
        value = os.environ.get(name)
        if value is not None:
            return len([v for v in value.split(",") if v.strip() and v.strip() != "-1"])
    return total


def _amd_gpu_count() -> int:
    base = "/sys/class/kfd/kfd/topology/nodes"
    count = 0
    try:
        for node in os.listdir(base):
            with open(os.path.join(base, node, "properties")) as f:
                for line in f:
                    if line.startswith("simd_count") and int(line.split()[1]) > 0:
                        count += 1
    except OSError:
        return 0
    return count


def device_uuid(vendor: str, index: int) -> str | None:
    """The device's UUID through whichever GPU library is importable (cupy, then torch)."""
    try:
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(index)
        raw = props.get("uuid")
        if isinstance(raw, bytes) and raw:
            return raw.hex()
    except Exception:
        pass
    try:
        import torch

        if torch.cuda.is_available():
            return str(torch.cuda.get_device_properties(index).uuid)
    except Exception:
        pass
    return None


def mpi_gpu_support() -> tuple[bool, str]:
    """(GPU-aware, how it was told) from the MPI library's own query functions.

    Open MPI answers MPIX_Query_cuda_support / MPIX_Query_rocm_support at run time; MPICH-family
    libraries answer MPIX_GPU_query_support. A library with neither is treated as not GPU-aware,
    the safe answer: a device pointer handed to such an MPI crashes the rank.
    """
    from mpi4py import MPI

    lib = _mpi_library(MPI)
    if lib is None:
        return False, "libmpi symbols not found: assumed not GPU-aware"
    for sym, label in (("MPIX_Query_cuda_support", "CUDA"), ("MPIX_Query_rocm_support", "ROCm")):
        fn = getattr(lib, sym, None)
        if fn is not None:
            fn.restype = ctypes.c_int
            if fn():
                return True, f"{sym}() = 1 ({label}-aware)"
    query = getattr(lib, "MPIX_GPU_query_support", None)
    if query is not None:
        for gpu_type, label in ((1, "CUDA"), (3, "HIP")):  # MPIX_GPU_SUPPORT_CUDA / _HIP
            flag = ctypes.c_int(0)
            if query(ctypes.c_int(gpu_type), ctypes.byref(flag)) == 0 and flag.value:
                return True, f"MPIX_GPU_query_support({label}) = 1"
    has_query = any(
        getattr(lib, s, None) is not None
        for s in ("MPIX_Query_cuda_support", "MPIX_GPU_query_support")
    )
    if has_query:
        return False, "the MPI library says it is not GPU-aware"
    return False, "no GPU-support query in this MPI: assumed not GPU-aware"


def _mpi_library(MPI: Any) -> Any:
    try:
        return ctypes.CDLL(MPI.__file__, mode=ctypes.RTLD_GLOBAL)
    except OSError:
        return None


def local_facts(config: Config) -> dict[str, Any]:
    """This rank's own facts, before gathering."""
    detected, visible = detect_vendor()
    vendor = config.vendor or detected
    host = config.host or socket.gethostname()
    try:
        nics = tuple(list_nics())
    except OSError:
        nics = ()
    aware, how = mpi_gpu_support()
    return {
        "host": host,
        "vendor": vendor,
        "detected_vendor": detected,
        "visible": visible,
        "nics": nics,
        "gpu_aware": aware,
        "mpi_gpu": how,
    }


def gather(mpi_comm: Any, config: Config) -> Topology:
    """Every rank's facts, gathered once over `mpi_comm` (collective)."""
    from mpi4py import MPI

    facts = local_facts(config)
    node_comm = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, key=mpi_comm.Get_rank())
    try:
        node_leader = node_comm.bcast(mpi_comm.Get_rank(), root=0)
        node_rank = node_comm.Get_rank()
    finally:
        node_comm.Free()
    world_rank = MPI.COMM_WORLD.Get_rank()
    everyone = mpi_comm.allgather((facts, node_leader, world_rank, node_rank))
    leaders = sorted({e[1] for e in everyone})
    me = mpi_comm.Get_rank()
    ranks: list[RankInfo] = []
    seen: dict[str, int] = {}
    per_host: dict[str, int] = {}
    for f, *_ in everyone:
        per_host[f["host"]] = per_host.get(f["host"], 0) + 1
    for rank, (f, leader, wrank, nrank) in enumerate(everyone):
        local = seen.get(f["host"], 0)
        seen[f["host"]] = local + 1
        index = uuid = None
        if f["visible"]:
            # devices are shared out by rank within the real node, whatever hosts are simulated
            index = nrank % f["visible"]
            if rank == me and f["detected_vendor"] != "cpu":
                uuid = device_uuid(f["detected_vendor"], index)
        ranks.append(
            RankInfo(
                rank=rank,
                world_rank=wrank,
                host=f["host"],
                vendor=f["vendor"],
                detected_vendor=f["detected_vendor"],
                device_index=index,
                device_uuid=uuid,
                local_rank=local,
                local_size=per_host[f["host"]],
                node=leaders.index(leader),
                nics=f["nics"],
                gpu_aware=f["gpu_aware"],
                mpi_gpu=f["mpi_gpu"],
            )
        )
    # UUIDs are known only locally until shared: one more gather, of short strings
    uuids = mpi_comm.allgather(ranks[me].device_uuid)
    return Topology([replace(r, device_uuid=u) for r, u in zip(ranks, uuids)])
