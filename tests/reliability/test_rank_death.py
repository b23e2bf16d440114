"""A rank that dies mid-job ends the job, non-zero, within the timeout: never a hang.

Rank 2 of 4 SIGKILLs itself in the middle of a loop of all_reduce calls, with HETCOMM_TIMEOUT=5.
Open MPI notices the death and ends the whole job at once; with `--enable-recovery` it lets the
survivors run on, and then their CommTimeout (after 5 s) raises, mpi4py's -m aborts the job, and
it ends all the same. timeout(1) around mpirun is the guard: a hang would show as exit 124/137
after the limit, well past the elapsed-time assertion.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

import numpy as np
import pytest
from _reliability import Job, clean_environ, my_rank, report, run

import hetcomm
from hetcomm import CommTimeout
from hetcomm.testing import scenario_command

DEATH = {"victim": 2, "at": 50}
LIMIT_S = 90  # timeout(1)'s limit: far beyond what a working job needs
DEADLINE_S = 60  # the job must have ended by then (it takes 2-5 s, or 7-22 s with recovery)


def _ended_by_death(job: Job) -> None:
    assert job.returncode not in (0, 124), job.explain()
    assert job.seconds < DEADLINE_S, job.explain()
    assert "SIGKILL at iteration 50" in job.stdout, job.explain()
    assert not job.results, job.explain()  # nobody finished


def _with_recovery(
    mpirun: tuple[list[str], dict[str, str]],
    n: int,
    scenario: Any,
    params: dict[str, Any],
    *variables: str,
) -> Job:
    """`scenario` on n ranks, HETCOMM_TIMEOUT=5, the launcher told to let survivors run on."""
    prefix, mpi_env = mpirun
    if "--oversubscribe" not in prefix:
        pytest.skip("--enable-recovery is an Open MPI (prterun) option")
    argv = [*prefix, "--enable-recovery", "-n", str(n), "env", "HETCOMM_TIMEOUT=5", *variables]
    return run([*argv, *scenario_command(scenario, params)], clean_environ(**mpi_env), LIMIT_S)


def test_rank_death_ends_the_job(job: Any) -> None:
    result = job(4, death, DEATH, LIMIT_S, HETCOMM_TIMEOUT="5")
    print(f"rank death: exit {result.returncode} after {result.seconds:.1f} s")
    _ended_by_death(result)


def test_rank_death_survivors_time_out(hetcomm_mpirun: tuple[list[str], dict[str, str]]) -> None:
    """With the launcher told to keep going, the survivors' CommTimeout ends the job."""
    result = _with_recovery(hetcomm_mpirun, 4, death, {"victim": 2, "at": 50})
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
        *scenario_command(death, {"victim": 2, "at": 50}),
    ]
    result = run(argv, clean_environ(HETCOMM_TIMEOUT="5", **mpi_env), LIMIT_S)
    print(f"rank death under hetcomm run: exit {result.returncode} after {result.seconds:.1f} s")
    _ended_by_death(result)


def test_a_rank_leaving_out_a_fused_all_reduce(job: Any) -> None:
    """Rank 1 of 2 leaves out one blocking all_reduce_coalesced: rank 0's CommTimeout comes
    within its 2 s timeout with its arrays untouched, and both ranks still close and end."""
    result = job(2, skipped_coalesced, {"timeout": 2}, LIMIT_S)
    print(f"a left-out fused all-reduce: exit {result.returncode} after {result.seconds:.1f} s")
    assert result.returncode == 0 and len(result.results) == 2, result.explain()
    by_rank = {r["rank"]: r for r in result.results}
    assert by_rank[0]["ok"] and by_rank[1]["ok"], result.explain()
    assert by_rank[0]["untouched"] is True, result.explain()
    assert by_rank[0]["timed_out"] is not None and 2 <= by_rank[0]["timed_out"] < 10, (
        result.explain()
    )
    assert result.seconds < DEADLINE_S, result.explain()


# ---- the rank side: scenarios run on every rank of a job (hetcomm.testing.run_scenario) ----


def death(params: dict[str, Any]) -> None:
    """all_reduce in a loop; rank `victim` SIGKILLs itself at iteration `at`."""
    world = hetcomm.init(name="death")
    x = np.ones(256, dtype=np.float32)
    for i in range(int(params.get("iters", 10_000))):
        if params["victim"] == my_rank() and i == params["at"]:
            print(f"rank {my_rank()}: SIGKILL at iteration {i}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            world.all_reduce(x, async_op=True).wait()  # type: ignore[union-attr]
        except CommTimeout as exc:
            print(f"rank {my_rank()}: CommTimeout at iteration {i}: {exc}", flush=True)
            raise
        x.fill(1)
    report(ok=True)  # not reached while a rank is dead


def skipped_coalesced(params: dict[str, Any]) -> None:
    """Rank 1 leaves out a blocking all_reduce_coalesced (after one that both ranks made), on
    one node, where it reduces through shared segments: rank 0 gets CommTimeout within the
    timeout with its arrays untouched, and both ranks close their communicators."""
    world = hetcomm.init(name="skipped")
    xs = [np.full(100, my_rank() + 1.0) for _ in range(4)]
    world.all_reduce_coalesced(xs)
    first = all(bool((x == 3).all()) for x in xs)
    timed_out: float | None = None
    untouched: bool | None = None
    if my_rank() == 0:
        ys = [np.full(100, 7.0) for _ in range(4)]
        start = time.monotonic()
        try:
            world.all_reduce_coalesced(ys, timeout=params["timeout"])
        except CommTimeout:
            timed_out = time.monotonic() - start
        untouched = all(bool((y == 7).all()) for y in ys)
    else:
        time.sleep(params["timeout"] + 1)
    world.close()
    report(ok=first, timed_out=timed_out, untouched=untouched)


@pytest.mark.parametrize("victim", [0, 1], ids=["sender dies", "receiver dies"])
def test_a_rank_dying_in_a_one_copy_message(
    hetcomm_mpirun: tuple[list[str], dict[str, str]], victim: int
) -> None:
    """Staged, two ranks of one host, large host messages read from the sender's array
    (staged/pull.py): one rank SIGKILLs itself on a timer while a message is in flight; the
    survivor, let run on by the launcher, ends with a named HetcommError (PeerLost or
    CommTimeout) within its timeout instead of waiting, and never with wrong data."""
    result = _with_recovery(
        hetcomm_mpirun, 2, pull_death, {"victim": victim}, "HETCOMM_TRANSPORT=staged"
    )
    print(f"death in a one-copy message: exit {result.returncode} after {result.seconds:.1f} s")
    assert result.seconds < DEADLINE_S, result.explain()
    survivors = [r for r in result.results if r["rank"] != victim]
    assert len(survivors) == 1, result.explain()
    got = survivors[0]
    assert got["pulled"] or got["skip"], result.explain()  # the path under test was taken
    assert got["wrong"] == 0, result.explain()
    if not got["skip"]:
        assert got["hetcomm"] and got["error"] in ("PeerLost", "CommTimeout"), result.explain()
        assert got["seconds"] < 10, result.explain()


def pull_death(params: dict[str, Any]) -> None:
    """Rank 0 sends 4 MiB host messages to rank 1 in a loop, checked on arrival; rank
    `victim` SIGKILLs itself 0.5 s in. The survivor reports how its last call ended."""
    import threading

    from hetcomm import introspect

    world = hetcomm.init(name="pull")
    rank, peer = my_rank(), 1 - my_rank()
    x = np.zeros(1 << 20, np.float32)
    if rank == 0:
        world.send(x, peer)
    else:
        world.recv(x, peer)
    staged = introspect.transports(world)["staged"]
    inbox = introspect.channels(staged)[peer].eager_in
    skip = inbox is None or (rank == 1 and inbox.reads_why is not None)
    if rank == params["victim"]:
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGKILL)).start()
    wrong, error, seconds = 0, None, 0.0
    start = time.monotonic()
    try:
        for i in range(1_000_000):
            start = time.monotonic()
            if rank == 0:
                x.fill(i)
                world.send(x, peer)
            else:
                world.recv(x, peer)
                wrong += int(not (x == i).all())
    except hetcomm.HetcommError as exc:
        error, seconds = type(exc).__name__, time.monotonic() - start
    pulled = staged.paths["recv pull"] + staged.paths["send pull"] > 0
    report(
        error=error,
        hetcomm=error is not None,
        seconds=seconds,
        wrong=wrong,
        pulled=pulled,
        skip=skip,
    )
    # the survivor leaves without MPI_Finalize, which may wait for the dead rank for ever
    os._exit(0)
