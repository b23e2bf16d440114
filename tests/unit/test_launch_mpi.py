"""Unit tests for hetcomm.launch.mpi: MPI flavour and version from banners, launcher helpers."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest
from hetcomm.launch.mpi import FLAVOURS, find_mpirun, flavour, root_environment, version

OPENMPI5 = (
    "Open MPI v5.0.11, package: Open MPI builder@buildhost Distribution, ident: 5.0.11, "
    "repo rev: v5.0.11, Feb 04, 2026"
)
OPENMPI4 = "mpirun (Open MPI) 4.1.6\n\nReport bugs to http://www.open-mpi.org/community/help/\n"
PRRTE = "prterun (PRRTE) 3.0.6\n\nReport bugs to https://github.com/openpmix/prrte\n"
ORTE = "Open RTE v4.0.3, package: Open MPI"
MPICH = "MPICH Version:      4.1\nMPICH Release date: Fri Jan 27 13:54:44 CST 2023\n"
HYDRA = (
    "HYDRA build details:\n"
    "    Version:                                 4.1.2\n"
    "    Release Date:                            Wed Jun  7 15:22:45 CDT 2023\n"
    "    CC:                              gcc\n"
)
INTEL = "Intel(R) MPI Library 2021.10"
INTEL_FULL = (
    "Intel(R) MPI Library for Linux* OS, Version 2021.10 Build 20230619 (id: c2e19c2f3e)\n"
    "Copyright 2003-2023, Intel Corporation.\n"
)
INTEL_HYDRA = "HYDRA build details:\n    Version: 2021.10\n    Intel(R) MPI Library\n"
MVAPICH2 = "MVAPICH2 Version:     \t2.3.7\nMVAPICH2 Release date:\tWed March 02 22:00:00 EST 2022\n"
MVAPICH_HYDRA = "HYDRA build details:\n    Version: 3.0\n    MVAPICH 3.0 based on MPICH 4.1\n"


@pytest.mark.parametrize(
    ("banner", "expected_flavour", "expected_version"),
    [
        (OPENMPI5, "openmpi", "5.0.11"),
        (OPENMPI4, "openmpi", "4.1.6"),
        (PRRTE, "openmpi", "3.0.6"),
        (ORTE, "openmpi", "4.0.3"),
        (MPICH, "mpich", "4.1"),
        (HYDRA, "mpich", "4.1.2"),
        (INTEL, "intel", "2021.10"),
        (INTEL_FULL, "intel", "2021.10"),
        (INTEL_HYDRA, "intel", "2021.10"),
        (MVAPICH2, "mvapich", "2.3.7"),
        (MVAPICH_HYDRA, "mvapich", "3.0"),
    ],
    ids=[
        "openmpi5",
        "openmpi4",
        "prrte",
        "orte",
        "mpich",
        "hydra",
        "intel",
        "intel-full",
        "intel-hydra",
        "mvapich2",
        "mvapich-hydra",
    ],
)
def test_banners(banner: str, expected_flavour: str, expected_version: str) -> None:
    assert flavour(banner) == expected_flavour
    assert version(banner) == expected_version


@pytest.mark.parametrize(
    "banner",
    [
        "",
        "mpiexec: command not found",
        "srun: slurm 23.02.7",
        "Microsoft MPI Startup Program",
        "some launcher 1.2.3",
        "MPI",
    ],
)
def test_unknown_flavour(banner: str) -> None:
    assert flavour(banner) == "unknown"


@pytest.mark.parametrize(
    ("banner", "expected"),
    [
        ("open mpi v5.0.0", "openmpi"),
        ("OPEN MPI", "openmpi"),
        ("mpich version: 4.2", "mpich"),
        ("hydra build details", "mpich"),
        ("intel mpi library 2019", "intel"),
        ("mvapich2 2.3", "mvapich"),
    ],
)
def test_flavour_is_case_insensitive(banner: str, expected: str) -> None:
    assert flavour(banner) == expected


def test_flavours_are_known() -> None:
    banners = [OPENMPI5, OPENMPI4, PRRTE, MPICH, HYDRA, INTEL, MVAPICH2, "", "???"]
    assert {flavour(b) for b in banners} == set(FLAVOURS)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", None),
        ("no numbers here", None),
        ("v5", None),
        ("Open MPI v5.0.0rc12", "5.0.0"),
        ("release 10.4.0.03", "10.4.0"),
        ("x 1.2 then 3.4.5", "1.2"),
        ("12.0", "12.0"),
    ],
)
def test_version(text: str, expected: str | None) -> None:
    assert version(text) == expected


@pytest.mark.parametrize("name", FLAVOURS)
def test_root_environment(name: str) -> None:
    as_user = root_environment(name, is_root=False)
    assert as_user == {}
    as_root = root_environment(name, is_root=True)
    if name == "openmpi":
        assert as_root == {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    else:
        assert as_root == {}


def test_root_environment_is_a_fresh_dict() -> None:
    env = root_environment("openmpi", True)
    env["OMPI_ALLOW_RUN_AS_ROOT"] = "0"
    env.clear()
    assert root_environment("openmpi", True)["OMPI_ALLOW_RUN_AS_ROOT"] == "1"


def _executable(path: Path) -> Path:
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_find_mpirun_beside_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    mpirun = _executable(venv_bin / "mpirun")
    on_path = tmp_path / "path"
    on_path.mkdir()
    _executable(on_path / "mpirun")
    monkeypatch.setattr(sys, "executable", str(venv_bin / "python"))
    monkeypatch.setenv("PATH", str(on_path))
    assert find_mpirun() == str(mpirun)


def test_find_mpirun_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    (tmp_path / "mpirun").write_text("not executable")  # beside python, but not executable
    on_path = tmp_path / "path"
    on_path.mkdir()
    monkeypatch.setenv("PATH", str(on_path))
    assert find_mpirun() is None
    mpiexec = _executable(on_path / "mpiexec")
    assert find_mpirun() == str(mpiexec)
    mpirun = _executable(on_path / "mpirun")
    assert find_mpirun() == str(mpirun)  # mpirun before mpiexec
    assert os.path.dirname(find_mpirun() or "") == str(on_path)
