"""Fixtures of the reliability tests: ordinary pytest tests (not run under mpirun) that start
small MPI jobs with subprocess, each bounded by timeout(1), that run a scenario (a function of
the test module, beside the test's assertions) on every rank, and read the `RESULT {json}` line
of each."""

from __future__ import annotations

from typing import Any

import pytest
from _reliability import Job

from hetcomm.testing import Scenario, run_scenario


@pytest.fixture
def job(hetcomm_mpirun: tuple[list[str], dict[str, str]]) -> Any:
    """job(n, scenario, params, limit, **HETCOMM_variables) runs `scenario(params)` (a
    function of the test module) on n ranks."""

    def start(
        n: int,
        scenario: Scenario,
        params: dict[str, Any] | None = None,
        limit: float = 120,
        **variables: str,
    ) -> Job:
        return run_scenario(hetcomm_mpirun, scenario, params, n=n, variables=variables, limit=limit)

    return start
