"""Unit tests for `hetcomm run` (hetcomm.run) and the shim, with fake launchers: no MPI needed."""

from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hetcomm.launch.rankenv import PLAN_VARIABLE, LaunchPlan

from hetcomm import Config
from hetcomm.cli import main
from hetcomm.run import TIMEOUT_EXIT, execute

BANNERS = {
    "mpirun": "mpirun (Open MPI) 5.0.11",
    "mpiexec.hydra": "HYDRA build details:\n    Version:   4.1.2",
    "intel-mpirun": "Intel(R) MPI Library for Linux* OS, Version 2021.10 Build 20230619",
    "srun": "slurm 23.02.7",
}


def fake_launcher(folder: Path, name: str, banner: str) -> Path:
    path = folder / name
    answer = f"printf '%s\\n' {shlex.quote(banner)}"
    path.write_text(f'#!/bin/sh\nif [ "$1" = --version ]; then {answer}; exit 0; fi\nexit 99\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith(("HETCOMM_", "SLURM_", "OMPI_", "PMI_", "PMIX_")):
            monkeypatch.delenv(key)


@pytest.mark.parametrize(
    ("name", "expect"),
    [
        ("mpirun", "-x _HETCOMM_LAUNCH_PLAN"),
        ("mpiexec.hydra", "-genvlist _HETCOMM_LAUNCH_PLAN"),
        ("intel-mpirun", "-genvlist _HETCOMM_LAUNCH_PLAN"),
        ("srun", "--export=ALL"),
    ],
)
def test_dry_run_through_the_cli(
    name: str, expect: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], clean_env: None
) -> None:
    launcher = fake_launcher(tmp_path, name, BANNERS[name])
    code = main(
        [
            "run",
            "-n",
            "2",
            "--launcher",
            str(launcher),
            "--simulate-vendors",
            "nvidia,amd",
            "--dry-run",
            "--",
            "python",
            "train.py",
            "--epochs",
            "1",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    command = next(line for line in out.splitlines() if str(launcher) in line and "shim" in line)
    assert expect in command
    # `python` is the interpreter hetcomm run runs under
    shim = f"-m hetcomm.launch.shim -- {sys.executable} -m mpi4py train.py --epochs 1"
    assert command.endswith(shim)
    words = shlex.split(command)
    plan_word = next(w for w in words if w.startswith(PLAN_VARIABLE + "="))
    plan = LaunchPlan.from_json(plan_word.partition("=")[2])
    assert plan.vendors == ("nvidia", "amd") and plan.size == 2
    assert "rank 0 (" in out and "HETCOMM_VENDOR=nvidia" in out
    assert "rank 1 (" in out and "HETCOMM_VENDOR=amd" in out


def test_missing_launcher(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["run", "-n", "2", "--launcher", str(tmp_path / "mpirun"), "--", "true"])
    err = capsys.readouterr().err
    assert code == 127
    assert "does not exist" in err and "  1. pip install" in err and "module load openmpi" in err


def test_bad_options(tmp_path: Path, capsys: pytest.CaptureFixture[str], clean_env: None) -> None:
    launcher = fake_launcher(tmp_path, "mpirun", BANNERS["mpirun"])
    assert main(["run", "--launcher", str(launcher), "--", "true"]) == 2
    assert "-n N is required" in capsys.readouterr().err
    assert (
        main(["run", "-n", "2", "--simulate-hosts", "3", "--launcher", str(launcher), "--", "true"])
        == 2
    )
    assert "--simulate-hosts" in capsys.readouterr().err
    unknown = fake_launcher(tmp_path, "mystery", "mystery launcher 1.0")
    assert main(["run", "-n", "2", "--launcher", str(unknown), "--", "true"]) == 2
    assert "cannot tell which MPI" in capsys.readouterr().err


def test_slurm_ntasks_is_the_default(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    clean_env: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    launcher = fake_launcher(tmp_path, "srun", BANNERS["srun"])
    monkeypatch.setenv("SLURM_NTASKS", "3")
    assert main(["run", "--launcher", str(launcher), "--dry-run", "--", "./a.out"]) == 0
    assert "--ntasks=3" in capsys.readouterr().out


def test_the_console_script_end_to_end(tmp_path: Path) -> None:
    launcher = fake_launcher(tmp_path, "mpiexec.hydra", BANNERS["mpiexec.hydra"])
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETCOMM_")}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "hetcomm",
            "run",
            "-n",
            "2",
            "--launcher",
            str(launcher),
            "--verbose",
            "--",
            "true",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert done.returncode == 99  # the fake launcher's own exit status comes back
    assert "-genvlist" in done.stderr and "rank 1 (" in done.stderr  # --verbose: to stderr


# ---- running, timing out, exit codes ------------------------------------------------------------


def test_exit_status_passes_through() -> None:
    assert execute(["sh", "-c", "exit 3"], os.environ, None) == 3
    assert execute(["sh", "-c", "kill -9 $$"], os.environ, None) == 128 + 9
    assert execute(["sh", "-c", "exit 0"], os.environ, 30) == 0


def test_timeout_ends_the_whole_session(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    # a "launcher" that starts a rank in a process group of its own (as PRRTE does) and hangs
    script = (
        "import os, subprocess, time\n"
        "rank = subprocess.Popen(['sleep', '60'], preexec_fn=os.setpgrp)\n"
        f"open({str(pids)!r}, 'w').write(str(rank.pid))\n"
        "time.sleep(60)\n"
    )
    start = time.monotonic()
    code = execute([sys.executable, "-c", script], os.environ, 1.5)
    took = time.monotonic() - start
    assert code == TIMEOUT_EXIT
    assert took < 15
    rank = int(pids.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _alive(rank):
        time.sleep(0.05)
    assert not _alive(rank), "the rank in its own process group outlived the timeout"


def _alive(pid: int) -> bool:
    try:
        stat_ = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat_[stat_.rfind(")") + 2] != "Z"


# ---- the shim -----------------------------------------------------------------------------------

PRINT_ENV = "import json, os; print(json.dumps(dict(os.environ)))"


def run_shim(
    plan: str | None, rank_vars: dict[str, str], *command: str
) -> subprocess.CompletedProcess[str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("HETCOMM_", "OMPI_", "PMI", "SLURM_"))
    }
    env.update(rank_vars)
    if plan is not None:
        env[PLAN_VARIABLE] = plan
    shim = [sys.executable, "-m", "hetcomm.launch.shim", "--", *command]
    return subprocess.run(shim, capture_output=True, text=True, timeout=60, env=env, check=False)


def test_shim_sets_the_environment_and_execs() -> None:
    plan = LaunchPlan("openmpi5", 4, ("nvidia", "amd"), 2, rails="lo").to_json()
    done = run_shim(
        plan,
        {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "3"},
        sys.executable,
        "-c",
        PRINT_ENV,
    )
    assert done.returncode == 0, done.stderr
    env = json.loads(done.stdout)
    assert PLAN_VARIABLE not in env
    assert (env["HETCOMM_VENDOR"], env["HETCOMM_HOST"], env["HETCOMM_RAILS"]) == (
        "amd",
        "sim1",
        "lo",
    )
    hetcomm_env = {k: v for k, v in env.items() if k.startswith("HETCOMM_")}
    config = Config.load(hetcomm_env)  # every variable the shim sets is one the library knows
    assert (config.vendor, config.host, config.rails) == ("amd", "sim1", "lo")


def test_shim_failures() -> None:
    ranks = {"PMI_RANK": "0", "MPI_LOCALRANKID": "0"}
    plan = LaunchPlan("mpich", 1).to_json()
    done = run_shim(None, ranks, "true")
    assert done.returncode == 2 and "start ranks with `hetcomm run`" in done.stderr
    done = run_shim("{bad", ranks, "true")
    assert done.returncode == 2 and "not JSON" in done.stderr
    done = run_shim(plan, {}, "true")
    assert done.returncode == 2 and "not started by an MPI launcher" in done.stderr
    done = run_shim(plan, ranks, "/nonexistent/program")
    assert done.returncode == 127 and "cannot start" in done.stderr
    done = run_shim(plan, ranks)
    assert done.returncode == 2 and "usage" in done.stderr
