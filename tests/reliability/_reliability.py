"""Shared by the reliability tests: the MPI launch, the helpers their scenarios use on the ranks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hetcomm.testing import MpiJob as Job
from hetcomm.testing import clean_environ, mpirun_command, run_mpi_job

__all__ = ["Job", "clean_environ", "mpirun_command"]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def run(argv: list[str], env: dict[str, str], limit: float) -> Job:
    """Run `argv` under timeout(1) (the guard against a hang); collect the RESULT lines."""
    return run_mpi_job(argv, env, limit)


# ---- used on the ranks, by the scenarios of the test modules -------------------------


def my_rank() -> int:
    """This rank in MPI.COMM_WORLD (MPI is imported on the ranks only, never in the test
    process)."""
    from mpi4py import MPI

    return int(MPI.COMM_WORLD.Get_rank())


def report(**result: Any) -> None:
    """Print this rank's `RESULT {json}` line (scenarios that report before they close)."""
    print("RESULT " + json.dumps({"rank": my_rank(), **result}), flush=True)
