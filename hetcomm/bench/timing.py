"""Timing for the benchmarks: interleaved rounds, the slowest rank's time, medians and spread.

Every study of `hetcomm bench` times its implementations the same way: a *sample* is `calls`
calls of one implementation, started together on every rank (a barrier), timed on each rank
and reduced to the slowest rank's time; a *round* takes one sample of every implementation, in
a random order that is the same on every rank (one seed), so that load which comes and goes on
the machine falls on all of them alike. The result per implementation is the median over the
rounds and their spread; two implementations compare by the median of their per-round ratios,
which load that changes between rounds leaves alone.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

#: one sample: run the implementation `calls` times
Run = Callable[[int], Any]


@dataclass(frozen=True)
class Stat:
    """Seconds per call of one implementation: per round (the slowest rank's), their median
    and spread ((max - min) / median)."""

    rounds: tuple[float, ...]

    @property
    def median(self) -> float:
        return float(statistics.median(self.rounds)) if self.rounds else 0.0

    @property
    def spread(self) -> float:
        med = self.median
        return (max(self.rounds) - min(self.rounds)) / med if med > 0 else 0.0


def summarize(per_rank: Sequence[Sequence[float]]) -> Stat:
    """The Stat of samples gathered from every rank (one list per rank, one value per round):
    the slowest rank's value of each round."""
    if not per_rank or not per_rank[0]:
        return Stat(())
    lengths = {len(r) for r in per_rank}
    if len(lengths) != 1:
        raise ValueError(f"every rank must take the same number of rounds, got {sorted(lengths)}")
    return Stat(tuple(float(v) for v in np.max(np.asarray(per_rank, dtype=float), axis=0)))


def paired_ratio(a: Stat, b: Stat) -> float | None:
    """Median over rounds of a's time / b's time in the same round (None if b is ever 0)."""
    if len(a.rounds) != len(b.rounds):
        raise ValueError(f"paired rounds differ: {len(a.rounds)} and {len(b.rounds)}")
    if not a.rounds or min(b.rounds) <= 0:
        return None
    return float(statistics.median(x / y for x, y in zip(a.rounds, b.rounds)))


def paired_difference(a: Stat, b: Stat) -> float:
    """Median over rounds of a's time - b's time in the same round (seconds)."""
    if len(a.rounds) != len(b.rounds):
        raise ValueError(f"paired rounds differ: {len(a.rounds)} and {len(b.rounds)}")
    if not a.rounds:
        return 0.0
    return float(statistics.median(x - y for x, y in zip(a.rounds, b.rounds)))


def round_orders(names: Sequence[str], rounds: int, seed: int = 0) -> list[list[str]]:
    """The order of `names` in each round: a fresh permutation per round, the same for the same
    seed (so on every rank)."""
    rng = np.random.default_rng(seed)
    return [[names[int(k)] for k in rng.permutation(len(names))] for _ in range(rounds)]


class Interleaved:
    """Times implementations in interleaved rounds on every rank of an mpi4py communicator.

    `sync` runs after each sample, inside the timed span: a device synchronize where the
    implementations queue GPU work, so that a sample ends when its work has.
    """

    def __init__(
        self,
        mpi: Any,
        rounds: int,
        *,
        seed: int = 0,
        sync: Callable[[], Any] | None = None,
    ) -> None:
        if rounds < 1:
            raise ValueError(f"need at least one round, got {rounds}")
        self.mpi, self.rounds, self.sync = mpi, rounds, sync
        self._seed = seed

    def sample(self, run: Run, calls: int) -> float:
        """Seconds per call of `calls` calls of `run`, started after a barrier (this rank)."""
        self.mpi.Barrier()
        start = time.perf_counter()
        run(calls)
        if self.sync is not None:
            self.sync()
        return (time.perf_counter() - start) / calls

    def measure(self, impls: Mapping[str, Run], calls: int, warmup: int = 0) -> dict[str, Stat]:
        """Each implementation's Stat over `self.rounds` rounds of `calls` calls, after
        `warmup` untimed calls of each. Collective over the communicator."""
        if calls < 1:
            raise ValueError(f"need at least one call per sample, got {calls}")
        names = list(impls)
        for name in names:
            if warmup:
                impls[name](warmup)
        if self.sync is not None:
            self.sync()
        # a new seed per measurement, the same on every rank: rows do not share one order
        self._seed += 1
        samples: dict[str, list[float]] = {n: [] for n in names}
        for order in round_orders(names, self.rounds, self._seed):
            for name in order:
                samples[name].append(self.sample(impls[name], calls))
        every = self.mpi.allgather([samples[n] for n in names])
        return {n: summarize([rank[i] for rank in every]) for i, n in enumerate(names)}


def cuda_event_timer() -> Callable[[Callable[[], Any]], float]:
    """Seconds of one call measured with two CUDA events on the current stream (torch)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def events(fn: Callable[[], Any]) -> float:
        start.record()
        fn()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end)) / 1e3

    return events


def cupy_event_seconds(fn: Callable[[], Any], runs: int = 10) -> float:
    """Median seconds of the GPU work `fn` queues on CuPy's current stream, by CUDA events;
    the first run warms up and is left out."""
    import cupy

    times = []
    for _ in range(runs):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) / 1e3)
    return float(statistics.median(times[1:]))


def wall_timer(sync: Callable[[], Any] | None = None) -> Callable[[Callable[[], Any]], float]:
    """Seconds of one call by the host clock, `sync` (a device synchronize) inside the span."""

    def wall(fn: Callable[[], Any]) -> float:
        t0 = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        return time.perf_counter() - t0

    return wall


def share_cores(torch: Any, mpi: Any) -> None:
    """Give torch this rank's share of the cores its host's ranks run on: torch's idle worker
    threads spin for a while after a parallel operation, and with more threads than cores
    they take the cores from whichever implementation runs next."""
    from mpi4py import MPI

    local = mpi.Split_type(MPI.COMM_TYPE_SHARED)
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local.Get_size()))
    local.Free()
