"""Arrays of more than 2^31 elements (2^31 + 8 int8) between 2 ranks, every operation.

MPI counts are C ints: the mpi transport cuts such operations into calls of at most 1 GiB
(tests/mpi/test_large_counts.py covers every dtype and reduce op with a lowered limit). Here
the real sizes travel, on 2 ranks of about 4.5 GiB each: send/recv, broadcast, all_reduce SUM
(int8 sums wrap), all_gather, reduce_scatter and all_to_all (the last three with 2^31 + 8
elements in their larger buffer), each result checked in full against the pattern it must hold
and at random positions, and the bytes around every array checked untouched.

Skipped when the machine has less than 16 GiB available. The mpi transport runs by default
(about 35 s on 2 shared cores); LARGE_COUNT_TRANSPORTS=mpi,staged adds the staged transport
(about 80 s and 7.5 GiB per rank).
"""

from __future__ import annotations

import os
from typing import Any

import pytest

COUNT = 2**31 + 8
NEEDED_GIB = 16
TRANSPORTS = os.environ.get("LARGE_COUNT_TRANSPORTS", "mpi").split(",")


def available_gib() -> float:
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    return 0.0


# ids other than "mpi": pytest-mpi takes any test with the keyword "mpi" for one of its own
@pytest.mark.parametrize("transport", ["mpi", "staged"], ids=["on-mpi", "on-staged"])
def test_operations_past_two_to_the_31_elements(job: Any, transport: str) -> None:
    if transport not in TRANSPORTS:
        pytest.skip(f"{transport}: set LARGE_COUNT_TRANSPORTS=mpi,{transport} to run it (slow)")
    have = available_gib()
    if have < NEEDED_GIB:
        pytest.skip(
            f"needs {NEEDED_GIB} GiB of available memory (2 ranks of about 4.5 GiB, and "
            f"room for everything else); this machine has {have:.1f} GiB"
        )
    seed = int.from_bytes(os.urandom(4), "little")
    limit = 120 if transport == "mpi" else 300
    result = job(
        2,
        "large",
        {"transport": transport, "count": COUNT, "seed": seed},
        limit,
        HETCOMM_TIMEOUT=str(limit),
    )
    print(
        f"large counts on {transport}: exit {result.returncode} after {result.seconds:.1f} s, "
        f"seed {seed}: {[r.get('seconds') for r in result.results]}"
    )
    ranks = result.ranks(2)
    bad = [f"rank {r['rank']}: {r['errors']}" for r in ranks if not r["ok"]]
    assert not bad, f"seed {seed}: " + "; ".join(bad)
    assert result.returncode == 0, result.explain()
    ops = {"send", "broadcast", "all_reduce", "all_gather", "reduce_scatter", "all_to_all"}
    assert set(ranks[0]["seconds"]) == ops, ranks[0]
