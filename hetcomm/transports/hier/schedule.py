"""The hier transport's pure arithmetic: shards over an island, and who exchanges which elements."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

Islands = Sequence[Sequence[int]]


def shard_size(count: int, parts: int) -> int:
    """Elements per shard when `count` elements are cut into `parts` shards: ceil(count/parts)."""
    _check(count, parts)
    return -(-count // parts)


def shards(count: int, parts: int) -> list[tuple[int, int]]:
    """[start, stop) of each of `parts` shards of `count` elements.

    Every shard but the last ones holds shard_size(count, parts) elements, so that a scratch of
    parts * shard_size elements is the vector padded at its end; the last shards are shorter or
    empty (more parts than elements).
    """
    size = shard_size(count, parts)
    return [(min(i * size, count), min((i + 1) * size, count)) for i in range(parts)]


def overlaps(
    a: Sequence[tuple[int, int]], b: Sequence[tuple[int, int]]
) -> list[tuple[int, int, int, int]]:
    """(i, j, start, stop) for every non-empty intersection of span i of `a` with span j of `b`."""
    found = []
    for i, (a0, a1) in enumerate(a):
        for j, (b0, b1) in enumerate(b):
            lo, hi = max(a0, b0), min(a1, b1)
            if lo < hi:
                found.append((i, j, lo, hi))
    return found


def locate(islands: Islands, rank: int) -> tuple[int, int]:
    """(island index, index inside the island) of group rank `rank`."""
    for i, members in enumerate(islands):
        for k, r in enumerate(members):
            if r == rank:
                return i, k
    raise ValueError(f"rank {rank} is in none of the islands {[list(m) for m in islands]}")


# ---- all_reduce: every island shards the whole vector ----------------------------------------


@dataclass(frozen=True)
class Transfer:
    """Elements [start, stop) of the vector, exchanged with group rank `peer` of island `island`."""

    peer: int
    island: int
    start: int
    stop: int


@dataclass(frozen=True)
class AllReduceSchedule:
    """One rank's part of a hierarchical all-reduce of `count` elements.

    Inside its island the rank owns [start, stop) (shard_size `shard`, padded). It sends its
    island's partial of each Transfer's range to that peer and receives the peer's island's
    partial of the same range: each element of [start, stop) arrives exactly once from every
    other island.
    """

    island: int
    local: int
    island_size: int
    shard: int
    start: int
    stop: int
    exchanges: tuple[Transfer, ...]


def all_reduce_schedule(islands: Islands, count: int, rank: int) -> AllReduceSchedule:
    """The shard of `rank` and the ranks of other islands whose shards overlap it."""
    j, m = locate(islands, rank)
    mine = shards(count, len(islands[j]))
    start, stop = mine[m]
    exchanges = []
    for i, members in enumerate(islands):
        if i == j:
            continue
        for _, k, lo, hi in overlaps([(start, stop)], shards(count, len(members))):
            exchanges.append(Transfer(members[k], i, lo, hi))
    return AllReduceSchedule(
        j, m, len(islands[j]), shard_size(count, len(islands[j])), start, stop, tuple(exchanges)
    )


# ---- reduce_scatter and all_gather: blocks of `block` elements, one per rank -----------------


@dataclass(frozen=True)
class Piece:
    """`count` elements moving between a chunk (at `chunk`) held by one rank and the block (at
    `block`) of another; `peer` is the rank at the other end, `island` the island whose chunk
    it is (owner side) or whose block it is (holder side)."""

    peer: int
    island: int
    chunk: int
    block: int
    count: int


@dataclass(frozen=True)
class BlockSchedule:
    """One rank's part of a hierarchical reduce_scatter or all_gather of `block`-element blocks.

    Inside island j, the blocks of each island l (its members' blocks, in island order: a vector
    of len(l) * block elements) are sharded over j's members; member m's chunk is its shard of
    every island's blocks, one after another (island l's at `offsets[l]`), padded to `chunk`.

    `held` lists the pieces of this rank's chunk and the ranks whose blocks they belong to
    (reduce_scatter sends them there; all_gather receives them from there). `owned` lists the
    pieces of this rank's own block and the rank of each island holding them (reduce_scatter
    receives one partial per island; all_gather sends the block out). `layout` maps the
    island's scratch of island_size * chunk elements to the full vector of every rank's block
    in rank order: (scratch position, vector position, count).
    """

    island: int
    local: int
    island_size: int
    chunk: int
    offsets: tuple[int, ...]
    held: tuple[Piece, ...]
    owned: tuple[Piece, ...]
    layout: tuple[tuple[int, int, int], ...]


def _offsets(islands: Islands, block: int, parts: int) -> list[int]:
    """Where each island's shard starts in a chunk of an island of `parts` members; the chunk
    size comes last."""
    offs, at = [], 0
    for members in islands:
        offs.append(at)
        at += shard_size(len(members) * block, parts)
    offs.append(at)
    return offs


def block_schedule(islands: Islands, block: int, rank: int) -> BlockSchedule:
    """The chunk layout of `rank`'s island and the pieces `rank` exchanges, for `block` > 0."""
    if block < 0:
        raise ValueError(f"block must be >= 0, got {block}")
    j, m = locate(islands, rank)
    size = len(islands[j])
    offs = _offsets(islands, block, size)
    held: list[Piece] = []
    layout: list[tuple[int, int, int]] = []
    for i, members in enumerate(islands):
        length = len(members) * block
        owners = shards(length, len(members))  # equal blocks: no padding
        for k, (a, b) in enumerate(shards(length, size)):
            for _, q, lo, hi in overlaps([(a, b)], owners):
                at = offs[i] + lo - a
                layout.append((k * offs[-1] + at, members[q] * block + lo - q * block, hi - lo))
                if k == m:
                    held.append(Piece(members[q], i, at, lo - q * block, hi - lo))
    owned: list[Piece] = []
    mine = (m * block, (m + 1) * block)
    for i, members in enumerate(islands):
        theirs = shards(size * block, len(members))
        there = _offsets(islands, block, len(members))
        for k, _, lo, hi in overlaps(theirs, [mine]):
            owned.append(Piece(members[k], i, there[j] + lo - theirs[k][0], lo - mine[0], hi - lo))
    return BlockSchedule(
        j, m, size, offs[-1], tuple(offs[:-1]), tuple(held), tuple(owned), tuple(layout)
    )


def broadcast_entries(islands: Islands, root: int) -> list[int]:
    """The rank of each island that receives from `root` and broadcasts inside its island:
    `root` in its own island, elsewhere the member at root's index (modulo the island's size),
    so that entries spread over the members rather than piling up on the first ones."""
    j, m = locate(islands, root)
    return [root if i == j else members[m % len(members)] for i, members in enumerate(islands)]


def _check(count: int, parts: int) -> None:
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
