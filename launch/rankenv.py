"""Each rank's environment: the plan that travels to the ranks, and the pure rule they apply."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from ..config import VENDORS
from ..nics import list_nics
from . import affinity
from .affinity import Gpu
from .flavours import FLAVOURS, Flavour
from .torchrun import rank_variables

# The plan travels to the ranks in this variable. It must not start with "HETCOMM_": the library
# rejects unknown HETCOMM_* names, and the shim removes it before the command starts.
PLAN_VARIABLE = "_HETCOMM_LAUNCH_PLAN"
# numa: the shim pins each rank to the CPUs of its GPU's NUMA node (the launcher binds nothing);
# core / none: the launcher's own binding; default: whatever the launcher does unasked
BIND_MODES = ("numa", "core", "none", "default")
# the variables that restrict which GPUs a process sees, read first to last
VISIBLE = {
    "nvidia": ("CUDA_VISIBLE_DEVICES",),
    "amd": ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"),
}
# the one that is written when none is set: ROCR_VISIBLE_DEVICES applies to every ROCm runtime
WRITE = {"nvidia": "CUDA_VISIBLE_DEVICES", "amd": "ROCR_VISIBLE_DEVICES"}

Addresses = Callable[[str], list[tuple[str, int]]]


class PlanError(ValueError):
    """The launch plan is malformed, or the process was not started by a known launcher."""


@dataclass(frozen=True)
class LaunchPlan:
    """What every rank needs to compute its own environment; travels as JSON."""

    flavour: str  # a key of launch.flavours.FLAVOURS: says where the rank variables are
    size: int  # ranks in the job
    vendors: tuple[str, ...] = ()  # simulated vendors, cycled over ranks (empty: none)
    hosts: int = 0  # simulated hosts sim0..sim{hosts-1}, in contiguous blocks (0: none)
    rails: str = "auto"  # "auto" (nearest NICs), "a,b" (every rank), "a,b/c,d" (per local rank)
    bind: str = "default"  # one of BIND_MODES
    ucx: bool = True  # the MPI may run over UCX: set UCX_NET_DEVICES too
    # torchrun's variables (RANK, LOCAL_RANK, ..., MASTER_ADDR) for each rank: "addr:port", or
    # "" for none; per_node: LOCAL_WORLD_SIZE
    torchrun: str = ""
    per_node: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "vendors", tuple(self.vendors))
        if self.flavour not in FLAVOURS:
            raise PlanError(f"flavour: expected one of {', '.join(FLAVOURS)}, got {self.flavour!r}")
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise PlanError(f"size: expected a positive number of ranks, got {self.size!r}")
        bad = [v for v in self.vendors if v not in VENDORS]
        if bad:
            raise PlanError(f"vendors: expected names among {', '.join(VENDORS)}, got {bad}")
        if not isinstance(self.hosts, int) or not 0 <= self.hosts <= self.size:
            raise PlanError(
                f"hosts: expected 0..{self.size} simulated hosts (one rank each at least), "
                f"got {self.hosts!r}"
            )
        groups = self.rails.split("/") if isinstance(self.rails, str) else [""]
        if any(not g.strip() or "" in [t.strip() for t in g.split(",")] for g in groups):
            raise PlanError(
                f"rails: expected 'auto', 'nic,...' or 'nic,.../nic,...', got {self.rails!r}"
            )
        if self.bind not in BIND_MODES:
            raise PlanError(f"bind: expected one of {', '.join(BIND_MODES)}, got {self.bind!r}")
        if self.torchrun and (
            not self.torchrun.rpartition(":")[2].isdigit() or not 1 <= self.per_node <= self.size
        ):
            raise PlanError(
                f"torchrun: expected 'addr:port' and 1..{self.size} ranks per node, got "
                f"{self.torchrun!r} and {self.per_node!r}"
            )

    def to_json(self) -> str:
        """Compact JSON, the value of PLAN_VARIABLE."""
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> LaunchPlan:
        """The plan from its JSON text; PlanError names what is wrong."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(f"{PLAN_VARIABLE} is not JSON ({e.msg}): {text[:80]!r}") from None
        if not isinstance(data, dict):
            raise PlanError(f"{PLAN_VARIABLE}: expected a JSON object, got {type(data).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise PlanError(f"{PLAN_VARIABLE}: unknown field(s) {unknown}; known: {sorted(known)}")
        return cls(**data)


@dataclass(frozen=True)
class RankEnvironment:
    """What the shim does for one rank: variables to set, CPUs to pin to, and why."""

    rank: int
    local_rank: int
    variables: dict[str, str]
    cpus: tuple[int, ...] | None  # None: leave the CPU affinity alone
    notes: tuple[str, ...]


def rank_ids(flavour: Flavour, environ: Mapping[str, str]) -> tuple[int, int, str]:
    """(rank, local rank, where they came from), trying the flavour's variables first."""
    pairs = list(flavour.rank_vars)
    for other in FLAVOURS.values():
        pairs.extend(p for p in other.rank_vars if p not in pairs)
    for rank_var, local_var in pairs:
        text = environ.get(rank_var)
        if text is None:
            continue
        rank = _number(rank_var, text)
        local_text = environ.get(local_var) if local_var else None
        if local_text is not None:
            return rank, _number(local_var, local_text), f"{rank_var}/{local_var}"
        return rank, rank, f"{rank_var} (no local rank given: taken as the rank)"
    names = ", ".join(dict.fromkeys(p[0] for p in pairs))
    raise PlanError(f"not started by an MPI launcher: none of {names} is set")


def _number(name: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise PlanError(f"{name}: expected a rank number, got {text!r}") from None


def rank_environment(
    plan: LaunchPlan,
    environ: Mapping[str, str],
    *,
    root: str | os.PathLike[str] = "/",
    addresses: Addresses | None = None,
    allowed_cpus: set[int] | None = None,
) -> RankEnvironment:
    """This rank's variables: simulation, device, rails, and the CPUs to pin to (pure)."""
    rank, local, source = rank_ids(FLAVOURS[plan.flavour], environ)
    out: dict[str, str] = {}
    notes = [f"rank {rank}, local rank {local} (from {source})"]
    vendor = environ.get("HETCOMM_VENDOR", "").strip().lower() or None
    if plan.vendors:
        vendor = plan.vendors[rank % len(plan.vendors)]
        out["HETCOMM_VENDOR"] = vendor
    if plan.hosts:
        out["HETCOMM_HOST"] = f"sim{rank * plan.hosts // plan.size}"
    if plan.torchrun:
        addr, _, port = plan.torchrun.rpartition(":")
        out.update(rank_variables(rank, local, plan.size, plan.per_node, addr, int(port)))
    detected, devices = affinity.gpus(root)
    gpu: Gpu | None = None
    if detected == "cpu":
        notes.append("no GPU on this host: no device binding")
    else:
        gpu, variables, note = _bind_device(detected, devices, local, vendor, environ)
        out.update(variables)
        notes.append(note)
    rails, note = _rails(plan, local, gpu, environ, Path(root), addresses)
    out.update(rails)
    notes.append(note)
    cpus = None
    if plan.bind == "numa":
        cpus, note = _numa_cpus(root, gpu, allowed_cpus)
        notes.append(note)
    return RankEnvironment(rank, local, out, cpus, tuple(notes))


def _bind_device(
    detected: str, devices: list[Gpu], local: int, vendor: str | None, environ: Mapping[str, str]
) -> tuple[Gpu | None, dict[str, str], str]:
    preset = next((n for n in VISIBLE[detected] if environ.get(n) is not None), None)
    var = preset or WRITE[detected]
    out: dict[str, str] = {}
    if detected == "nvidia" and "CUDA_DEVICE_ORDER" not in environ:
        out["CUDA_DEVICE_ORDER"] = (
            "PCI_BUS_ID"  # CUDA's numbering then matches sysfs and nvidia-smi
        )
    if vendor == "cpu":
        out[var] = "-1"
        return None, out, f"{var}=-1: a cpu rank sees no {detected} GPU"
    if preset is None:
        if not devices:
            return None, {}, f"{detected} driver present but no GPU listed: no device binding"
        gpu = devices[local % len(devices)]
        out[var] = str(gpu.index)
        return (
            gpu,
            out,
            f"{var}={gpu.index}: GPU {gpu.index} of {len(devices)} ({gpu.pci or 'PCI ?'})",
        )
    entries = [e.strip() for e in environ[preset].split(",") if e.strip()]
    if not entries or entries[0] == "-1":
        return None, {}, f"{preset}={environ[preset]!r} hides every GPU: no device binding"
    chosen = entries[local % len(entries)]
    out[preset] = chosen
    physical = _physical_index(detected, preset, chosen, environ)
    found = devices[physical] if physical is not None and physical < len(devices) else None
    if environ.get("CUDA_DEVICE_ORDER", "PCI_BUS_ID") != "PCI_BUS_ID":
        found = None  # the indices follow another order: sysfs cannot say which GPU this is
    where = found.pci if found and found.pci else "PCI ?"
    return found, out, f"{preset}={chosen}: entry {local % len(entries)} of {preset} ({where})"


def _physical_index(
    detected: str, preset: str, chosen: str, environ: Mapping[str, str]
) -> int | None:
    if not chosen.isdigit():
        return None  # a UUID or MIG name
    index = int(chosen)
    rocr = environ.get("ROCR_VISIBLE_DEVICES")
    if detected == "amd" and preset == "HIP_VISIBLE_DEVICES" and rocr is not None:
        # HIP numbers the devices that ROCR_VISIBLE_DEVICES left visible
        left = [e.strip() for e in rocr.split(",") if e.strip()]
        return int(left[index]) if index < len(left) and left[index].isdigit() else None
    return index


def _rails(
    plan: LaunchPlan,
    local: int,
    gpu: Gpu | None,
    environ: Mapping[str, str],
    root: Path,
    addresses: Addresses | None,
) -> tuple[dict[str, str], str]:
    out: dict[str, str] = {}
    if plan.rails != "auto":
        groups = plan.rails.split("/")
        chosen = groups[local % len(groups)].replace(" ", "")
        out["HETCOMM_RAILS"] = chosen
        if plan.ucx and "UCX_NET_DEVICES" not in environ:
            by_name = {n.name: n for n in affinity.net_devices(root)}
            ucx = [by_name[t].ucx_name for t in chosen.split(",") if t in by_name]
            if ucx:
                out["UCX_NET_DEVICES"] = ",".join(ucx)
        return out, f"rails {chosen} (from --rails, group {local % len(groups)})"
    if "HETCOMM_RAILS" in environ:
        return out, "rails: HETCOMM_RAILS of the caller's environment stands"
    if gpu is None:
        return out, "rails left to the library (no GPU to be near)"
    near, why = affinity.nearest_nics(root, gpu, affinity.net_devices(root))
    if not near:
        return out, f"rails left to the library: {why}"
    with_ip = {n.name for n in list_nics(root / affinity.NET, addresses=addresses)}
    names = [n.name for n in near if n.name in with_ip]
    if names:
        out["HETCOMM_RAILS"] = ",".join(names)
    if plan.ucx and "UCX_NET_DEVICES" not in environ:
        out["UCX_NET_DEVICES"] = ",".join(n.ucx_name for n in near)
    return out, f"NICs {', '.join(n.name for n in near)}: {why}"


def _numa_cpus(
    root: str | os.PathLike[str], gpu: Gpu | None, allowed: set[int] | None
) -> tuple[tuple[int, ...] | None, str]:
    if gpu is None or gpu.pci is None:
        return None, "CPU affinity unchanged (no GPU with a known PCI address)"
    node = affinity.numa_node(root, gpu.pci)
    if node is None:
        return None, f"CPU affinity unchanged (sysfs gives no NUMA node for {gpu.pci})"
    cpus = affinity.node_cpus(root, node)
    if not cpus:
        return None, f"CPU affinity unchanged (no CPU list for NUMA node {node})"
    if allowed is not None:
        cpus &= allowed
        if not cpus:
            return None, f"CPU affinity unchanged (NUMA node {node}'s CPUs are not allowed here)"
    return tuple(
        sorted(cpus)
    ), f"CPUs of NUMA node {node} ({affinity.format_cpulist(cpus)}), near {gpu.pci}"
