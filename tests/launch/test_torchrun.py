"""A real 2-rank job started with torchrun's command line, the program name changed to
`hetcomm run`, with the venv not activated (no python of it on PATH)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from hetcomm.testing import loopback_port

JOB = Path(__file__).with_name("_torchrun_job.py")


def test_torchrun_options_and_the_environments_python() -> None:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("HETCOMM_", "OMPI_", "PMIX_", "PRTE_", "SLURM_", "VIRTUAL_ENV"))
    }
    env["PATH"] = "/usr/bin:/bin"  # nothing of the venv: `python` must still be its python
    hetcomm = Path(sys.executable).with_name("hetcomm")
    port = loopback_port()
    argv = [str(hetcomm), "run", "--timeout", "90", "--nproc-per-node", "2"]
    argv += ["--master-port", str(port), str(JOB)]
    done = subprocess.run(
        ["timeout", "--kill-after=10", "120", *argv],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = sorted(
        (json.loads(x.partition("REPORT ")[2]) for x in done.stdout.splitlines() if "REPORT " in x),
        key=lambda r: r["rank"],
    )
    assert [r["rank"] for r in found] == [0, 1], done.stdout
    for r in found:
        assert r["size"] == 2
        assert r["python"] == sys.executable
        assert r["env"] == {
            "RANK": str(r["rank"]),
            "LOCAL_RANK": str(r["rank"]),
            "WORLD_SIZE": "2",
            "MASTER_PORT": str(port),
        }
        if r["torch"] is not None:
            assert r["torch"] == {"rank": r["rank"], "size": 2, "sum": [3.0] * 4}
