"""Shared by the reliability tests: the MPI launch and the jobs of _jobs.py with their results."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from hetcomm.testing import MpiJob as Job
from hetcomm.testing import clean_environ, mpirun_command, run_mpi_job

__all__ = ["Job", "clean_environ", "mpirun_command"]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
JOBS = HERE / "_jobs.py"


def run(argv: list[str], env: dict[str, str], limit: float) -> Job:
    """Run `argv` under timeout(1) (the guard against a hang); collect the RESULT lines."""
    return run_mpi_job(argv, env, limit)


def job_argv(
    prefix: list[str], n: int, scenario: str, params: dict[str, Any], variables: dict[str, str]
) -> list[str]:
    """mpirun -n N env VARS... python -m mpi4py _jobs.py SCENARIO PARAMS."""
    return [
        *prefix,
        "-n",
        str(n),
        "env",
        *(f"{k}={v}" for k, v in variables.items()),
        sys.executable,
        "-m",
        "mpi4py",
        str(JOBS),
        scenario,
        json.dumps(params),
    ]
