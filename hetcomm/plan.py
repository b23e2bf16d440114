"""The plan: which transport serves an operation, given the members' facts; pure, no MPI."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .errors import TransportUnavailable

OPS = (
    "all_reduce",
    "reduce",
    "broadcast",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "send",
    "recv",
    "barrier",
)
COLLECTIVES = ("all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all")
# Messages at or below this many bytes form the "small" class; the plan may choose per class.
SMALL_BYTES = 64 * 1024
# Device messages above this many bytes go direct (peer mapping) rather than staged where both
# can serve: on the H200 direct was faster from 8 bytes up (docs/lab-notes/benchmarks-2026-11.md,
# "Direct on the GPU"), so the default is 0. A value `hetcomm tune` measured for the topology
# replaces it, and HETCOMM_DIRECT_MIN overrides both; the plan applies it per size class.
DIRECT_MIN_BYTES = 0
SIZE_CLASSES = ("small", "large")


@dataclass(frozen=True)
class Member:
    """What the plan needs to know of one member of a group."""

    rank: int
    host: str
    vendor: str
    device: str | None  # a stable device identity (UUID, or host:index); None on CPU ranks
    gpu_aware: bool


@dataclass(frozen=True)
class Choice:
    """A transport and the reason it was chosen."""

    transport: str
    reason: str


def size_class(nbytes: int) -> str:
    """'small' up to SMALL_BYTES, 'large' above."""
    return "small" if nbytes <= SMALL_BYTES else "large"


def islands(members: Sequence[Member]) -> list[tuple[int, ...]]:
    """Members grouped by (host, vendor), in order of first appearance: the vendor islands."""
    found: dict[tuple[str, str], list[int]] = {}
    for m in members:
        found.setdefault((m.host, m.vendor), []).append(m.rank)
    return [tuple(r) for r in found.values()]


def choose(
    members: Sequence[Member],
    *,
    op: str,
    memory: str,
    nbytes: int,
    requested: str,
    unavailable: Mapping[str, str | None],
    group: str,
    direct_min: int | None = DIRECT_MIN_BYTES,
) -> Choice:
    """Pick the transport for `op` on `memory` ('host' or 'device') of `nbytes` bytes.

    `requested` is 'auto' or a forced transport name; `unavailable` maps every known transport
    to None when it can serve this group or to the reason it cannot (not installed, not built in
    this version, library missing). Raises TransportUnavailable, naming why, when the forced
    transport cannot work or when nothing can move this memory; nothing falls back silently.
    """
    if op not in OPS:
        raise ValueError(f"unknown operation {op!r}")
    if direct_min is None:  # a Config that hetcomm.init() has not resolved
        direct_min = DIRECT_MIN_BYTES
    if memory not in ("host", "device"):
        raise ValueError(f"memory must be 'host' or 'device', got {memory!r}")
    not_aware = [m.rank for m in members if not m.gpu_aware]
    if requested != "auto":
        why = _cannot(requested, members, op, memory, unavailable, not_aware)
        if why is not None:
            raise TransportUnavailable(
                f"group '{group}': HETCOMM_TRANSPORT asks for '{requested}' for {op} on "
                f"{memory} buffers, but {why}"
            )
        return Choice(requested, "forced by HETCOMM_TRANSPORT")
    if memory == "host":
        return Choice("mpi", "host buffers: MPI moves them directly")
    return _choose_device(members, op, nbytes, unavailable, not_aware, group, direct_min)


def _cannot(
    name: str,
    members: Sequence[Member],
    op: str,
    memory: str,
    unavailable: Mapping[str, str | None],
    not_aware: list[int],
) -> str | None:
    if name not in unavailable:
        return f"'{name}' is not a transport of this installation ({', '.join(unavailable)})"
    reason = unavailable[name]
    if reason is not None:
        return reason
    if name == "mpi" and memory == "device" and not_aware:
        return (
            f"the MPI library is not GPU-aware on ranks {not_aware}: a device pointer would "
            "crash it"
        )
    if name == "nccl" and memory == "host" and op != "barrier":  # a barrier moves no buffer
        return "NCCL moves device buffers only"
    return None


def _choose_device(
    members: Sequence[Member],
    op: str,
    nbytes: int,
    unavailable: Mapping[str, str | None],
    not_aware: list[int],
    group: str,
    direct_min: int = DIRECT_MIN_BYTES,
) -> Choice:
    usable = {name for name, reason in unavailable.items() if reason is None}
    vendors = sorted({m.vendor for m in members})
    devices = [m.device for m in members]
    shared = len(set(devices)) < len(devices)
    parts = islands(members)
    rejected: list[str] = []
    deviceless = [m.rank for m in members if m.device is None]
    if len(vendors) == 1 and vendors[0] != "cpu":
        if deviceless:
            rejected.append(f"nccl: no device on ranks {deviceless} (a simulated vendor?)")
        elif shared:
            rejected.append("nccl: two ranks share a device (NCCL refuses a duplicate GPU)")
        elif "nccl" in usable:
            lib = "RCCL" if vendors[0] == "amd" else "NCCL"
            return Choice("nccl", f"every member is {vendors[0]} with its own device: {lib}")
        else:
            rejected.append(f"nccl: {unavailable.get('nccl') or 'not installed'}")
    else:
        rejected.append(
            "nccl: CPU-only members"
            if vendors == ["cpu"]
            else f"nccl: members span vendors {', '.join(vendors)}"
        )
    # one host whose GPUs map each other's memory: one hop over memory beats any hierarchy, even
    # across (simulated) vendor islands; real islands of two vendors cannot map each other
    hosts = {m.host for m in members}
    # the crossover applies per size class: a small message goes direct when the class can
    large = nbytes > SMALL_BYTES
    if len(hosts) == 1 and (nbytes > direct_min if large else direct_min < SMALL_BYTES):
        if "direct" in usable:
            return Choice("direct", "one host, peer memory mapped: GPU-to-GPU copies")
        rejected.append(f"direct: {unavailable.get('direct') or 'not installed'}")
    elif len(hosts) == 1:
        rejected.append(f"direct: messages up to {direct_min} bytes go staged (HETCOMM_DIRECT_MIN)")
    if len(parts) > 1 and op in COLLECTIVES:
        if "hier" in usable:
            return Choice(
                "hier", f"{len(parts)} vendor islands: native inside, staged/direct between"
            )
        rejected.append(f"hier: {unavailable.get('hier') or 'not installed'}")
    if not_aware:
        rejected.append(f"mpi: not GPU-aware on ranks {not_aware}")
    elif "mpi" in usable:
        return Choice("mpi", "the MPI library is GPU-aware on every member")
    else:
        rejected.append(f"mpi: {unavailable.get('mpi') or 'not installed'}")
    if "staged" in usable:
        return Choice(
            "staged",
            "no native library or GPU-aware MPI serves these members: "
            "staged copies through pinned host memory",
        )
    rejected.append(f"staged: {unavailable.get('staged') or 'not installed'}")
    exc = TransportUnavailable(
        f"group '{group}': no transport can move device buffers for {op}: " + "; ".join(rejected)
    )
    exc.why = "no transport: " + "; ".join(rejected)  # type: ignore[attr-defined]
    raise exc


@dataclass(frozen=True)
class PlanTable:
    """The choice for every operation, memory kind and size class of one group, printable."""

    group: str
    rows: tuple[tuple[str, str, str, str, str], ...]  # op, memory, size class, transport, reason

    def lookup(self, op: str, memory: str, cls: str) -> tuple[str, str]:
        """(transport, reason) of one row."""
        for row in self.rows:
            if row[:3] == (op, memory, cls):
                return row[3], row[4]
        raise KeyError((op, memory, cls))

    def __str__(self) -> str:
        # rows that share a transport and reason print as one line
        merged: dict[tuple[str, str, str], list[tuple[str, str]]] = {}
        for op, memory, cls, transport, reason in self.rows:
            merged.setdefault((memory, transport, reason), []).append((op, cls))
        lines = [f"plan of group '{self.group}':"]
        for (memory, transport, reason), cases in merged.items():
            ops = list(dict.fromkeys(op for op, _ in cases))
            classes = sorted({cls for _, cls in cases})
            every = [op for op in OPS if memory == "host" or op != "barrier"]
            which = "every op" if ops == every else ", ".join(ops)
            if len(classes) == 1:
                which += f" ({classes[0]})"
            lines.append(f"  {memory:6} {which} -> {transport}: {reason}")
        return "\n".join(lines)


def plan_table(
    members: Sequence[Member],
    *,
    requested: str,
    unavailable: Mapping[str, str | None],
    group: str,
    memories: Sequence[str] = ("host", "device"),
    direct_min: int | None = DIRECT_MIN_BYTES,
) -> PlanTable:
    """Every (op, memory, size class) choice; a choice that raises shows as 'none' with why."""
    rows = []
    for memory in memories:
        for op in OPS:
            if op == "barrier" and memory == "device":
                continue  # a barrier moves no buffer
            for cls, nbytes in (("small", SMALL_BYTES), ("large", SMALL_BYTES * 1024)):
                try:
                    c = choose(
                        members,
                        op=op,
                        memory=memory,
                        nbytes=nbytes,
                        requested=requested,
                        unavailable=unavailable,
                        group=group,
                        direct_min=direct_min,
                    )
                    rows.append((op, memory, cls, c.transport, c.reason))
                except TransportUnavailable as exc:
                    why = getattr(exc, "why", None) or str(exc).partition(", but ")[2] or str(exc)
                    rows.append((op, memory, cls, "none", why))
    return PlanTable(group, tuple(rows))
