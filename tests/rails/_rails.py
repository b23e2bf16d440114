"""Shared by the rail tests: paths, the MPI launch, jobs of _job.py and their results."""

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
JOB = HERE / "_job.py"
EMULATE = ROOT / "scripts" / "emulate-rails"
BENCH = ROOT / "scripts" / "bench_rails.py"
# two rails on plain loopback: every 127.x.y.z address works on `lo`, no namespace needed
TWO_RAILS = "127.0.1.1,127.0.2.1"
# one job's limit: timeout(1) ends mpirun (and mpirun its ranks) after this long
JOB_LIMIT_S = 60


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

    def ranks(self, n: int = 2) -> list[dict[str, Any]]:
        """Every rank's result; fails the test (with the output) unless all n reported cleanly."""
        assert len(self.results) == n, f"expected {n} results\n{self.explain()}"
        for r in self.results:
            assert "crash" not in r, f"rank {r['rank']} crashed: {r['trace']}\n{self.explain()}"
        return self.results


def clean_environ(**extra: str) -> dict[str, str]:
    """This process's environment without launcher or hetcomm variables, plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HETCOMM_", "OMPI_", "PMIX_", "PRTE_", "PMI_", "SLURM_",
                                "EMULATE_RAILS_"))}  # fmt: skip
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def mpirun_command() -> tuple[list[str], dict[str, str]] | None:
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


def run(argv: list[str], env: dict[str, str], limit: float = JOB_LIMIT_S) -> Job:
    """Run `argv` under timeout(1); collect the RESULT lines of its ranks."""
    cmd = ["timeout", "--kill-after=10", str(int(limit)), *argv]
    start = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False,
                          stdin=subprocess.DEVNULL, timeout=limit + 30)  # fmt: skip
    seconds = time.monotonic() - start
    results = [json.loads(line[line.index("RESULT ") + 7 :]) for line in done.stdout.splitlines()
               if line.startswith("RESULT ")]  # fmt: skip
    return Job(done.returncode, done.stdout, done.stderr, sorted(results, key=lambda r: r["rank"]),
               seconds)  # fmt: skip


def emulator_unusable() -> str | None:
    """Why scripts/emulate-rails cannot run here (None when it can)."""
    if os.geteuid() != 0:
        return "the rail emulator needs root (network namespaces, tc)"
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        return f"the rail emulator needs iproute2 ({', '.join(missing)} missing)"
    probe = subprocess.run([str(EMULATE), "--rails", "1", "--rate", "1gbit", "--", "true"],
                           capture_output=True, text=True, timeout=60, check=False,
                           stdin=subprocess.DEVNULL)  # fmt: skip
    if probe.returncode != 0:
        return f"scripts/emulate-rails cannot run here: {probe.stderr.strip()[-300:]}"
    return None
