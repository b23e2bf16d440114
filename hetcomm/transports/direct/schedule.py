"""Pure arithmetic of the device-direct transport: shards, algorithm choice, source batches,
which rank of a pair copies, the pieces of several arrays, the overlaps a collective serves."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import numpy as np

from ..spans import ALIGN_BYTES, shards

__all__ = [
    "ALIGN_BYTES",
    "algorithm",
    "batches",
    "copier",
    "peers_args",
    "pieces",
    "served",
    "shards",
    "tables",
]

# All-reduces up to this size read every peer's whole input in one kernel (one-shot); larger
# ones reduce one shard per rank and gather the shards (two-shot). Measured on the H200:
# docs/BENCHMARKS.md, "direct".
ONE_SHOT_BYTES = 256 * 1024
# a peer-reduction kernel reads at most this many sources; more are folded in batches
MAX_SOURCES = 8
# Pieces of all_reduce_coalesced up to this size are reduced together, up to PIECES of them in
# one launch whose parameters hold their table (kernels/reduce.cu, "Pieces"): below it a
# launch costs more than the reduction itself. A larger piece takes launches of its own (16
# bytes per load where it can).
TABLE_BYTES = 256 * 1024
PIECES = 32
PIECES_DTYPE = np.dtype([("n", np.uint64, (PIECES,)), ("p", np.uint64, (PIECES, MAX_SOURCES))])
# one reduce_peers launch's outputs, sources, elements and divisor, its one by-value parameter
# (kernels/reduce.cu, "Peers")
PEERS_DTYPE = np.dtype(
    [
        ("d", np.uint64, (MAX_SOURCES,)),
        ("s", np.uint64, (MAX_SOURCES,)),
        ("n", np.uint64),
        ("div", np.int64),
        ("nout", np.int32),
        ("nsrc", np.int32),
    ]
)


def peers_args(outs: Sequence[int], srcs: Sequence[int], count: int, div: int) -> np.void:
    """The by-value parameter of a reduce_peers launch (unused pointer slots stay zero)."""
    a = np.zeros(1, PEERS_DTYPE)
    a["d"][0, : len(outs)] = outs
    a["s"][0, : len(srcs)] = srcs
    a["n"], a["div"], a["nout"], a["nsrc"] = count, div, len(outs), len(srcs)
    return a[0]


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


def pieces(rows: Sequence[Sequence[tuple[int, int]]]) -> Iterator[tuple[int, list[int]]]:
    """The pieces of several ranks' arrays reduced element by element as one concatenation.

    `rows[r]`: rank r's arrays in order, as (address, bytes); every rank's add up to the same
    total. The concatenation is cut wherever any rank's array ends, so that each piece lies
    within one array of every rank: yields (its bytes, each rank's address of its start), in
    order. Ranks that split the total alike give one piece per (non-empty) array.
    """
    totals = {sum(n for _, n in row) for row in rows}
    if len(totals) != 1:
        raise ValueError(f"pieces: the ranks' arrays add up to different totals {sorted(totals)}")
    cuts = sorted({end for row in rows for end in itertools.accumulate(n for _, n in row)} - {0})
    index = [0] * len(rows)  # each rank's array holding the piece's start
    start = [0] * len(rows)  # where that array starts in the concatenation
    lo = 0
    for hi in cuts:
        at = []
        for r, row in enumerate(rows):
            j = index[r]
            while start[r] + row[j][1] <= lo:  # arrays that end by `lo` (empty ones too)
                start[r] += row[j][1]
                j += 1
            index[r] = j
            at.append(row[j][0] + lo - start[r])
        yield hi - lo, at
        lo = hi


def tables(small: Sequence[tuple[int, Sequence[int]]]) -> Iterator[tuple[np.void, int, int]]:
    """The launch tables of pieces (elements, each rank's address), PIECES at a time: yields
    (the table as the kernel's by-value parameter, its pieces, its longest piece's elements).
    Rows past the pieces and addresses past the ranks stay zero."""
    for lo in range(0, len(small), PIECES):
        chunk = small[lo : lo + PIECES]
        table = np.zeros(1, PIECES_DTYPE)
        for j, (count, at) in enumerate(chunk):
            table["n"][0, j] = count
            table["p"][0, j, : len(at)] = at
        yield table[0], len(chunk), max(count for count, _ in chunk)


def served(op: str, xp: int, nx: int, op_: int, no: int, rank: int, reads_first: bool) -> bool:
    """Whether a collective's steps serve x at `xp` and out at `op_` as they lie: apart, the
    same memory (in place), the in-place forms of NCCL's layout (all_gather's x is this rank's
    block of out, reduce_scatter's out is this rank's block of x), or any overlap where every
    x is read before any out is written (`reads_first`: the shared GPU's all_to_all). Other
    overlaps go to the general path (which copies x first, or refuses)."""
    if xp + nx <= op_ or op_ + no <= xp or reads_first:
        return True
    if op == "all_reduce":
        return xp == op_
    if op == "all_gather":
        return xp == op_ + rank * nx
    if op == "reduce_scatter":
        return op_ == xp + rank * no
    return False
