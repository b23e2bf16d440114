"""Hostfiles and host lists: parsing both common syntaxes, and where each rank will run."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


class HostSpecError(ValueError):
    """A hostfile or host list that cannot be read; the message names the line or entry."""


@dataclass(frozen=True)
class Host:
    """One host and the ranks it takes (None: the file did not say)."""

    name: str
    slots: int | None = None


@dataclass(frozen=True)
class HostList:
    """Hosts in order, and which syntax gave their slot counts ("openmpi", "hydra", "names")."""

    hosts: tuple[Host, ...]
    syntax: str

    def total_slots(self) -> int | None:
        """Sum of the slots, or None when some host did not say."""
        if any(h.slots is None for h in self.hosts):
            return None
        return sum(h.slots or 0 for h in self.hosts)


_OPENMPI_LINE = re.compile(r"^(?P<host>\S+)((\s+\w+\s*=\s*\S+)*)\s*$")
_KEYWORD = re.compile(r"(\w+)\s*=\s*(\S+)")
_HYDRA_ITEM = re.compile(r"^(?P<host>[^\s:]+)(:(?P<slots>\d+))?$")


def _positive(text: str, where: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise HostSpecError(f"{where}: expected a positive slot count, got {text!r}")
    return int(text)


def parse_hostfile(text: str, source: str = "hostfile") -> HostList:
    """Hosts of a hostfile: Open MPI lines ('node1 slots=4') or Hydra lines ('node1:4').

    Comments (#) and blank lines are skipped; a host named twice adds its slots up.
    """
    hosts: list[Host] = []
    syntax = "names"
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source} line {number} ({line!r})"
        hydra = _HYDRA_ITEM.match(line)
        if hydra:
            slots = hydra.group("slots")
            if slots is not None:
                syntax = _one_syntax(syntax, "hydra", where)
            hosts.append(Host(hydra.group("host"), _positive(slots, where) if slots else None))
            continue
        found = _OPENMPI_LINE.match(line)
        if not found:
            raise HostSpecError(f"{where}: expected 'host slots=N' or 'host:N'")
        keys = dict(_KEYWORD.findall(line[len(found.group("host")) :]))
        syntax = _one_syntax(syntax, "openmpi", where)
        slots_text = keys.get("slots") or keys.get("cpu") or keys.get("count")
        value = _positive(slots_text, where) if slots_text is not None else None
        hosts.append(Host(found.group("host"), value))
    if not hosts:
        raise HostSpecError(f"{source} names no host")
    return HostList(_merge(hosts), syntax)


def read_hostfile(path: str | Path) -> HostList:
    """parse_hostfile() of a file, with a clear error when it cannot be read."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise HostSpecError(f"cannot read hostfile {path}: {e.strerror or e}") from None
    return parse_hostfile(text, str(path))


def parse_host_list(spec: str) -> HostList:
    """Hosts of a list such as 'node1:4,node2:4' or 'node1,node2' (the -H / --host syntax)."""
    hosts: list[Host] = []
    for item in spec.split(","):
        item = item.strip()
        found = _HYDRA_ITEM.match(item)
        if not found:
            raise HostSpecError(
                f"host list {spec!r}: expected 'host' or 'host:slots', got {item!r}"
            )
        slots = found.group("slots")
        hosts.append(
            Host(found.group("host"), _positive(slots, f"host {item!r}") if slots else None)
        )
    return HostList(_merge(hosts), "hydra" if any(h.slots for h in hosts) else "names")


def _one_syntax(current: str, seen: str, where: str) -> str:
    if current not in ("names", seen):
        raise HostSpecError(f"{where}: mixes Open MPI ('slots=') and Hydra ('host:N') lines")
    return seen


def _merge(hosts: Sequence[Host]) -> tuple[Host, ...]:
    order: list[str] = []
    slots: dict[str, int | None] = {}
    for h in hosts:
        if h.name not in slots:
            order.append(h.name)
            slots[h.name] = h.slots
        else:
            before = slots[h.name]
            slots[h.name] = None if before is None or h.slots is None else before + h.slots
    return tuple(Host(name, slots[name]) for name in order)


def placement(n: int, hosts: HostList | None) -> list[tuple[str, int]]:
    """(host, local rank) of each rank, as launchers place by slot: fill each host in turn.

    Without hosts every rank is local. A host without a slot count takes one rank per pass;
    ranks beyond the slots start another pass (oversubscription).
    """
    if hosts is None:
        return [("localhost", r) for r in range(n)]
    where: list[tuple[str, int]] = []
    used: dict[str, int] = {}
    while len(where) < n:
        for h in hosts.hosts:
            for _ in range(h.slots or 1):
                if len(where) == n:
                    break
                where.append((h.name, used.get(h.name, 0)))
                used[h.name] = used.get(h.name, 0) + 1
    return where
