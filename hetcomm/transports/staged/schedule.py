"""The staged transport's pure arithmetic: chunks, ring blocks, the rails two ranks choose."""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping, Sequence
from typing import Any

from . import links


def chunk_spans(nbytes: int, chunk_bytes: int, itemsize: int = 1) -> list[tuple[int, int]]:
    """(offset, length) of each chunk; boundaries fall on whole elements; [] for 0 bytes."""
    if chunk_bytes < itemsize:
        raise ValueError(f"chunk of {chunk_bytes} bytes is smaller than one element ({itemsize})")
    step = chunk_bytes - chunk_bytes % itemsize
    return [(off, min(step, nbytes - off)) for off in range(0, nbytes, step)]


def block_spans(count: int, parts: int) -> list[tuple[int, int]]:
    """(first element, element count) of `parts` near-equal blocks of `count` elements."""
    base, extra = divmod(count, parts)
    spans, start = [], 0
    for i in range(parts):
        n = base + (1 if i < extra else 0)
        spans.append((start, n))
        start += n
    return spans


def choose_rails(me: dict[str, Any], peer: dict[str, Any], mode: str) -> list[links.RailSpec]:
    """The rails joining two ranks, computed identically on both sides from their cards."""
    if mode == "mpi":
        return [links.RailSpec("mpi", 0)]
    if me["node"] == peer["node"] and me["host"] == peer["host"]:
        return [links.RailSpec("shm", 0)]
    mine, theirs = me["addrs"], peer["addrs"]
    if mode == "auto":
        if me["node"] == peer["node"]:
            # simulated hosts on one machine: their traffic is loopback traffic anyway
            mine, theirs = ["127.0.0.1"], ["127.0.0.1"]
        else:
            # real hosts: each NIC pairs with the peer's NIC on the same subnet, so a rail never
            # joins two networks that may not route to each other (or a host-local bridge
            # address that both hosts happen to share)
            mine, theirs = _pair_by_subnet(me, peer)
    specs = [
        links.RailSpec("tcp", i, a, b, peer["ports"][b])
        for i, (a, b) in enumerate(zip(mine, theirs))
    ]
    return specs or [links.RailSpec("mpi", 0)]


# Chunks the fastest tcp rail of a channel may have sent and not yet acknowledged when rail
# weights are known; a slower rail gets fewer, in proportion to its weight.
RAIL_DEPTH = 4


def rail_key(spec: links.RailSpec) -> str:
    """A rail's name without its port (ports change from run to run): 'shm', 'mpi',
    'tcp 10.0.0.5->10.0.0.6'."""
    if spec.kind == "tcp":
        return f"tcp {spec.local}->{spec.remote}"
    return spec.kind


def rail_windows(
    keys: Sequence[str], weights: Mapping[str, float], depth: int = RAIL_DEPTH
) -> list[int | None]:
    """Unacknowledged chunks each rail of one channel may hold: `depth` times its weight over
    the fastest of these rails, at least 1, where every rail has a weight; `depth` each where
    some has none. None (no limit) for every rail unless the channel has two or more tcp rails.

    Without a limit a rail takes the next chunk as soon as its socket buffer has room, so a slow
    rail hoards chunks and finishes last, and a rail whose sender thread runs late (a busy host)
    may find every chunk taken (docs/rails.md); the limit keeps each rail's share near its speed.
    """
    if len(keys) < 2 or any(not k.startswith("tcp ") for k in keys):
        return [None] * len(keys)
    if any(k not in weights for k in keys):
        return [depth] * len(keys)
    top = max(weights[k] for k in keys)
    return [max(1, round(depth * weights[k] / top)) for k in keys]


def _pair_by_subnet(me: dict[str, Any], peer: dict[str, Any]) -> tuple[list[str], list[str]]:
    def nets(card: dict[str, Any]) -> list[tuple[str, Any]]:
        prefixes = card.get("prefixes", {})
        return [
            (a, ipaddress.ip_interface(f"{a}/{prefixes.get(a, 32)}").network)
            for a in card["addrs"]
            if not a.startswith("127.")
        ]

    theirs = nets(peer)
    pairs: list[tuple[str, str]] = []
    used: set[str] = set()
    for a, net in nets(me):
        for b, other in theirs:
            if b not in used and net == other and a != b:
                pairs.append((a, b))
                used.add(b)
                break
    return [a for a, _ in pairs], [b for _, b in pairs]


def slots_that_fit(wanted: int, slot_bytes: int, segments: int) -> int:
    """Slots per shared segment, fewer (down to 2) when /dev/shm is small (containers)."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return wanted
    free = st.f_bavail * st.f_frsize
    fit = free // max(1, 2 * segments * slot_bytes)  # leave half of /dev/shm to others
    return int(max(2, min(wanted, fit)))
