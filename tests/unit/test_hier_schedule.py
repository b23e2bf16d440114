"""The hier transport's schedule (hetcomm.transports.hier.schedule), without MPI.

Besides checking each property (shards tile the vector, every send has its matching receive,
every element arrives once from every island), the schedules are run end to end on numpy data
by a small simulator of the islands, and compared with the reduction computed directly.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from hetcomm.transports.hier.schedule import (
    Piece,
    Transfer,
    all_reduce_schedule,
    block_schedule,
    broadcast_entries,
    locate,
    overlaps,
    shard_size,
    shards,
)

ISLANDS = {
    "2+2": [(0, 1), (2, 3)],
    "3+1": [(0, 1, 2), (3,)],
    "1+3": [(0,), (1, 2, 3)],
    "1+1": [(0,), (1,)],
    "1+2+1": [(0,), (1, 2), (3,)],
    "interleaved 2+2": [(0, 2), (1, 3)],
    "3+2+1": [(0, 3, 5), (1, 4), (2,)],
    "one island": [(0, 1, 2)],
}
COUNTS = (0, 1, 2, 3, 4, 5, 7, 10, 64, 1001)


def ranks_of(islands: list[tuple[int, ...]]) -> list[int]:
    return sorted(r for members in islands for r in members)


# ---- shards and overlaps ----------------------------------------------------------------------


@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 7])
def test_shards_tile_the_vector(count: int, parts: int) -> None:
    spans = shards(count, parts)
    size = shard_size(count, parts)
    assert len(spans) == parts
    assert size * parts >= count and (count == 0 or (size - 1) * parts < count)  # the ceiling
    at = 0
    for start, stop in spans:
        assert start == at and start <= stop and stop - start <= size
        at = stop
    assert at == count
    # full shards first: a scratch of parts * size elements is the vector with padding at its end
    for i, (start, _) in enumerate(spans):
        assert start == min(i * size, count)


def test_shards_of_fewer_elements_than_parts() -> None:
    assert shards(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert shards(5, 4) == [(0, 2), (2, 4), (4, 5), (5, 5)]
    assert shards(0, 3) == [(0, 0), (0, 0), (0, 0)]


def test_shards_reject_nonsense() -> None:
    with pytest.raises(ValueError, match="parts must be >= 1, got 0"):
        shards(4, 0)
    with pytest.raises(ValueError, match="count must be >= 0, got -1"):
        shards(-1, 2)


def test_overlaps_match_brute_force() -> None:
    for count, p, q in itertools.product((0, 1, 5, 12, 13), (1, 2, 3, 5), (1, 2, 4)):
        a, b = shards(count, p), shards(count, q)
        want = []
        for (i, (a0, a1)), (j, (b0, b1)) in itertools.product(enumerate(a), enumerate(b)):
            common = [e for e in range(a0, a1) if b0 <= e < b1]
            if common:
                want.append((i, j, common[0], common[-1] + 1))
        assert sorted(overlaps(a, b)) == sorted(want)


def test_locate_and_unknown_rank() -> None:
    assert locate([(0, 2), (1, 3)], 3) == (1, 1)
    with pytest.raises(ValueError, match="rank 4 is in none of the islands"):
        locate([(0, 2), (1, 3)], 4)


# ---- all_reduce --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(ISLANDS))
@pytest.mark.parametrize("count", COUNTS)
def test_all_reduce_exchanges_pair_up_and_cover(name: str, count: int) -> None:
    islands = ISLANDS[name]
    scheds = {r: all_reduce_schedule(islands, count, r) for r in ranks_of(islands)}
    for r, s in scheds.items():
        j, m = locate(islands, r)
        assert (s.island, s.local, s.island_size) == (j, m, len(islands[j]))
        assert (s.start, s.stop) == shards(count, len(islands[j]))[m]
        for t in s.exchanges:
            assert t.island != j and t.peer in islands[t.island]
            # the peer exchanges the very same range with this rank
            assert Transfer(r, j, t.start, t.stop) in scheds[t.peer].exchanges
        # from every other island, the shard arrives exactly once
        for i in range(len(islands)):
            if i == j:
                continue
            got = sorted((t.start, t.stop) for t in s.exchanges if t.island == i)
            at = s.start
            for start, stop in got:
                assert start == at
                at = stop
            assert at == s.stop


@pytest.mark.parametrize("count", [4, 10, 1001])
def test_all_reduce_equal_islands_are_pairwise(count: int) -> None:
    islands = [(0, 1), (2, 3)]
    for r in range(4):
        s = all_reduce_schedule(islands, count, r)
        partner = islands[1 - s.island][s.local]
        assert s.exchanges == (Transfer(partner, 1 - s.island, s.start, s.stop),)


def test_all_reduce_three_and_one() -> None:
    islands = [(0, 1, 2), (3,)]
    assert [all_reduce_schedule(islands, 10, r).exchanges for r in range(3)] == [
        (Transfer(3, 1, 0, 4),),
        (Transfer(3, 1, 4, 8),),
        (Transfer(3, 1, 8, 10),),
    ]
    lone = all_reduce_schedule(islands, 10, 3)
    assert (lone.start, lone.stop, lone.shard) == (0, 10, 10)
    assert lone.exchanges == (Transfer(0, 0, 0, 4), Transfer(1, 0, 4, 8), Transfer(2, 0, 8, 10))
    # fewer elements than members: the third member owns nothing and exchanges nothing
    assert all_reduce_schedule(islands, 2, 2).exchanges == ()
    assert all_reduce_schedule(islands, 2, 3).exchanges == (
        Transfer(0, 0, 0, 1),
        Transfer(1, 0, 1, 2),
    )


def simulate_all_reduce(islands: list[tuple[int, ...]], data: np.ndarray) -> dict[int, np.ndarray]:
    """Run the all-reduce schedule on `data` (one row per rank), summing; each rank's result."""
    count = data.shape[1]
    ranks = ranks_of(islands)
    scheds = {r: all_reduce_schedule(islands, count, r) for r in ranks}
    island_sum = {j: data[list(members)].sum(axis=0) for j, members in enumerate(islands)}
    shard_of = {}
    for r, s in scheds.items():
        partials = {i: np.zeros(s.stop - s.start, data.dtype) for i in range(len(islands))}
        partials[s.island] = island_sum[s.island][s.start : s.stop]
        for t in s.exchanges:
            # what the peer sends: its island's partial, as the peer holds it in its shard
            peer = scheds[t.peer]
            sent = island_sum[peer.island][peer.start : peer.stop][
                t.start - peer.start : t.stop - peer.start
            ]
            partials[t.island][t.start - s.start : t.stop - s.start] = sent
        acc = partials[0].copy()
        for i in range(1, len(islands)):
            acc = acc + partials[i]
        shard_of[r] = acc
    results = {}
    for r, s in scheds.items():
        out = np.zeros(count, data.dtype)
        for member in islands[s.island]:
            ms = scheds[member]
            out[ms.start : ms.stop] = shard_of[member]
        results[r] = out
    return results


@pytest.mark.parametrize("name", list(ISLANDS))
@pytest.mark.parametrize("count", COUNTS)
def test_all_reduce_simulated(name: str, count: int) -> None:
    islands = ISLANDS[name]
    rng = np.random.default_rng(count)
    data = rng.integers(-1000, 1000, (len(ranks_of(islands)), count))
    for r, got in simulate_all_reduce(islands, data).items():
        assert np.array_equal(got, data.sum(axis=0)), f"rank {r}"


# ---- reduce_scatter and all_gather ---------------------------------------------------------------


@pytest.mark.parametrize("name", list(ISLANDS))
@pytest.mark.parametrize("block", [1, 2, 3, 5, 8, 33])
def test_block_pieces_pair_up(name: str, block: int) -> None:
    islands = ISLANDS[name]
    scheds = {r: block_schedule(islands, block, r) for r in ranks_of(islands)}
    for r, s in scheds.items():
        j, _ = locate(islands, r)
        for p in s.held:
            assert p.peer in islands[p.island] and p.count > 0
            assert p.chunk >= 0 and p.chunk + p.count <= s.chunk
            assert p.block >= 0 and p.block + p.count <= block
            # the owner expects this very piece from this holder
            assert Piece(r, j, p.chunk, p.block, p.count) in scheds[p.peer].owned
        for p in s.owned:
            assert Piece(r, j, p.chunk, p.block, p.count) in scheds[p.peer].held
        # every island delivers this rank's whole block, once
        for i in range(len(islands)):
            spans = sorted((p.block, p.block + p.count) for p in s.owned if p.island == i)
            at = 0
            for start, stop in spans:
                assert start == at
                at = stop
            assert at == block


@pytest.mark.parametrize("name", list(ISLANDS))
@pytest.mark.parametrize("block", [1, 2, 3, 5, 33])
def test_block_layout_is_a_bijection(name: str, block: int) -> None:
    islands = ISLANDS[name]
    n = len(ranks_of(islands))
    for members in islands:
        s = block_schedule(islands, block, members[0])
        scratch, full = [], []
        for at, pos, count in s.layout:
            scratch += range(at, at + count)
            full += range(pos, pos + count)
        assert sorted(full) == list(range(n * block))
        assert len(set(scratch)) == len(scratch)
        assert min(scratch) >= 0 and max(scratch) < s.island_size * s.chunk
        # the layout agrees with the pieces each member holds
        for member in members:
            ms = block_schedule(islands, block, member)
            where = {a + k: p + k for a, p, c in ms.layout for k in range(c)}
            for piece in ms.held:
                for k in range(piece.count):
                    at = ms.local * ms.chunk + piece.chunk + k
                    assert where[at] == piece.peer * block + piece.block + k


def test_block_equal_islands_are_pairwise() -> None:
    islands = [(0, 1), (2, 3)]
    for r in range(4):
        s = block_schedule(islands, 6, r)
        across = [p for p in s.held if p.island != s.island]
        partner = islands[1 - s.island][s.local]
        assert [(p.peer, p.block, p.count) for p in across] == [(partner, 0, 6)]


def simulate_reduce_scatter(
    islands: list[tuple[int, ...]], data: np.ndarray, block: int
) -> dict[int, np.ndarray]:
    """Run the block schedule as reduce_scatter on `data` (one row of n*block per rank)."""
    ranks = ranks_of(islands)
    scheds = {r: block_schedule(islands, block, r) for r in ranks}
    chunks = {}
    for members in islands:
        s = scheds[members[0]]
        total = np.zeros(s.island_size * s.chunk, data.dtype)
        for member in members:  # pack each member's x, then the island reduce-scatter (a sum)
            packed = np.zeros_like(total)
            for at, pos, count in s.layout:
                packed[at : at + count] = data[member, pos : pos + count]
            total += packed
        for m, member in enumerate(members):
            chunks[member] = total[m * s.chunk : (m + 1) * s.chunk]
    results = {}
    for r, s in scheds.items():
        rows = np.zeros((len(islands), block), data.dtype)
        for p in s.owned:
            rows[p.island, p.block : p.block + p.count] = chunks[p.peer][
                p.chunk : p.chunk + p.count
            ]
        results[r] = rows.sum(axis=0)
    return results


def simulate_all_gather(islands: list[tuple[int, ...]], data: np.ndarray) -> dict[int, np.ndarray]:
    """Run the block schedule as all_gather of `data` (one block per rank)."""
    block = data.shape[1]
    ranks = ranks_of(islands)
    scheds = {r: block_schedule(islands, block, r) for r in ranks}
    chunks = {}
    for r, s in scheds.items():
        chunk = np.full(s.chunk, -1, data.dtype)
        for p in s.held:
            # the owner sends the piece of its block it lists for this holder
            assert Piece(r, s.island, p.chunk, p.block, p.count) in scheds[p.peer].owned
            chunk[p.chunk : p.chunk + p.count] = data[p.peer, p.block : p.block + p.count]
        chunks[r] = chunk
    results = {}
    for r, s in scheds.items():
        gathered = np.concatenate([chunks[member] for member in islands[s.island]])
        out = np.full(len(ranks) * block, -2, data.dtype)
        for at, pos, count in s.layout:
            out[pos : pos + count] = gathered[at : at + count]
        results[r] = out
    return results


@pytest.mark.parametrize("name", list(ISLANDS))
@pytest.mark.parametrize("block", [1, 2, 3, 7, 64])
def test_block_schedule_simulated(name: str, block: int) -> None:
    islands = ISLANDS[name]
    n = len(ranks_of(islands))
    rng = np.random.default_rng(block)
    data = rng.integers(-1000, 1000, (n, n * block))
    total = data.sum(axis=0)
    for r, got in simulate_reduce_scatter(islands, data, block).items():
        assert np.array_equal(got, total[r * block : (r + 1) * block]), f"reduce_scatter rank {r}"
    blocks = rng.integers(0, 1000, (n, block))
    for r, got in simulate_all_gather(islands, blocks).items():
        assert np.array_equal(got, blocks.reshape(-1)), f"all_gather rank {r}"


def test_block_schedule_three_and_one() -> None:
    islands = [(0, 1, 2), (3,)]
    s = block_schedule(islands, 5, 1)
    # island 0 shards the 5 elements of rank 3's block as 2 + 2 + 1; member 1 holds [2, 4)
    assert (s.chunk, s.offsets) == (7, (0, 5))
    assert s.held == (Piece(1, 0, 0, 0, 5), Piece(3, 1, 5, 2, 2))
    lone = block_schedule(islands, 5, 3)
    assert lone.owned == (
        Piece(0, 0, 5, 0, 2),
        Piece(1, 0, 5, 2, 2),
        Piece(2, 0, 5, 4, 1),
        Piece(3, 1, 15, 0, 5),
    )


def test_block_schedule_rejects_negative_block() -> None:
    with pytest.raises(ValueError, match="block must be >= 0, got -1"):
        block_schedule([(0,), (1,)], -1, 0)


# ---- broadcast --------------------------------------------------------------------------------


def test_broadcast_entries_spread() -> None:
    islands = [(0, 1, 2), (3, 4, 5), (6,)]
    assert broadcast_entries(islands, 4) == [1, 4, 6]
    assert broadcast_entries(islands, 2) == [2, 5, 6]
    assert broadcast_entries(islands, 6) == [0, 3, 6]
