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
import time
from typing import Any

import numpy as np
import pytest
from _reliability import report

import hetcomm

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
        large,
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


# ---- the rank side: scenarios run on every rank of a job (hetcomm.testing.run_scenario) ----


_TILE = 4099  # a prime: a piece landing at a wrong offset (a multiple of 2^k) shows up


def _tile(salt: int) -> np.ndarray:
    """The repeating pattern of int8 values that array `salt` holds."""
    return ((np.arange(_TILE, dtype=np.int64) * 37 + salt * 101) % 256 - 128).astype(np.int8)


def _fill(a: np.ndarray, tile: np.ndarray, first: int = 0) -> None:
    """a[i] = tile[(first + i) % len(tile)], written 8 tiles at a time as int64 words."""
    t = np.tile(np.roll(tile, -(first % len(tile))), 8)
    whole = len(a) - len(a) % len(t)
    a[:whole].view(np.int64).reshape(-1, len(t) // 8)[:] = t.view(np.int64)
    a[whole:] = t[: len(a) - whole]


def _differs(a: np.ndarray, tile: np.ndarray, first: int = 0) -> str:
    """'' when `a` holds the pattern `_fill` writes, else where it first differs (compared as
    int64 words, in slices, so that no temporary as large as `a` is made)."""
    t = np.tile(np.roll(tile, -(first % len(tile))), 8)
    words = t.view(np.int64)
    step = len(t) * 2048  # 64 MiB
    for start in range(0, len(a), step):
        part = a[start : start + step]
        whole = len(part) - len(part) % len(t)
        rows = part[:whole].view(np.int64).reshape(-1, len(words))
        bad = np.flatnonzero((rows != words).any(axis=1))
        if bad.size:
            row = part[bad[0] * len(t) : (bad[0] + 1) * len(t)]
            i = int(np.flatnonzero(row != t)[0])
            return f"element {start + bad[0] * len(t) + i}: got {row[i]}, want {t[i]}"
        if not np.array_equal(part[whole:], t[: len(part) - whole]):
            return f"elements {start + whole}.. of the last slice differ"
    return ""


class _Backing:
    """An int8 array of n elements between 64 sentinel bytes on each side; `part(k)` gives a
    view of its first k elements with fresh sentinels around them."""

    def __init__(self, n: int) -> None:
        self.memory = np.empty(n + 128, dtype=np.int8)

    def part(self, k: int) -> np.ndarray:
        self.memory[:64] = self.memory[64 + k : 128 + k] = 77
        self.k = k
        return self.memory[64 : 64 + k]

    def intact(self) -> bool:
        m, k = self.memory, self.k
        return bool((m[:64] == 77).all() and (m[64 + k : 128 + k] == 77).all())


def large(params: dict[str, Any]) -> None:
    """Every operation on int8 arrays of more than 2^31 elements between 2 ranks, each result
    checked in full against the pattern it must hold, and at a few random positions.

    Two arrays of n elements per rank serve every operation in turn (about 2n bytes per rank,
    touched once): their pages are faulted in once, which is most of the time this job takes.
    """
    world = hetcomm.init(config=hetcomm.Config.load(transport=params["transport"]), name="large")
    assert world.size == 2, "the large-count job runs on 2 ranks"
    n, me, other = int(params["count"]), world.rank, 1 - world.rank
    rng = np.random.default_rng(int(params["seed"]))  # the same draws on both ranks
    spots = np.unique(rng.integers(0, n, size=8))
    spot_values = rng.integers(-128, 128, size=(2, len(spots))).astype(np.int8)
    errors: list[str] = []
    seconds: dict[str, float] = {}
    a, b = _Backing(n), _Backing(n)

    def timed(what: str, call: Any, *args: Any, **kwargs: Any) -> bool:
        start = time.monotonic()
        try:
            work = call(*args, async_op=True, **kwargs)
            work.wait()
        except Exception as exc:
            errors.append(f"{what}: {type(exc).__name__}: {exc}")
            return False
        seconds[what] = round(time.monotonic() - start, 2)
        if params["transport"] == "mpi" and (work.info or {}).get("stages", 0) < 2:
            errors.append(f"{what}: one MPI call for {n} elements: {work.info}")
        return True

    def check(what: str, arr: np.ndarray, tile: np.ndarray, first: int = 0) -> None:
        problem = _differs(arr, tile, first)
        if problem:
            errors.append(f"{what}: {problem}")

    def outside(what: str, *backings: _Backing) -> None:
        if not all(k.intact() for k in backings):
            errors.append(f"{what}: wrote outside its arrays")

    # send/recv: rank 0's pattern (and its random spots) arrives whole at rank 1
    x = a.part(n)
    if me == 0:
        _fill(x, _tile(1))
        x[spots] = spot_values[0]
        timed("send", world.send, x, 1, tag=3)
    else:
        x[:] = 0
        if timed("recv", world.recv, x, 0, tag=3):
            got = x[spots].copy()
            x[spots] = _tile(1)[spots % _TILE]
            check("recv", x, _tile(1))
            if not np.array_equal(got, spot_values[0]):
                errors.append(f"recv: random spots hold {got}, want {spot_values[0]}")
    outside("send/recv", a)
    # broadcast from rank 1
    _fill(x, _tile(2 + me))
    if timed("broadcast", world.broadcast, x, 1):
        check("broadcast", x, _tile(3))
        outside("broadcast", a)
    # all_reduce SUM: the int8 sum of both ranks' patterns, wrapped; random spots exact
    _fill(x, _tile(4 + me))
    x[spots] = spot_values[me]
    if timed("all_reduce", world.all_reduce, x):
        want = (_tile(4).astype(np.int64) + _tile(5)).astype(np.int8)
        got = x[spots].copy()
        x[spots] = want[spots % _TILE]
        check("all_reduce", x, want)
        spot_want = (spot_values[0].astype(np.int64) + spot_values[1]).astype(np.int8)
        if not np.array_equal(got, spot_want):
            errors.append(f"all_reduce: random spots hold {got}, want {spot_want}")
        outside("all_reduce", a)
    if params.get("collectives", True):
        _large_collectives(world, n // 2, me, other, a, b, timed, check, outside)
    report(ok=not errors, errors=errors[:10], seconds=seconds)
    world.close()


def _large_collectives(
    world: Any,
    half: int,
    me: int,
    other: int,
    a: _Backing,
    b: _Backing,
    timed: Any,
    check: Any,
    outside: Any,
) -> None:
    """all_gather, reduce_scatter and all_to_all whose larger buffer has 2 * half elements."""
    # all_gather: blocks of half elements gathered into 2 * half
    x, out = a.part(half), b.part(2 * half)
    _fill(x, _tile(6 + me))
    if timed("all_gather", world.all_gather, out, x):
        check("all_gather block 0", out[:half], _tile(6))
        check("all_gather block 1", out[half:], _tile(7))
        check("all_gather: x", x, _tile(6 + me))
        outside("all_gather", a, b)
    # reduce_scatter: x of 2 * half elements, each rank's out the sum of its block
    x, out = b.part(2 * half), a.part(half)
    _fill(x, _tile(8 + me))
    if timed("reduce_scatter", world.reduce_scatter, out, x):
        want = (_tile(8).astype(np.int64) + _tile(9)).astype(np.int8)
        check("reduce_scatter", out, want, me * half)
        check("reduce_scatter: x", x, _tile(8 + me))
        outside("reduce_scatter", a, b)
    # all_to_all: block j of rank i lands as block i of rank j (x is still rank me's pattern)
    out = a.part(2 * half)
    if timed("all_to_all", world.all_to_all, out, x):
        for i in (me, other):
            check(f"all_to_all block {i}", out[i * half : (i + 1) * half], _tile(8 + i), me * half)
        check("all_to_all: x", x, _tile(8 + me))
        outside("all_to_all", a, b)
