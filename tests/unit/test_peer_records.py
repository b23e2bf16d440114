"""The direct transport's buffer records (hetcomm.transports.direct.peer) with a stand-in driver and
runtime: what a record carries, the registration cache on both sides, one driver query per
cache hit."""

from __future__ import annotations

import types

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


def test_prepared_records_kept_per_address_and_allocation(maps) -> None:
    """A prepared send's record (direct/prepared.py) is made once per address and size and
    kept while the allocation there is the same one; a new allocation at the same address (a
    freed buffer's memory handed out again by the driver) gets a record of its own, with the
    new allocation's handle: a kept record would send the peer to the old one."""
    from hetcomm.transports.direct.prepared import PreparedP2P

    mine, _ = maps
    t = types.SimpleNamespace(svc=None, cupy=FakeCupy, peers=mine)
    prepared = PreparedP2P(t)
    first = prepared._record(0x10000 + 64, 256)
    ranges = mine.driver.range_queries
    again = prepared._record(0x10000 + 64, 256)
    assert again is first and mine.driver.range_queries == ranges  # kept: one id query
    assert fields(prepared._record(0x10000 + 64, 128))[2] == 128  # another size
    mine.driver.allocs[0x10000] = (4096, 11)  # freed, and allocated again at the same base
    fresh = prepared._record(0x10000 + 64, 256)
    assert fresh is not first
    assert fields(fresh)[0] == 11 and fields(fresh)[3] == 1  # the new allocation, its handle
