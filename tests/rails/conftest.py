"""Fixtures of the rail tests (the helpers live in _rails.py, a module name of their own).

These tests are ordinary pytest tests (not run under mpirun): each starts its own small job
with subprocess, bounded by timeout(1), and parses the `RESULT {json}` line of every rank. The
emulator tests also need root, iproute2 and network namespaces; they skip, saying which is
missing, without them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from _rails import (
    EMULATE,
    JOB,
    JOB_LIMIT_S,
    Job,
    clean_environ,
    emulator_unusable,
    run,
)


@pytest.fixture
def job(hetcomm_mpirun: tuple[list[str], dict[str, str]]) -> Any:
    """job(scenario, params, **HETCOMM_variables) runs _job.py on 2 ranks with the staged
    transport forced; e.g. job("roundtrip", {"hosts": True}, HETCOMM_RAILS=TWO_RAILS)."""

    def start(
        scenario: str,
        params: dict[str, Any] | None = None,
        limit: float = JOB_LIMIT_S,
        **variables: str,
    ) -> Job:
        prefix, mpi_env = hetcomm_mpirun
        settings = {"HETCOMM_TRANSPORT": "staged", "HETCOMM_TIMEOUT": "30", **variables}
        argv = [
            *prefix,
            "-n",
            "2",
            "env",
            *(f"{k}={v}" for k, v in settings.items()),
            sys.executable,
            "-m",
            "mpi4py",
            str(JOB),
            scenario,
            json.dumps(params or {}),
        ]
        return run(argv, clean_environ(**mpi_env), limit)

    return start


@pytest.fixture(scope="session")
def emulator() -> Path:
    """The emulator script; skips the test (with the reason) where it cannot work."""
    why = emulator_unusable()
    if why:
        pytest.skip(why)
    return EMULATE
