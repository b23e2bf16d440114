"""Shared by the rail tests: paths, the MPI launch, jobs of _job.py and their results."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from hetcomm.testing import MpiJob as Job
from hetcomm.testing import clean_environ as _clean_environ
from hetcomm.testing import mpirun_command, run_mpi_job

__all__ = ["Job", "mpirun_command"]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
JOB = HERE / "_job.py"
EMULATE = ROOT / "scripts" / "emulate-rails"
# two rails on plain loopback: every 127.x.y.z address works on `lo`, no namespace needed
TWO_RAILS = "127.0.1.1,127.0.2.1"
# one job's limit: timeout(1) ends mpirun (and mpirun its ranks) after this long
JOB_LIMIT_S = 60


def clean_environ(**extra: str) -> dict[str, str]:
    """A job's environment: without launcher, hetcomm or emulator variables, plus `extra`."""
    return _clean_environ("EMULATE_RAILS_", **extra)


def run(argv: list[str], env: dict[str, str], limit: float = JOB_LIMIT_S) -> Job:
    """Run `argv` under timeout(1); collect the RESULT lines of its ranks."""
    return run_mpi_job(argv, env, limit)


def emulator_unusable() -> str | None:
    """Why scripts/emulate-rails cannot run here (None when it can)."""
    if os.geteuid() != 0:
        return "the rail emulator needs root (network namespaces, tc)"
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        return f"the rail emulator needs iproute2 ({', '.join(missing)} missing)"
    probe = subprocess.run(
        [str(EMULATE), "--rails", "1", "--rate", "1gbit", "--", "true"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    if probe.returncode != 0:
        return f"scripts/emulate-rails cannot run here: {probe.stderr.strip()[-300:]}"
    return None
