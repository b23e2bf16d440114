"""The direct transport's buffer records (hetcomm.transports.direct.peer) with a stand-in driver and
runtime: what a record carries, the registration cache on both sides, one driver query per
cache hit."""

from __future__ import annotations

import numpy as np
import pytest

from hetcomm.transports.direct import peer as direct_peer


class FakeDriver:
    """Allocations: base -> (size, buffer id); counts the queries."""

    def __init__(self, hip: bool) -> None:
        self.allocs = {0x10000: (4096, 7), 0x90000: (1 << 20, 8)}
        self.id_queries = 0
        self.range_queries = 0

    def _find(self, ptr: int) -> tuple[int, int, int]:
        for base, (size, ident) in self.allocs.items():
            if base <= ptr < base + size:
                return base, size, ident
        raise RuntimeError(f"unknown {ptr:#x}")

    def buffer_id(self, ptr: int) -> int:
        self.id_queries += 1
        return self._find(ptr)[2]

    def allocation(self, ptr: int) -> tuple[int, int, int]:
        self.range_queries += 1
        return self._find(ptr)


class FakeRuntime:
    is_hip = False

    def __init__(self) -> None:
        self.opened: list[bytes] = []

    def ipcGetMemHandle(self, base: int) -> bytes:
        return base.to_bytes(8, "little") * 8  # 64 bytes that name the allocation

    def ipcOpenMemHandle(self, handle: bytes, flags: int) -> int:
        self.opened.append(handle)
        return 0x7000_0000 + int.from_bytes(handle[:8], "little")


class FakeCupy:
    class cuda:  # the shape of cupy's namespace
        runtime = FakeRuntime()


@pytest.fixture
def maps(monkeypatch):
    monkeypatch.setattr(direct_peer, "_Driver", FakeDriver)
    FakeCupy.cuda.runtime = FakeRuntime()
    return direct_peer.PeerMap(FakeCupy), direct_peer.PeerMap(FakeCupy)


def fields(rec: np.ndarray) -> tuple[int, int, int, int, bytes]:
    r = rec[0]
    return int(r["id"]), int(r["offset"]), int(r["nbytes"]), int(r["has"]), bytes(r["handle"])


def test_records_carry_the_handle_once_per_peer_unless_full(maps) -> None:
    mine, _ = maps
    first = mine.describe(0x10000 + 64, 100, [1, 2])
    assert fields(first) == (7, 64, 100, 1, (0x10000).to_bytes(8, "little") * 8)
    again = mine.describe(0x10000 + 128, 50, [1])
    assert fields(again) == (7, 128, 50, 0, bytes(64))  # peer 1 has it: no handle
    newcomer = mine.describe(0x10000, 8, [1, 3])
    assert fields(newcomer)[3] == 1  # peer 3 has not
    full = mine.describe(0x10000 + 8, 16, [1], full=True)
    assert fields(full) == (7, 8, 16, 1, (0x10000).to_bytes(8, "little") * 8)
    # records are fresh arrays: changing one leaves the cached template alone
    full["nbytes"] = 999
    assert fields(mine.describe(0x10000 + 8, 16, [1], full=True))[2] == 16


def test_a_known_allocation_costs_one_driver_query(maps) -> None:
    mine, _ = maps
    for i in range(5):
        mine.describe(0x90000 + i, 1, [1], full=True)
    assert mine.driver.id_queries == 5
    assert mine.driver.range_queries == 1  # the allocation's range: once


def test_address_maps_each_peer_allocation_once(maps) -> None:
    mine, theirs = maps
    rec = mine.describe(0x90000 + 4096, 256, [1])
    addr, nbytes = theirs.address(0, rec)
    assert (addr, nbytes) == (0x7000_0000 + 0x90000 + 4096, 256)
    rec2 = mine.describe(0x90000 + 100, 8, [1])  # no handle now: the mapping is known
    assert fields(rec2)[3] == 0
    assert theirs.address(0, rec2) == (0x7000_0000 + 0x90000 + 100, 8)
    assert (theirs.misses, theirs.hits) == (1, 1)
    assert len(FakeCupy.cuda.runtime.opened) == 1


def test_a_record_without_a_handle_for_an_unmapped_buffer_is_refused(maps) -> None:
    mine, theirs = maps
    mine.describe(0x10000, 8, [1])  # handle sent (and lost)
    rec = mine.describe(0x10000, 8, [1])
    with pytest.raises(RuntimeError, match="sent no handle"):
        theirs.address(0, rec)


def test_records_kept_per_address_and_allocation(maps) -> None:
    """A lent buffer's record (direct's prepared sends, the shared GPU's members:
    peer.Described) is made once per address and size and kept while the allocation there is
    the same one; a new allocation at the same address (a freed buffer's memory handed out
    again by the driver) gets a record of its own, with the new allocation's handle: a kept
    record would send the peer to the old one."""
    mine, _ = maps
    described = direct_peer.Described(mine)
    first = described.one(0x10000 + 64, 256)
    ranges = mine.driver.range_queries
    again = described.one(0x10000 + 64, 256)
    assert again is first and mine.driver.range_queries == ranges  # kept: one id query
    assert fields(described.one(0x10000 + 64, 128))[2] == 128  # another size
    mine.driver.allocs[0x10000] = (4096, 11)  # freed, and allocated again at the same base
    fresh = described.one(0x10000 + 64, 256)
    assert fresh is not first
    assert fields(fresh)[0] == 11 and fields(fresh)[3] == 1  # the new allocation, its handle


def test_records_of_several_spans_kept_alike(maps) -> None:
    """Several spans' records in one array (an empty span's all zeros), kept while every
    allocation is the one they were made for: one id query per span at each use; a span
    whose allocation changed makes them again, with its new handle."""
    mine, _ = maps
    described = direct_peer.Described(mine)
    spans = ((0x10000 + 8, 64), (0x90000, 0), (0x90000 + 4096, 512))
    first = described.many(spans)
    assert [fields(first[i : i + 1])[:3] for i in range(3)] == [
        (7, 8, 64),
        (0, 0, 0),
        (8, 4096, 512),
    ]
    ids, ranges = mine.driver.id_queries, mine.driver.range_queries
    assert described.many(spans) is first
    assert (mine.driver.id_queries - ids, mine.driver.range_queries) == (2, ranges)
    mine.driver.allocs[0x90000] = (1 << 20, 12)
    fresh = described.many(spans)
    assert fresh is not first and fields(fresh[2:3])[0] == 12 and fields(fresh[2:3])[3] == 1
    assert fields(first[2:3])[0] == 8  # a record handed out is never rewritten


def test_a_table_of_records_resolves_as_record_by_record(maps) -> None:
    """The shared GPU's leader reads a table of every rank's records (one row a rank, one
    column a span) in one pass (PeerMap.addresses, learn_rows): the same addresses, handles
    and counters as resolve() record by record, its own row taken as given."""
    mine, theirs = maps
    table = np.zeros((3, 2), direct_peer.RECORD)
    for p, (x, out) in ((0, (0x10000 + 8, 0x90000)), (2, (0x90000 + 512, 0x10000 + 64))):
        table[p, 0] = mine.describe(x, 32, (), full=True)[0]
        table[p, 1] = mine.describe(out, 32, (), full=True)[0]
    theirs.learn_rows(table, [0, 2])
    assert sorted(theirs._known) == [(0, 7), (0, 8), (2, 7), (2, 8)]  # kept, none opened yet
    got = [theirs.addresses(table, col, 1, 0xABC0 + col) for col in (0, 1)]
    mapped = {ident: 0x7000_0000 + base for base, (_, ident) in mine.driver.allocs.items()}
    assert got == [
        [mapped[7] + 8, 0xABC0, mapped[8] + 512],
        [mapped[8], 0xABC1, mapped[7] + 64],
    ]
    assert (theirs.misses, theirs.hits) == (4, 0)
    again = theirs.addresses(table, 0, 1, 0xABC0)
    assert again == got[0] and (theirs.misses, theirs.hits) == (4, 2)
    theirs.learn_rows(table, [0, 2])  # mapped now: nothing kept again
    assert theirs._known == {}
    assert [theirs.resolve(p, table[p, 1]) for p in (0, 2)] == [got[1][0], got[1][2]]


def test_a_row_of_records_resolves_as_record_by_record(maps) -> None:
    """One rank's records in a row (all_reduce_coalesced through the leader: PeerMap.row):
    the addresses resolve() gives record by record, an empty record's (0, 0)."""
    mine, theirs = maps
    table = np.zeros((2, 3), direct_peer.RECORD)
    table[0, 0] = mine.describe(0x10000 + 8, 32, (), full=True)[0]
    table[0, 2] = mine.describe(0x90000 + 64, 128, (), full=True)[0]
    got = theirs.row(table, 0)
    mapped = {ident: 0x7000_0000 + base for base, (_, ident) in mine.driver.allocs.items()}
    assert got == [(mapped[7] + 8, 32), (0, 0), (mapped[8] + 64, 128)]
    assert (theirs.misses, theirs.hits) == (2, 0)
    assert theirs.row(table, 0) == got and (theirs.misses, theirs.hits) == (2, 2)
    assert [theirs.resolve(0, table[0, c]) for c in (0, 2)] == [got[0][0], got[2][0]]
