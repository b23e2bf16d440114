"""Pure parts of the device-direct transport: shards, the algorithm choice, source batches."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from hetcomm import kernels
from hetcomm.transports.direct import schedule
from hetcomm.transports.direct.transport import group_unavailable


@pytest.mark.parametrize("count", [0, 1, 3, 4, 5, 17, 1000, 1 << 20, (1 << 20) + 3])
@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
@pytest.mark.parametrize("size", [1, 2, 3, 4, 7, 8])
def test_shards_cover_in_order_and_stay_aligned(count, itemsize, size):
    spans = schedule.shards(count, itemsize, size)
    assert len(spans) == size
    assert spans[0][0] == 0 and spans[-1][1] == count
    for (a, b), (c, _) in itertools.pairwise(spans):
        assert a <= b == c
    unit = schedule.ALIGN_BYTES // itemsize
    for a, _ in spans:
        assert a == count or (a * itemsize) % schedule.ALIGN_BYTES == 0
    lengths = [b - a for a, b in spans]
    assert max(lengths) - min(lengths) <= 2 * unit  # the last shard also takes the tail


def test_shards_reject_nonsense():
    with pytest.raises(ValueError):
        schedule.shards(10, 4, 0)
    with pytest.raises(ValueError):
        schedule.shards(-1, 4, 2)


def test_algorithm_by_size():
    assert schedule.algorithm(schedule.ONE_SHOT_BYTES, 4) == "one-shot"
    assert schedule.algorithm(schedule.ONE_SHOT_BYTES + 1, 4) == "two-shot"
    assert schedule.algorithm(1 << 30, 1) == "one-shot"


@pytest.mark.parametrize("n", [1, 2, 8, 9, 15, 16, 30])
def test_batches_keep_rank_order_and_fit_the_kernel(n):
    groups = schedule.batches(list(range(n)))
    assert all(len(g) <= schedule.MAX_SOURCES for g in groups)
    assert [s for g in groups for s in g if s >= 0] == list(range(n))
    assert all(g[0] == -1 for g in groups[1:])


def test_group_rules_name_the_reason():
    assert group_unavailable(["h", "h"], ["nvidia", "nvidia"], ["a", "b"]) is None
    assert "2 hosts" in group_unavailable(["h", "g"], ["nvidia"] * 2, ["a", "b"])
    assert "no device" in group_unavailable(["h", "h"], ["nvidia"] * 2, ["a", None])
    assert "vendors amd, nvidia" in group_unavailable(["h", "h"], ["nvidia", "amd"], ["a", "b"])


def test_one_rank_of_a_pair_sharing_a_device_copies_both_ways():
    shared = ["gpu0", "gpu0", "gpu0", "gpu1", None]
    # one device: the lower rank copies, whichever way the message goes
    for src, dst in [(0, 1), (1, 0), (2, 1), (1, 2), (0, 2), (2, 0)]:
        assert schedule.copier(src, dst, shared) == min(src, dst)
    # separate devices (or none known): the receiver copies
    for src, dst in [(0, 3), (3, 0), (2, 3), (3, 4), (4, 3)]:
        assert schedule.copier(src, dst, shared) == dst
    assert schedule.copier(1, 0, ["gpu0", "gpu0"]) == schedule.copier(0, 1, ["gpu0", "gpu0"]) == 0
    with pytest.raises(ValueError, match="itself"):
        schedule.copier(2, 2, shared)


def _reference_pieces(rows):
    """Element by element: each byte's address on every rank, grouped into maximal runs that
    stay within one array of every rank (the cuts pieces() must make)."""
    per_rank = []
    for row in rows:
        owner = []
        for j, (addr, n) in enumerate(row):
            owner += [(j, addr + k) for k in range(n)]
        per_rank.append(owner)
    out = []
    for i in range(len(per_rank[0])):
        arrays = tuple(r[i][0] for r in per_rank)
        if out and out[-1][0] == arrays:
            out[-1][1] += 1
        else:
            out.append([arrays, 1, [r[i][1] for r in per_rank]])
    return [(n, at) for _, n, at in out]


@pytest.mark.parametrize("seed", range(40))
def test_pieces_cut_where_any_rank_array_ends(seed):
    """Random splits of one total over 1-4 ranks (empty arrays included): the pieces cover
    the concatenation in order, each within one array of every rank, at the right addresses."""
    import random

    rnd = random.Random(seed)
    total = rnd.randint(0, 40)
    rows = []
    for r in range(rnd.randint(1, 4)):
        cuts = sorted(rnd.randint(0, total) for _ in range(rnd.randint(0, 4)))
        sizes = [b - a for a, b in itertools.pairwise([0, *cuts, total])]
        rows.append([(1000 * (r + 1) + 100 * j, n) for j, n in enumerate(sizes)])
    assert list(schedule.pieces(rows)) == _reference_pieces(rows)


def test_pieces_of_ranks_split_alike_are_their_arrays():
    rows = [[(10, 8), (50, 0), (90, 4)], [(20, 8), (60, 0), (70, 4)]]
    assert list(schedule.pieces(rows)) == [(8, [10, 20]), (4, [90, 70])]


def test_pieces_refuse_different_totals():
    with pytest.raises(ValueError, match="different totals"):
        list(schedule.pieces([[(0, 8)], [(0, 4)]]))


@pytest.mark.parametrize("count", [0, 1, 31, 32, 33, 70])
@pytest.mark.parametrize("ranks", [1, 3, 8])
def test_tables_hold_every_piece_once_padded_with_zeros(count, ranks):
    """Pieces in launch tables of PIECES: each piece's elements and every rank's address in
    order, nothing else set, the longest piece of each table named."""
    import random

    rnd = random.Random(count * 10 + ranks)
    small = [
        (rnd.randint(1, 1 << 16), [rnd.randint(1, 1 << 48) for _ in range(ranks)])
        for _ in range(count)
    ]
    got = []
    for table, npieces, longest in schedule.tables(small):
        assert isinstance(table, np.void) and table.dtype == schedule.PIECES_DTYPE
        assert 1 <= npieces <= schedule.PIECES
        n, p = table["n"], table["p"]
        assert not n[npieces:].any() and not p[npieces:].any() and not p[:, ranks:].any()
        rows = [(int(n[j]), [int(a) for a in p[j, :ranks]]) for j in range(npieces)]
        assert longest == max(c for c, _ in rows)
        got += rows
    assert got == small
    assert len(list(schedule.tables(small))) == -(-count // schedule.PIECES)


def test_tables_fit_the_kernel_parameters():
    """The table is the kernel's by-value parameter (kernels/reduce.cu, "Pieces"): its size
    there, and under the 4 KiB CUDA and HIP allow a launch's parameters."""
    assert schedule.PIECES_DTYPE.itemsize == schedule.PIECES * (1 + schedule.MAX_SOURCES) * 8
    assert schedule.PIECES_DTYPE.itemsize + 16 <= 4096
    source = (Path(kernels.__file__).parent / "reduce.cu").read_text()
    assert f"#define PIECES {schedule.PIECES}\n" in source


@pytest.mark.parametrize(
    ("op", "x_at", "nx", "out_at", "no", "rank", "reads_first", "want"),
    [
        # apart (either order, touching ends) and the same memory
        ("all_reduce", 0, 64, 64, 64, 0, False, True),
        ("all_reduce", 128, 64, 0, 128, 3, False, True),
        ("all_reduce", 0, 64, 0, 64, 1, False, True),
        ("all_reduce", 0, 64, 32, 64, 0, False, False),  # partly: the general path refuses it
        # all_gather: x is this rank's block of out, and no other block
        ("all_gather", 1000 + 2 * 16, 16, 1000, 64, 2, False, True),
        ("all_gather", 1000 + 1 * 16, 16, 1000, 64, 2, False, False),
        ("all_gather", 1000 + 2 * 16 + 4, 16, 1000, 64, 2, False, False),
        # reduce_scatter: out is this rank's block of x
        ("reduce_scatter", 1000, 64, 1000 + 3 * 16, 16, 3, False, True),
        ("reduce_scatter", 1000, 64, 1000 + 2 * 16, 16, 3, False, False),
        # all_to_all: any overlap where every x is read before an out is written, else none
        ("all_to_all", 0, 64, 16, 64, 1, True, True),
        ("all_to_all", 0, 64, 0, 64, 1, True, True),
        ("all_to_all", 0, 64, 0, 64, 1, False, False),
        ("all_to_all", 0, 64, 64, 64, 1, False, True),
    ],
)
def test_the_overlaps_a_collective_serves(op, x_at, nx, out_at, no, rank, reads_first, want):
    assert schedule.served(op, x_at, nx, out_at, no, rank, reads_first) is want


def test_peers_args_lay_out_the_kernels_struct():
    """reduce_peers' one parameter (kernels/reduce.cu, "Peers"): eight output pointers, eight
    source pointers, the elements, the divisor, then the two counts, at the offsets a C
    compiler gives that struct (8-byte fields first, no padding), unused pointers zero."""
    dt = schedule.PEERS_DTYPE
    assert [(name, dt.fields[name][1]) for name in dt.names] == [
        ("d", 0),
        ("s", 64),
        ("n", 128),
        ("div", 136),
        ("nout", 144),
        ("nsrc", 148),
    ]
    assert dt.itemsize == 152
    outs, srcs = [0x1000, 0x2000], [0x3000, 0x4000, 0x5000]
    a = schedule.peers_args(outs, srcs, 1 << 40, 3)
    assert isinstance(a, np.void) and a.dtype == dt
    assert list(a["d"]) == [*outs, 0, 0, 0, 0, 0, 0]
    assert list(a["s"]) == [*srcs, 0, 0, 0, 0, 0]
    assert (int(a["n"]), int(a["div"]), int(a["nout"]), int(a["nsrc"])) == (1 << 40, 3, 2, 3)
    source = (Path(kernels.__file__).parent / "reduce.cu").read_text()
    struct = source[
        source.index("struct Peers {") : source.index("};", source.index("struct Peers {"))
    ]
    fields = [line.split("//")[0].strip() for line in struct.splitlines()[1:]]
    assert fields == [
        f"unsigned long long d[{schedule.MAX_SOURCES}];",
        f"unsigned long long s[{schedule.MAX_SOURCES}];",
        "unsigned long long n;",
        "long long div;",
        "int nout;",
        "int nsrc;",
    ]
