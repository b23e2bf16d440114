"""Shared by the reliability tests: the MPI launch and the jobs of _jobs.py with their results."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
JOBS = HERE / "_jobs.py"


@dataclass
class Job:
    """A finished job: exit status, output, each rank's result (by rank) and its duration."""

    returncode: int
    stdout: str
    stderr: str
    results: list[dict[str, Any]]
    seconds: float

    def explain(self) -> str:
        return (f"exit {self.returncode} after {self.seconds:.1f} s\n--- stdout\n"
                f"{self.stdout[-4000:]}\n--- stderr\n{self.stderr[-4000:]}")  # fmt: skip


def mpirun_command() -> tuple[list[str], dict[str, str]] | None:
    """(mpirun argv prefix, variables it needs), or None without an MPI launcher."""
    venv = Path(sys.executable).parent / "mpirun"
    exe = str(venv) if venv.exists() else shutil.which("mpirun") or shutil.which("mpiexec")
    if exe is None:
        return None
    banner = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30,
                            check=False)  # fmt: skip
    cmd, env = [exe], {}
    if any(w in (banner.stdout + banner.stderr).lower() for w in ("open mpi", "prrte", "prterun")):
        cmd.append("--oversubscribe")
        if os.geteuid() == 0:
            env = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    return cmd, env


def clean_environ(**extra: str) -> dict[str, str]:
    """This process's environment without launcher or hetcomm variables, plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HETCOMM_", "OMPI_", "PMIX_", "PRTE_", "PMI_", "SLURM_"))}  # fmt: skip
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def run(argv: list[str], env: dict[str, str], limit: float) -> Job:
    """Run `argv` under timeout(1) (the guard against a hang); collect the RESULT lines."""
    cmd = ["timeout", "--kill-after=10", str(int(limit)), *argv]
    start = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False,
                          stdin=subprocess.DEVNULL, timeout=limit + 30)  # fmt: skip
    seconds = time.monotonic() - start
    results = [json.loads(line[line.index("RESULT ") + 7 :]) for line in done.stdout.splitlines()
               if "RESULT {" in line]  # fmt: skip
    return Job(done.returncode, done.stdout, done.stderr, sorted(results, key=lambda r: r["rank"]),
               seconds)  # fmt: skip


def job_argv(prefix: list[str], n: int, scenario: str, params: dict[str, Any],
             variables: dict[str, str]) -> list[str]:  # fmt: skip
    """mpirun -n N env VARS... python -m mpi4py _jobs.py SCENARIO PARAMS."""
    return [*prefix, "-n", str(n), "env", *(f"{k}={v}" for k, v in variables.items()),
            sys.executable, "-m", "mpi4py", str(JOBS), scenario, json.dumps(params)]  # fmt: skip
