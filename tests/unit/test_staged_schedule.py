"""Pure parts of the staged transport: chunk spans, ring blocks, the rails two ranks choose."""

from __future__ import annotations

import numpy as np
import pytest

from hetcomm.transports.staged.schedule import (
    block_spans,
    choose_rails,
    chunk_spans,
)


@pytest.mark.parametrize("nbytes", [0, 1, 7, 8, 4096, 4097, (9 << 20) + 12])
@pytest.mark.parametrize("chunk", [8, 1000, 4 << 20])
@pytest.mark.parametrize("itemsize", [1, 2, 8])
def test_chunks_cover_the_message_on_element_boundaries(nbytes, chunk, itemsize) -> None:
    nbytes -= nbytes % itemsize
    spans = chunk_spans(nbytes, chunk, itemsize)
    covered = np.zeros(nbytes, dtype=np.int64)
    for off, n in spans:
        assert n > 0 and off % itemsize == 0 and n % itemsize == 0 and n <= chunk
        covered[off : off + n] += 1
    assert (covered == 1).all()
    assert [off for off, _ in spans] == sorted(off for off, _ in spans)


def test_chunk_smaller_than_an_element_is_refused() -> None:
    with pytest.raises(ValueError, match="smaller than one element"):
        chunk_spans(16, 4, 8)


@pytest.mark.parametrize("count", [0, 1, 5, 12, 1001])
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 7])
def test_blocks_partition_the_elements_nearly_evenly(count, parts) -> None:
    spans = block_spans(count, parts)
    assert len(spans) == parts
    assert sum(n for _, n in spans) == count
    assert all(spans[i][0] + spans[i][1] == spans[i + 1][0] for i in range(parts - 1))
    sizes = [n for _, n in spans]
    assert max(sizes) - min(sizes) <= 1


def _card(rank: int, host: str, node: int, addrs: list[str], prefix: int = 24) -> dict:
    return {
        "rank": rank,
        "host": host,
        "node": node,
        "addrs": addrs,
        "prefixes": {a: prefix for a in addrs},
        "ports": {a: 1000 + i for i, a in enumerate(addrs)},
    }


def test_same_host_uses_shared_memory() -> None:
    a, b = _card(0, "h", 0, ["127.0.0.1"]), _card(1, "h", 0, ["127.0.0.1"])
    assert [s.kind for s in choose_rails(a, b, "auto")] == ["shm"]


def test_simulated_hosts_on_one_machine_use_loopback_in_auto_mode() -> None:
    a = _card(0, "ha", 0, ["127.0.0.1", "10.0.0.1"])
    b = _card(1, "hb", 0, ["127.0.0.1", "10.0.0.1"])
    (rail,) = choose_rails(a, b, "auto")
    assert (rail.kind, rail.local, rail.remote, rail.port) == (
        "tcp",
        "127.0.0.1",
        "127.0.0.1",
        1000,
    )


def test_real_hosts_pair_their_nics_by_index_and_never_loopback() -> None:
    a = _card(0, "ha", 0, ["127.0.0.1", "10.0.0.1", "10.1.0.1"])
    b = _card(1, "hb", 1, ["127.0.0.1", "10.0.0.2", "10.1.0.2"])
    rails = choose_rails(a, b, "auto")
    assert [(r.local, r.remote) for r in rails] == [
        ("10.0.0.1", "10.0.0.2"),
        ("10.1.0.1", "10.1.0.2"),
    ]
    # both sides compute the same rails, mirrored
    back = choose_rails(b, a, "auto")
    assert [(r.remote, r.local) for r in back] == [(r.local, r.remote) for r in rails]


def test_listed_rails_and_the_mpi_rail() -> None:
    addrs = ["127.0.1.1", "127.0.2.1"]
    a, b = _card(0, "ha", 0, addrs), _card(1, "hb", 0, addrs)
    assert [r.local for r in choose_rails(a, b, "list")] == addrs
    assert [r.kind for r in choose_rails(a, b, "mpi")] == ["mpi"]
    # no address in common: the mpi rail carries the data
    c = _card(2, "hc", 1, [])
    assert [r.kind for r in choose_rails(a, c, "auto")] == ["mpi"]


def test_real_hosts_pair_nics_on_the_same_subnet_only() -> None:
    a = _card(0, "ha", 0, ["10.0.0.5", "192.168.1.5", "172.17.0.1"])
    b = _card(1, "hb", 1, ["10.0.0.6", "172.16.0.6", "192.168.1.6", "172.17.0.1"])
    rails = choose_rails(a, b, "auto")
    # 172.17.0.1 on both: a host-local bridge, not a path between the hosts
    assert [(r.local, r.remote) for r in rails] == [
        ("10.0.0.5", "10.0.0.6"),
        ("192.168.1.5", "192.168.1.6"),
    ]
