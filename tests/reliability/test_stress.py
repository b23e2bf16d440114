"""Stress: a seeded random sequence of mixed operations on 4 ranks, checked against numpy.

Operations (all_reduce, reduce, broadcast, all_gather, reduce_scatter, all_to_all and a
send/recv ring), sizes (0..4096 elements, mostly small), dtypes, reductions, roots and
blocking/async calls are drawn from one generator seeded on rank 0 and broadcast; they run on
the world, on two halves (split by parity, running at the same time) and on a group of three
(rank 3 left out). Every rank checks its result against a float64 numpy reference. The seed is
printed, and named in every failure: STRESS_SEED=<seed> replays a run. STRESS_OPS sets the
number of operations (default 2000; the long version is STRESS_OPS=10000).
"""

from __future__ import annotations

import os
from typing import Any

import pytest

OPS = int(os.environ.get("STRESS_OPS", "2000"))
SEED = int(os.environ.get("STRESS_SEED", "0"))


@pytest.mark.parametrize("transport", ["auto", "staged"])
def test_stress_mixed_operations(job: Any, transport: str) -> None:
    limit = max(120, OPS * 0.06)
    result = job(
        4,
        "stress",
        {"ops": OPS, "seed": SEED},
        limit,
        HETCOMM_TIMEOUT="60",
        HETCOMM_TRANSPORT=transport,
    )
    seed = next(
        (line.split()[1] for line in result.stdout.splitlines() if line.startswith("SEED ")),
        "unknown",
    )
    print(
        f"stress on {transport}: {OPS} operations, seed {seed}, exit {result.returncode} after "
        f"{result.seconds:.1f} s"
    )
    assert result.returncode == 0 and len(result.results) == 4, (
        f"seed {seed} (replay: STRESS_SEED={seed})\n{result.explain()}"
    )
    bad = [r for r in result.results if not r["ok"]]
    assert not bad, f"seed {seed} (replay: STRESS_SEED={seed}): " + "; ".join(
        f"rank {r['rank']}: {r['n_errors']} errors: {r['errors'][:3]}" for r in bad
    )
    if OPS >= 500:  # every kind of operation ran on every kind of group
        assert len(result.results[0]["counts"]) == 21, result.results[0]["counts"]
