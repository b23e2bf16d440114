"""A rank that dies mid-job ends the job, non-zero, within the timeout: never a hang.

Rank 2 of 4 SIGKILLs itself in the middle of a loop of all_reduce calls, with HETCOMM_TIMEOUT=5.
Open MPI notices the death and ends the whole job at once; with `--enable-recovery` it lets the
survivors run on, and then their CommTimeout (after 5 s) raises, mpi4py's -m aborts the job, and
it ends all the same. timeout(1) around mpirun is the guard: a hang would show as exit 124/137
after the limit, well past the elapsed-time assertion.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
from _reliability import JOBS, Job, clean_environ, run

DEATH = {"victim": 2, "at": 50}
LIMIT_S = 90  # timeout(1)'s limit: far beyond what a working job needs
DEADLINE_S = 60  # the job must have ended by then (it takes 2-5 s, or 7-22 s with recovery)


def _ended_by_death(job: Job) -> None:
    assert job.returncode not in (0, 124), job.explain()
    assert job.seconds < DEADLINE_S, job.explain()
    assert "SIGKILL at iteration 50" in job.stdout, job.explain()
    assert not job.results, job.explain()  # nobody finished


def test_rank_death_ends_the_job(job: Any) -> None:
    result = job(4, "death", DEATH, LIMIT_S, HETCOMM_TIMEOUT="5")
    print(f"rank death: exit {result.returncode} after {result.seconds:.1f} s")
    _ended_by_death(result)


def test_rank_death_survivors_time_out(hetcomm_mpirun: tuple[list[str], dict[str, str]]) -> None:
    """With the launcher told to keep going, the survivors' CommTimeout ends the job."""
    prefix, mpi_env = hetcomm_mpirun
    if "--oversubscribe" not in prefix:
        pytest.skip("--enable-recovery is an Open MPI (prterun) option")
    argv = [
        *prefix,
        "--enable-recovery",
        "-n",
        "4",
        "env",
        "HETCOMM_TIMEOUT=5",
        sys.executable,
        "-m",
        "mpi4py",
        str(JOBS),
        "death",
        '{"victim": 2, "at": 50}',
    ]
    result = run(argv, clean_environ(**mpi_env), LIMIT_S)
    print(f"rank death with recovery: exit {result.returncode} after {result.seconds:.1f} s")
    _ended_by_death(result)
    assert "CommTimeout at iteration 50" in result.stdout, result.explain()
    assert "did not complete within 5.0 s" in result.stderr, result.explain()


def test_rank_death_under_hetcomm_run(hetcomm_mpirun: tuple[list[str], dict[str, str]]) -> None:
    """The same job started by `hetcomm run --timeout 60`."""
    _, mpi_env = hetcomm_mpirun
    argv = [
        sys.executable,
        "-m",
        "hetcomm",
        "run",
        "-n",
        "4",
        "--timeout",
        "60",
        "--",
        sys.executable,
        str(JOBS),
        "death",
        '{"victim": 2, "at": 50}',
    ]
    result = run(argv, clean_environ(HETCOMM_TIMEOUT="5", **mpi_env), LIMIT_S)
    print(f"rank death under hetcomm run: exit {result.returncode} after {result.seconds:.1f} s")
    _ended_by_death(result)


def test_a_rank_leaving_out_a_fused_all_reduce(job: Any) -> None:
    """Rank 1 of 2 leaves out one blocking all_reduce_coalesced: rank 0's CommTimeout comes
    within its 2 s timeout with its arrays untouched, and both ranks still close and end."""
    result = job(2, "skipped_coalesced", {"timeout": 2}, LIMIT_S)
    print(f"a left-out fused all-reduce: exit {result.returncode} after {result.seconds:.1f} s")
    assert result.returncode == 0 and len(result.results) == 2, result.explain()
    by_rank = {r["rank"]: r for r in result.results}
    assert by_rank[0]["ok"] and by_rank[1]["ok"], result.explain()
    assert by_rank[0]["untouched"] is True, result.explain()
    assert by_rank[0]["timed_out"] is not None and 2 <= by_rank[0]["timed_out"] < 10, (
        result.explain()
    )
    assert result.seconds < DEADLINE_S, result.explain()
