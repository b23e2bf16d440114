"""Pure arithmetic of the device-direct transport: shards, algorithm choice, source batches,
which rank of a pair copies."""

from __future__ import annotations

from ..spans import ALIGN_BYTES, shards

__all__ = ["ALIGN_BYTES", "algorithm", "batches", "copier", "shards"]

# All-reduces up to this size read every peer's whole input in one kernel (one-shot); larger
# ones reduce one shard per rank and gather the shards (two-shot). Measured on the H200:
# docs/BENCHMARKS.md, "direct".
ONE_SHOT_BYTES = 256 * 1024
# a peer-reduction kernel reads at most this many sources; more are folded in batches
MAX_SOURCES = 8


def algorithm(nbytes: int, size: int) -> str:
    """'one-shot' or 'two-shot' for an all-reduce of `nbytes` over `size` ranks."""
    return "one-shot" if size == 1 or nbytes <= ONE_SHOT_BYTES else "two-shot"


def batches(sources: list[int]) -> list[list[int]]:
    """Sources in groups the kernel takes at once; every group after the first starts with the
    running result (marked -1), so the order of reduction stays the rank order."""
    if not sources:
        raise ValueError("batches: no sources")
    out = [sources[:MAX_SOURCES]]
    rest = sources[MAX_SOURCES:]
    while rest:
        out.append([-1, *rest[: MAX_SOURCES - 1]])
        rest = rest[MAX_SOURCES - 1 :]
    return out


def copier(src: int, dst: int, devices: list[str | None]) -> int:
    """The rank that copies a message from rank `src` to rank `dst` (`devices[r]` identifies
    rank r's device).

    On separate devices the receiver copies (it reads the sender's memory). Where the two share
    one device, the lower rank copies in both directions (pulling what it receives, pushing what
    it sends): copies queued by two processes in turn make the GPU switch between their
    contexts, about 145 us a switch on the H200 (64 KiB copies in turn: 161 us each; all by one
    process: 17 us; docs/BENCHMARKS.md), and a pair's messages often go both ways (pipeline
    stages: activations forward, gradients back).
    """
    if src == dst:
        raise ValueError(f"copier: a message from rank {src} to itself")
    if devices[src] is not None and devices[src] == devices[dst]:
        return min(src, dst)
    return dst
