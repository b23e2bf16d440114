"""scripts/soak: the short version (two runs of the demo job, one per transport), a run that
times out, and how the outcome of a run is read from its output."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from soak import classify  # noqa: E402

CHECKED = (
    "losses match the one-process run to float32 rounding: {}\n"
    "final weights match (largest relative difference 7.8e-08): {}\n"
)


def soak(tmp_path: Path, *args: str, limit: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(ROOT / "scripts" / "soak"), "--keep", str(tmp_path), *args],
        capture_output=True,
        text=True,
        timeout=limit,
        check=False,
    )


def test_short_soak_passes_on_both_transports(tmp_path: Path) -> None:
    done = soak(tmp_path, "--runs", "2", "--minutes", "2", limit=240)
    print(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "soak: 2 runs in" in done.stdout
    assert "2 ok, 0 mismatch, 0 timeout, 0 crash" in done.stdout, done.stdout
    assert (
        "transport auto: 1 of 1 ok" in done.stdout and "transport staged: 1 of 1 ok" in done.stdout
    )
    assert list(tmp_path.iterdir()) == []  # nothing kept: no run failed


def test_a_run_that_times_out_fails_the_soak(tmp_path: Path) -> None:
    done = soak(tmp_path, "--runs", "1", "--run-timeout", "1", "--transports", "auto", limit=60)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "0 ok, 0 mismatch, 1 timeout, 0 crash" in done.stdout, done.stdout
    logs = list(tmp_path.iterdir())
    assert [p.name for p in logs] == ["run0000-auto-timeout.log"]
    assert logs[0].read_text().startswith("exit 124 after ")


@pytest.mark.parametrize(
    ("returncode", "output", "outcome"),
    [
        (0, "step ...\n" + CHECKED.format("yes", "yes"), "ok"),
        (1, CHECKED.format("NO", "yes"), "mismatch"),
        (1, CHECKED.format("yes", "NO"), "mismatch"),
        (0, CHECKED.format("yes", "NO"), "mismatch"),
        (124, "", "timeout"),
        (137, CHECKED.format("yes", "yes"), "timeout"),
        (1, "Traceback (most recent call last): ...", "crash"),
        (0, "topology: ...\n", "crash"),  # exit 0 without the check: not a pass
        (139, "", "crash"),
    ],
)
def test_outcome_of_a_run(returncode: int, output: str, outcome: str) -> None:
    assert classify(returncode, output) == outcome
