"""Network interfaces this host can use as rails: discovery and the rail specification."""

from __future__ import annotations

import errno
import ipaddress
import itertools
import logging
import os
import socket
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "Nic",
    "RailSpecError",
    "addresses_of",
    "describe",
    "list_nics",
    "parse_rails",
    "shared_subnet_warnings",
]

log = logging.getLogger(__name__)

SIOCGIFADDR = 0x8915
SIOCGIFNETMASK = 0x891B
IFF_UP = 0x1
IFF_LOOPBACK = 0x8
ARPHRD_LOOPBACK = 772
_IFNAMSIZ = 16
_LOOPBACK_NET = ipaddress.IPv4Network("127.0.0.0/8")


class RailSpecError(ValueError):
    """HETCOMM_RAILS (or another rail specification) cannot be satisfied on this host."""


@dataclass(frozen=True)
class Nic:
    """One IPv4-addressed network interface (one rail)."""

    name: str
    ipv4: str
    prefixlen: int
    speed_mbps: int | None = None

    def __post_init__(self) -> None:
        ipaddress.IPv4Address(self.ipv4)  # raises ValueError on a malformed address
        if not 0 <= self.prefixlen <= 32:
            raise ValueError(f"prefix length {self.prefixlen} of {self.name} is not in 0..32")

    @property
    def subnet(self) -> str:
        """The network this address is on, e.g. '10.0.0.0/24'."""
        return str(ipaddress.IPv4Interface(f"{self.ipv4}/{self.prefixlen}").network)


def _ioctl_addr(sock: socket.socket, request: int, name: str) -> str:
    import fcntl  # Unix only; imported here so the module still imports elsewhere

    ifreq = struct.pack(f"{_IFNAMSIZ}s{_IFNAMSIZ}x", name.encode()[: _IFNAMSIZ - 1])
    res = fcntl.ioctl(sock.fileno(), request, ifreq)
    return socket.inet_ntoa(res[20:24])  # ifr_name[16], sockaddr_in{family, port, addr}


def addresses_of(name: str) -> list[tuple[str, int]]:
    """(IPv4 address, prefix length) of interface `name` via ioctl; [] when it has none.

    SIOCGIFADDR reports only the primary address of an interface: alias/secondary addresses
    (``ip addr add`` on an interface that already has one) are out of scope, so the result
    holds at most one entry.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            addr = _ioctl_addr(sock, SIOCGIFADDR, name)
            mask = _ioctl_addr(sock, SIOCGIFNETMASK, name)
        except OSError as e:
            if e.errno in (errno.EADDRNOTAVAIL, errno.ENODEV, errno.ENXIO):
                return []  # no IPv4 address, or the interface vanished meanwhile
            raise
    return [(addr, ipaddress.IPv4Network(f"0.0.0.0/{mask}").prefixlen)]


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _read_int(path: Path, base: int = 10) -> int | None:
    text = _read(path)
    if text is None:
        return None
    try:
        return int(text, base)
    except ValueError:
        return None


def _is_virtual(entry: Path) -> bool:
    parts = Path(os.path.realpath(entry)).parts
    return ("devices", "virtual") in itertools.pairwise(parts)


def _speed(entry: Path) -> int | None:
    if _is_virtual(entry):  # veth, bridges, ... report made-up speeds, or none
        return None
    speed = _read_int(entry / "speed")  # reading it fails with EINVAL while link is down
    return speed if speed is not None and speed > 0 else None


def list_nics(
    sysfs: str | os.PathLike[str] = "/sys/class/net",
    include_loopback: bool = False,
    addresses: Callable[[str], list[tuple[str, int]]] | None = None,
) -> list[Nic]:
    """Interfaces that are up and have an IPv4 address, sorted by name.

    An interface counts as up when its operstate is "up", or "unknown" (many virtual NICs,
    loopback included, report that while working) with IFF_UP set in its flags. Only the
    first address `addresses(name)` gives is used.
    """
    get_addresses = addresses_of if addresses is None else addresses
    root = Path(sysfs)
    try:
        entries = sorted(p for p in root.iterdir() if p.is_dir())  # skips bonding_masters
    except OSError:
        log.debug("cannot list %s; no network interfaces found", root)
        return []
    nics: list[Nic] = []
    for entry in entries:
        name = entry.name
        operstate = (_read(entry / "operstate") or "").lower()
        flags = _read_int(entry / "flags", 16) or 0
        if not (operstate == "up" or (operstate == "unknown" and flags & IFF_UP)):
            log.debug("skipping %s: operstate %r, flags %#x", name, operstate, flags)
            continue
        loopback = (
            name == "lo"
            or bool(flags & IFF_LOOPBACK)
            or _read_int(entry / "type") == ARPHRD_LOOPBACK
        )
        if loopback and not include_loopback:
            continue
        addrs = get_addresses(name)
        if not addrs:
            log.debug("skipping %s: no IPv4 address", name)
            continue
        ipv4, prefixlen = addrs[0]
        nics.append(Nic(name, ipv4, prefixlen, _speed(entry)))
    return nics


def _inventory(nics: Sequence[Nic]) -> str:
    if not nics:
        return "no usable network interface (up, non-loopback, with an IPv4 address)"
    return ", ".join(f"{n.name} ({n.ipv4}/{n.prefixlen})" for n in nics)


def parse_rails(spec: str, nics: Sequence[Nic], *, loopback_ok: bool = True) -> list[Nic]:
    """Resolve a rail specification ("auto", or interface names / IPv4 addresses) to NICs."""
    has = _inventory(nics)
    tokens = [t.strip() for t in spec.split(",")]
    if not spec.strip():
        raise RailSpecError(
            "HETCOMM_RAILS is empty; give 'auto' or a comma-separated list of interface names "
            f"or IPv4 addresses (this host has {has})"
        )
    if "" in tokens:
        raise RailSpecError(f"HETCOMM_RAILS {spec!r} has an empty entry (this host has {has})")
    if any(t.lower() == "auto" for t in tokens):
        if len(tokens) > 1:
            raise RailSpecError(
                f"HETCOMM_RAILS {spec!r} combines 'auto' with other entries; "
                "give either 'auto' or a list of interfaces"
            )
        if not nics:
            raise RailSpecError(f"HETCOMM_RAILS is 'auto', but this host has {has}")
        return list(nics)

    rails: list[Nic] = []
    asked_as: dict[tuple[str, str], str] = {}
    for token in tokens:
        try:
            addr: ipaddress.IPv4Address | None = ipaddress.IPv4Address(token)
        except ValueError:
            addr = None
        if addr is None:
            nic = next((n for n in nics if n.name == token), None)
            if nic is None:
                raise RailSpecError(f"HETCOMM_RAILS names {token!r}, but this host has {has}")
        else:
            nic = next((n for n in nics if ipaddress.IPv4Address(n.ipv4) == addr), None)
            if nic is None and addr in _LOOPBACK_NET and loopback_ok:
                nic = Nic(name="lo", ipv4=str(addr), prefixlen=8, speed_mbps=None)
            if nic is None:
                hint = " (loopback addresses are not allowed here)" if addr.is_loopback else ""
                raise RailSpecError(
                    f"HETCOMM_RAILS names address {token!r}, which no interface on this host "
                    f"has{hint}; this host has {has}"
                )
        key = (nic.name, nic.ipv4)
        if key in asked_as:
            raise RailSpecError(
                f"HETCOMM_RAILS {spec!r} selects {nic.name} ({nic.ipv4}) twice "
                f"(as {asked_as[key]!r} and {token!r})"
            )
        asked_as[key] = token
        rails.append(nic)
    return rails


def shared_subnet_warnings(rails: Sequence[Nic]) -> list[str]:
    """One message per group of two or more (non-loopback) rails on the same subnet."""
    groups: dict[str, list[Nic]] = {}
    for rail in rails:
        if rail.name == "lo" or ipaddress.IPv4Address(rail.ipv4) in _LOOPBACK_NET:
            continue
        groups.setdefault(rail.subnet, []).append(rail)
    messages = []
    for subnet, group in groups.items():
        if len(group) < 2:
            continue
        named = [f"{r.name} ({r.ipv4})" for r in group]
        listed = f"{', '.join(named[:-1])} and {named[-1]}"
        which = "both" if len(group) == 2 else "all of them"
        messages.append(
            f"rails {listed} share subnet {subnet}: Linux routes {which} through one interface, "
            "so they will not add bandwidth"
        )
    return messages


def describe(nics: Sequence[Nic]) -> str:
    """One line per NIC, e.g. 'eth0  10.0.0.5/24  25000 Mb/s' ('speed ?' when unknown)."""
    rows = [
        (
            n.name,
            f"{n.ipv4}/{n.prefixlen}",
            "speed ?" if n.speed_mbps is None else f"{n.speed_mbps} Mb/s",
        )
        for n in nics
    ]
    w_name = max((len(r[0]) for r in rows), default=0)
    w_addr = max((len(r[1]) for r in rows), default=0)
    return "\n".join(f"{a.ljust(w_name)}  {b.ljust(w_addr)}  {c}" for a, b, c in rows)
