"""Fixtures of the reliability tests: ordinary pytest tests (not run under mpirun) that start
small MPI jobs of _jobs.py with subprocess, each bounded by timeout(1), and read the
`RESULT {json}` line of every rank."""

from __future__ import annotations

from typing import Any

import pytest
from _reliability import Job, clean_environ, job_argv, run


@pytest.fixture
def job(hetcomm_mpirun: tuple[list[str], dict[str, str]]) -> Any:
    """job(n, scenario, params, limit, **HETCOMM_variables) runs _jobs.py on n ranks."""

    def start(
        n: int,
        scenario: str,
        params: dict[str, Any] | None = None,
        limit: float = 120,
        **variables: str,
    ) -> Job:
        prefix, mpi_env = hetcomm_mpirun
        argv = job_argv(prefix, n, scenario, params or {}, variables)
        return run(argv, clean_environ(**mpi_env), limit)

    return start
