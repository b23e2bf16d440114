"""Which GPUs, NICs and CPUs sit near each other, read from sysfs under a (replaceable) root."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

NVIDIA_GPUS = "proc/driver/nvidia/gpus"  # one folder per GPU, named by its PCI address
KFD_NODES = "sys/class/kfd/kfd/topology/nodes"  # ROCm's device list, in the runtime's order
PCI_DEVICES = "sys/bus/pci/devices"
NET = "sys/class/net"
NUMA_NODES = "sys/devices/system/node"


@dataclass(frozen=True)
class Gpu:
    """One GPU as the vendor runtime numbers it (CUDA in PCI bus order, ROCm in KFD order)."""

    vendor: str
    index: int
    pci: str | None  # "0000:3b:00.0", when the driver files tell


@dataclass(frozen=True)
class NetDevice:
    """A physical network interface that is up: its name, NUMA node, PCI path and UCX name."""

    name: str
    numa: int | None
    pci_path: tuple[str, ...] | None
    ucx_name: str  # "mlx5_0:1" for an RDMA port, else the interface name


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _int(text: str | None, base: int = 10) -> int | None:
    try:
        return int(text, base) if text is not None else None
    except ValueError:
        return None


def gpus(root: str | os.PathLike[str] = "/") -> tuple[str, list[Gpu]]:
    """(vendor, GPUs) of this machine from the driver files, as topology.detect_vendor sees them."""
    base = Path(root)
    nvidia = base / NVIDIA_GPUS
    if nvidia.is_dir():
        names = sorted(p.name.lower() for p in nvidia.iterdir())
        return "nvidia", [Gpu("nvidia", i, name) for i, name in enumerate(names)]
    dev = base / "dev"
    if (dev / "nvidia0").exists():
        count = len([p for p in dev.iterdir() if re.fullmatch(r"nvidia\d+", p.name)])
        return "nvidia", [Gpu("nvidia", i, None) for i in range(count)]
    if (dev / "kfd").exists():
        found = _kfd_gpus(base / KFD_NODES)
        if found:
            return "amd", found
    return "cpu", []


def _kfd_gpus(nodes: Path) -> list[Gpu]:
    try:
        entries = sorted(
            (p for p in nodes.iterdir() if p.name.isdigit()), key=lambda p: int(p.name)
        )
    except OSError:
        return []
    found: list[Gpu] = []
    for entry in entries:
        props: dict[str, int] = {}
        for line in (_read(entry / "properties") or "").splitlines():
            key, _, value = line.partition(" ")
            number = _int(value.strip())
            if number is not None:
                props[key] = number
        if props.get("simd_count", 0) <= 0:
            continue  # a CPU node
        pci = None
        if "location_id" in props:
            loc = props["location_id"]  # bus << 8 | device << 3 | function
            bus, device, function = loc >> 8 & 0xFF, loc >> 3 & 0x1F, loc & 7
            pci = f"{props.get('domain', 0):04x}:{bus:02x}:{device:02x}.{function}"
        found.append(Gpu("amd", len(found), pci))
    return found


def _relative_parts(path: Path, root: Path) -> tuple[str, ...] | None:
    real = Path(os.path.realpath(path))
    devices = Path(os.path.realpath(root / "sys" / "devices"))
    try:
        return real.relative_to(devices).parts
    except ValueError:
        return None


def pci_path(root: str | os.PathLike[str], pci: str) -> tuple[str, ...] | None:
    """The chain of bridges to a PCI device ('pci0000:00', '0000:00:01.0', ..., itself)."""
    base = Path(root)
    entry = base / PCI_DEVICES / pci
    return _relative_parts(entry, base) if entry.exists() else None


def numa_node(root: str | os.PathLike[str], pci: str) -> int | None:
    """The NUMA node of a PCI device, or None where sysfs does not say (-1, missing)."""
    node = _int(_read(Path(root) / PCI_DEVICES / pci / "numa_node"))
    return node if node is not None and node >= 0 else None


def parse_cpulist(text: str) -> set[int]:
    """'0-3,8,10-11' -> {0, 1, 2, 3, 8, 10, 11}."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def format_cpulist(cpus: set[int] | list[int] | tuple[int, ...]) -> str:
    """{0, 1, 2, 3, 8} -> '0-3,8' (the kernel's cpulist form)."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def node_cpus(root: str | os.PathLike[str], node: int) -> set[int] | None:
    """The CPUs of a NUMA node, or None when sysfs does not list them."""
    text = _read(Path(root) / NUMA_NODES / f"node{node}" / "cpulist")
    if text is None:
        return None
    try:
        return parse_cpulist(text) or None
    except ValueError:
        return None


def net_devices(root: str | os.PathLike[str] = "/") -> list[NetDevice]:
    """Physical interfaces (backed by a PCI device, not virtual) whose link is up, by name."""
    base = Path(root)
    net = base / NET
    try:
        entries = sorted(p for p in net.iterdir() if p.is_dir())
    except OSError:
        return []
    found = []
    for entry in entries:
        device = entry / "device"
        if not device.exists() or "virtual" in Path(os.path.realpath(entry)).parts:
            continue
        if (_read(entry / "operstate") or "").lower() != "up":
            continue
        numa = _int(_read(device / "numa_node"))
        found.append(
            NetDevice(
                name=entry.name,
                numa=numa if numa is not None and numa >= 0 else None,
                pci_path=_relative_parts(device, base),
                ucx_name=_ucx_name(entry),
            )
        )
    return found


def _ucx_name(entry: Path) -> str:
    # an RDMA-capable port (InfiniBand, RoCE) is named to UCX as "<ib device>:<port>"
    try:
        ib = sorted(p.name for p in (entry / "device" / "infiniband").iterdir())
    except OSError:
        return entry.name
    if not ib:
        return entry.name
    port = (_int(_read(entry / "dev_port")) or 0) + 1
    return f"{ib[0]}:{port}"


def _shared(a: tuple[str, ...], b: tuple[str, ...]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def nearest_nics(
    root: str | os.PathLike[str], gpu: Gpu, nics: list[NetDevice]
) -> tuple[list[NetDevice], str]:
    """The NICs nearest a GPU and why: behind the same PCIe switch, else on the same NUMA node.

    Returns ([], reason) when sysfs cannot tell them apart (no PCI address, no NUMA node, or
    every NIC equally near): then nothing is narrowed and the library's own choice stands.
    """
    if gpu.pci is None:
        return [], "the GPU's PCI address is unknown"
    if not nics:
        return [], "no physical network interface is up"
    path = pci_path(root, gpu.pci)
    if path is not None:
        scores = {n.name: _shared(path, n.pci_path) if n.pci_path else 0 for n in nics}
        best = max(scores.values())
        # sharing more than the root complex (part 0) means sharing a root port or a switch
        if best >= 2:
            near = [n for n in nics if scores[n.name] == best]
            if len(near) < len(nics):
                return near, f"behind the same PCIe switch as GPU {gpu.pci}"
    node = numa_node(root, gpu.pci)
    if node is None:
        return [], f"sysfs gives no NUMA node for GPU {gpu.pci}"
    near = [n for n in nics if n.numa == node]
    if not near:
        return [], f"no NIC on NUMA node {node} of GPU {gpu.pci}"
    if len(near) == len(nics):
        return [], f"every NIC is on NUMA node {node}, as GPU {gpu.pci} is"
    return near, f"on NUMA node {node}, as GPU {gpu.pci} is"
