"""Shared by the rail tests: paths, the MPI launch, the helpers their scenarios use on the ranks."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import hetcomm
from hetcomm import introspect
from hetcomm.testing import MpiJob as Job
from hetcomm.testing import clean_environ as _clean_environ
from hetcomm.testing import mpirun_command, run_mpi_job, simulated_config

__all__ = ["Job", "mpirun_command"]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
EMULATE = ROOT / "scripts" / "emulate-rails"
# two rails on plain loopback: every 127.x.y.z address works on `lo`, no namespace needed
TWO_RAILS = "127.0.1.1,127.0.2.1"
# one job's limit: timeout(1) ends mpirun (and mpirun its ranks) after this long
JOB_LIMIT_S = 60


# a job's environment leaves out the emulator's variables too
DROP = ("EMULATE_RAILS_",)


def clean_environ(**extra: str) -> dict[str, str]:
    """A job's environment: without launcher, hetcomm or emulator variables, plus `extra`."""
    return _clean_environ(*DROP, **extra)


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


# ---- used on the ranks, by the scenarios of the test modules -------------------------


def world() -> Any:
    """MPI.COMM_WORLD, imported on the ranks only (the test process never initialises MPI)."""
    from mpi4py import MPI

    return MPI.COMM_WORLD


MiB = 1 << 20


def open_comm(params: dict[str, Any], **options: Any) -> Any:
    """A communicator over COMM_WORLD; each rank its own host when params['hosts']."""
    hosts = [f"host{i}" for i in range(world().Get_size())] if params.get("hosts") else None
    return hetcomm.init(config=simulated_config(world().Get_rank(), hosts=hosts, **options))


def staged(comm: Any, chunk_bytes: int | None = None) -> Any:
    """The communicator's staged transport, made now (before any operation) so that its chunk
    size can still be changed. These jobs test the rails: eager messages are off."""
    introspect.transport_of(comm, "send", np.zeros(1, np.uint8))
    t = introspect.transports(comm)["staged"]
    t.eager_bytes = 0
    if chunk_bytes is not None:
        t.chunk_bytes = chunk_bytes
    return t


def pattern(nbytes: int, seed: int) -> np.ndarray:
    """Bytes that differ from chunk to chunk and from message to message."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def rail_bytes(t: Any) -> dict[str, int]:
    """transport.stats summed per rail: 'tcp0 127.0.1.1 -> ...' counts as 'tcp0'."""
    out: dict[str, int] = {}
    for name, n in list(t.stats.items()):
        key = name.split()[0]
        out[key] = out.get(key, 0) + n
    return out


def first_difference(got: np.ndarray, want: np.ndarray) -> str:
    if got.shape != want.shape:
        return f"shape {got.shape} != {want.shape}"
    bad = np.flatnonzero(got.reshape(-1).view(np.uint8) != want.reshape(-1).view(np.uint8))
    if not len(bad):
        return ""
    return f"{len(bad)} bytes differ, first at byte {int(bad[0])}"


def timed(call: Any, result: dict[str, Any], error: str, seconds: str) -> None:
    """Run `call()`, putting into `result` how long it took (key `seconds`) and what it raised,
    if anything (key `error`)."""
    t0 = time.monotonic()
    try:
        call()
    except Exception as exc:
        result[error] = f"{type(exc).__name__}: {exc}"
    result[seconds] = round(time.monotonic() - t0, 3)


def close(comm: Any, result: dict[str, Any]) -> None:
    """Close `comm` (also after a failed operation: that stops the transport's threads, which
    must not be inside MPI calls when MPI finalizes), timing it."""
    timed(comm.close, result, "close_error", "close_s")


def _wait_until(what: Callable[[], bool], limit: float) -> bool:
    end = time.monotonic() + limit
    while not what():
        if time.monotonic() > end:
            return False
        time.sleep(0.0005)
    return True
