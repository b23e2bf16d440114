"""Every rail kind carries staged send/recv and all_reduce correctly; two tcp rails share a
message. Jobs of 2 ranks with HETCOMM_TRANSPORT=staged, on plain loopback."""

from __future__ import annotations

import pytest
from _rails import TWO_RAILS

# rail kind -> (HETCOMM_* variables, each rank its own host?)
KINDS = {
    "shm": ({}, False),  # one host: shared memory
    "tcp": ({"HETCOMM_RAILS": TWO_RAILS}, True),  # two simulated hosts, two loopback rails
    "mpi": ({"HETCOMM_RAILS": "mpi"}, True),  # the MPI rail
}
# one communicator each (the chunk size is set before its first operation); zero-length and
# one-element arrays in each
CHUNKINGS = [
    # 4096 B and 16384 B messages are 1 and 4 whole chunks
    {
        "name": "chunks-divide",
        "dtype": "float32",
        "chunk_bytes": 4096,
        "counts": [0, 1, 1024, 4096],
    },
    # 7992 B and 20000 B are not multiples of 3000
    {
        "name": "chunks-do-not-divide",
        "dtype": "float64",
        "chunk_bytes": 3000,
        "counts": [0, 1, 999, 2500],
    },
    # an odd chunk size also splits elements between chunks
    {"name": "odd-chunk", "dtype": "int16", "chunk_bytes": 1001, "counts": [0, 1, 3001]},
]


# ids "shm-rail", ...: a test id "mpi" would look like pytest-mpi's marker and be skipped
@pytest.mark.parametrize("kind", list(KINDS), ids=[f"{k}-rail" for k in KINDS])
def test_rail_carries_send_recv_and_all_reduce(job, kind):
    variables, hosts = KINDS[kind]
    done = job("roundtrip", {"hosts": hosts, "chunkings": CHUNKINGS}, **variables)
    for r in done.ranks():
        assert r["errors"] == [], f"rank {r['rank']}: {r['errors']}\n{done.explain()}"
        assert set(r["cases"]) == {c["name"] for c in CHUNKINGS}
        for chunking in CHUNKINGS:
            case = r["cases"][chunking["name"]]
            assert case["chunk_bytes"] == chunking["chunk_bytes"]
            # the rails between the two ranks are of the expected kind; only they carried bytes
            assert case["specs"] and all(s.startswith(kind) for s in case["specs"]), case
            assert case["rails"] and all(n.startswith(kind) for n in case["rails"]), case
    assert done.returncode == 0, done.explain()


def test_two_tcp_rails_both_carry_bytes(job):
    """16 MiB in 256 KiB chunks from rank 0 to rank 1: both rails take chunks, and together
    exactly the message (no chunk sent twice)."""
    done = job(
        "stripe", {"hosts": True, "mib": 16, "chunk_bytes": 256 << 10}, HETCOMM_RAILS=TWO_RAILS
    )
    sender, receiver = done.ranks()
    assert receiver["errors"] == [], done.explain()
    rails = sender["rails"]
    assert set(rails) == {"tcp0", "tcp1"}, f"bytes per rail: {rails}"
    assert min(rails.values()) > 0, f"a rail carried nothing: {rails}"
    assert sum(rails.values()) == 16 << 20, f"bytes per rail: {rails}"
    assert done.returncode == 0, done.explain()
