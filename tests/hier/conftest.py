"""Fixtures of the hier tests: ordinary pytest tests (not run under mpirun) that start small MPI
jobs running a scenario of the test module on every rank, each rank with its own simulated
vendor and host (Open MPI's MPMD syntax, `mpirun -n 2 env HETCOMM_VENDOR=nvidia ... : -n 2 env
HETCOMM_VENDOR=amd ...`), bounded by timeout(1), and read the `RESULT {json}` line of every
rank."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from hetcomm.testing import MpiJob, Scenario, clean_environ, run_mpi_job, run_scenario

MPI_TESTS = Path(__file__).resolve().parent.parent / "mpi"


def mpmd_argv(
    prefix: list[str],
    ranks: Sequence[tuple[int, str, str]],
    program: list[str],
    variables: dict[str, str],
) -> list[str]:
    """mpirun -n N1 env VENDOR/HOST/VARS python -m mpi4py PROGRAM... : -n N2 env ... for each
    (count, vendor, host) of `ranks`, in rank order."""
    argv = list(prefix)
    for i, (count, vendor, host) in enumerate(ranks):
        if i:
            argv.append(":")
        settings = {"HETCOMM_VENDOR": vendor, "HETCOMM_HOST": host, **variables}
        argv += [
            "-n",
            str(count),
            "env",
            *(f"{k}={v}" for k, v in settings.items()),
            sys.executable,
            "-m",
            "mpi4py",
            *program,
        ]
    return argv


@pytest.fixture
def hier_job(hetcomm_mpirun: tuple[list[str], dict[str, str]]) -> Any:
    """hier_job(ranks, scenario, params, limit, **HETCOMM_variables) -> MpiJob runs
    `scenario(params)` (a function of the test module) on every rank; `ranks` lists (count,
    vendor, host) in rank order, and the hier transport is forced for every group."""

    def start(
        ranks: Sequence[tuple[int, str, str]],
        scenario: Scenario,
        params: dict[str, Any] | None = None,
        limit: float = 120,
        **variables: str,
    ) -> MpiJob:
        pytest.importorskip("torch", reason="the hier scenarios use torch (bfloat16)")
        settings = {"HETCOMM_TRANSPORT": "hier", "HETCOMM_TIMEOUT": "60", **variables}
        groups = [
            (count, {"HETCOMM_VENDOR": vendor, "HETCOMM_HOST": host})
            for count, vendor, host in ranks
        ]
        return run_scenario(
            hetcomm_mpirun, scenario, params, variables=settings, groups=groups, limit=limit
        )

    return start


@pytest.fixture
def hier_pytest(hetcomm_mpirun: tuple[list[str], dict[str, str]]) -> Any:
    """hier_pytest(ranks, files, limit) -> MpiJob: test files of tests/mpi run under mpirun on
    those simulated islands, with hier forced for every group."""

    def start(
        ranks: Sequence[tuple[int, str, str]], files: Sequence[str], limit: float = 150
    ) -> MpiJob:
        pytest.importorskip("torch", reason="those tests/mpi files use torch (tests/mpi/_data.py)")
        prefix, mpi_env = hetcomm_mpirun
        program = [
            "-m",
            "pytest",
            "--with-mpi",
            "-q",
            "-p",
            "no:cacheprovider",
            "--hetcomm-transport=hier",
            *(str(MPI_TESTS / f) for f in files),
        ]
        argv = mpmd_argv(prefix, ranks, program, {})
        return run_mpi_job(argv, clean_environ(**mpi_env), limit)

    return start
