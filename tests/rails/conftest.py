"""Fixtures of the rail tests (the helpers live in _rails.py, a module name of their own).

These tests are ordinary pytest tests (not run under mpirun): each starts its own small job
with subprocess, bounded by timeout(1), that runs a scenario (a function of the test module,
beside the test's assertions) on every rank, and reads the `RESULT {json}` line of each. The
emulator tests also need root, iproute2 and network namespaces; they skip, saying which is
missing, without them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _rails import DROP, EMULATE, JOB_LIMIT_S, Job, emulator_unusable

from hetcomm.testing import Scenario, run_scenario


@pytest.fixture
def job(hetcomm_mpirun: tuple[list[str], dict[str, str]]) -> Any:
    """job(scenario, params, **HETCOMM_variables) runs `scenario(params)` (a function of the
    test module) on 2 ranks with the staged transport forced; e.g.
    job(roundtrip, {"hosts": True}, HETCOMM_RAILS=TWO_RAILS)."""

    def start(
        scenario: Scenario,
        params: dict[str, Any] | None = None,
        limit: float = JOB_LIMIT_S,
        **variables: str,
    ) -> Job:
        settings = {"HETCOMM_TRANSPORT": "staged", "HETCOMM_TIMEOUT": "30", **variables}
        return run_scenario(
            hetcomm_mpirun, scenario, params, variables=settings, limit=limit, drop=DROP
        )

    return start


@pytest.fixture(scope="session")
def emulator() -> Path:
    """The emulator script; skips the test (with the reason) where it cannot work."""
    why = emulator_unusable()
    if why:
        pytest.skip(why)
    return EMULATE
