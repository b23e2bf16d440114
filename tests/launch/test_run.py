"""Real `hetcomm run` jobs on this machine: simulated vendors and hosts, failures, timeouts.

Ordinary pytest tests (not run under mpirun): each starts `python -m hetcomm run` under
timeout(1) and checks what its ranks report. They need a working MPI (the venv's Open MPI).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from hetcomm.launch.rankenv import PLAN_VARIABLE

REPORT = Path(__file__).with_name("_rank_report.py")
# the job limits itself (--timeout); timeout(1) is the backstop should hetcomm run itself hang
HARD_LIMIT_S = 150


def hetcomm_run(
    *args: str, env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], float]:
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("HETCOMM_", "OMPI_", "PMIX_", "PRTE_", "SLURM_"))
    }
    clean.update(env or {})
    start = time.monotonic()
    done = subprocess.run(
        [
            "timeout",
            "--kill-after=10",
            str(HARD_LIMIT_S),
            sys.executable,
            "-m",
            "hetcomm",
            "run",
            *args,
        ],
        capture_output=True,
        text=True,
        env=clean,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    return done, time.monotonic() - start


def reports(done: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    found = [
        json.loads(line[line.index("REPORT ") + 7 :])
        for line in done.stdout.splitlines()
        if "REPORT " in line
    ]
    return sorted(found, key=lambda r: r["rank"])


def test_two_ranks_simulated_vendors_and_hosts() -> None:
    done, _ = hetcomm_run(
        "-n",
        "2",
        "--simulate-vendors",
        "nvidia,amd",
        "--simulate-hosts",
        "2",
        "--timeout",
        "100",
        "--",
        sys.executable,
        str(REPORT),
        env={"HETCOMM_TIMEOUT": "77"},
    )
    assert done.returncode == 0, done.stderr
    got = reports(done)
    assert [r["rank"] for r in got] == [0, 1]
    for r, vendor, host in zip(got, ("nvidia", "amd"), ("sim0", "sim1")):
        assert r["env"]["HETCOMM_VENDOR"] == vendor and r["env"]["HETCOMM_HOST"] == host
        assert PLAN_VARIABLE not in r["env"]  # the shim removes its plan before the command
        assert r["env"]["HETCOMM_TIMEOUT"] == "77" and r["timeout"] == 77.0  # forwarded as is
        assert r["vendors"] == ["nvidia", "amd"] and r["hosts"] == ["sim0", "sim1"]
        assert r["islands"] == [[0], [1]]


def test_four_ranks_cycle_vendors_over_host_blocks() -> None:
    done, _ = hetcomm_run(
        "-n",
        "4",
        "--simulate-vendors",
        "nvidia,amd,cpu",
        "--simulate-hosts",
        "2",
        "--rails",
        "127.0.0.1",
        "--tag-output",
        "--timeout",
        "100",
        "--",
        sys.executable,
        str(REPORT),
    )
    assert done.returncode == 0, done.stderr
    got = reports(done)
    assert [r["rank"] for r in got] == [0, 1, 2, 3]
    vendors = ["nvidia", "amd", "cpu", "nvidia"]
    hosts = ["sim0", "sim0", "sim1", "sim1"]
    for r in got:
        assert r["env"]["HETCOMM_VENDOR"] == vendors[r["rank"]]
        assert r["env"]["HETCOMM_HOST"] == hosts[r["rank"]]
        assert r["env"]["HETCOMM_RAILS"] == "127.0.0.1"
        assert r["vendors"] == vendors and r["hosts"] == hosts
        assert r["local_ranks"] == [0, 1, 0, 1]  # local to the simulated hosts
        assert r["islands"] == [[0], [1], [2], [3]]
    assert any(line.startswith("[1,") for line in done.stdout.splitlines())  # --tag-output


def test_a_rank_that_raises_ends_the_job() -> None:
    done, took = hetcomm_run(
        "-n", "2", "--timeout", "100", "--", sys.executable, str(REPORT), "raise"
    )
    assert done.returncode not in (0, 124), done.stderr
    assert "rank 1 fails on purpose" in done.stderr
    assert reports(done) == []
    assert took < 60, f"the job took {took:.0f} s to end after a rank raised"


def test_timeout_kills_a_sleeping_job() -> None:
    done, took = hetcomm_run(
        "-n", "2", "--timeout", "2", "--", sys.executable, "-c", "import time; time.sleep(120)"
    )
    assert done.returncode == 124, done.stderr
    assert "--timeout 2 s" in done.stderr
    assert took < 30


@pytest.mark.parametrize("flag", ["--dry-run", "--verbose"])
def test_dry_run_and_verbose_with_the_real_launcher(flag: str) -> None:
    done, _ = hetcomm_run(
        "-n",
        "2",
        "--simulate-vendors",
        "amd",
        flag,
        "--timeout",
        "100",
        "--",
        sys.executable,
        "-c",
        "print('ran')",
    )
    assert done.returncode == 0, done.stderr
    shown = done.stdout if flag == "--dry-run" else done.stderr
    assert "Open MPI" in shown and "-m hetcomm.launch.shim --" in shown
    assert "rank 1 (localhost, local rank 1): HETCOMM_VENDOR=amd" in shown
    if os.geteuid() == 0:
        assert "OMPI_ALLOW_RUN_AS_ROOT=1" in shown
    assert done.stdout.splitlines().count("ran") == (0 if flag == "--dry-run" else 2)
