"""The launcher command for a job: flags from the flavour's table, the shim, the user's command."""

from __future__ import annotations

import math
import os
import re
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..config import VENDORS
from . import affinity
from .flavours import Flavour
from .hosts import HostList, parse_host_list, placement, read_hostfile
from .mpi import root_environment
from .rankenv import PLAN_VARIABLE, LaunchPlan, PlanError

SHIM_MODULE = "hetcomm.launch.shim"
# variables every rank needs to find the same Python and libraries (exported where the launcher
# forwards only what it is told to, as Open MPI does to other hosts)
FORWARDED = ("PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "VIRTUAL_ENV")
_PYTHON = re.compile(r"^python(\d+(\.\d+)*)?$")
_PY_FLAGS_WITH_VALUE = ("-W", "-X")


class LaunchError(ValueError):
    """The options cannot make a launch command; the message says what to change."""


@dataclass(frozen=True)
class LaunchRequest:
    """What `hetcomm run` was asked for."""

    command: tuple[str, ...]
    n: int
    hostfile: str | None = None
    hosts: str | None = None
    vendors: tuple[str, ...] = ()
    simulate_hosts: int = 0
    rails: str = "auto"
    bind: str = "auto"  # auto, numa, core, none
    timeout: float | None = None
    tag_output: bool = False
    mpi4py_abort: bool = True
    # torchrun's variables for the ranks: (MASTER_ADDR or None for the first host, MASTER_PORT,
    # ranks per node); None: not set
    torchrun: tuple[str | None, int, int] | None = None


@dataclass(frozen=True)
class Launch:
    """The command to run and the variables to add to the launcher's environment."""

    argv: tuple[str, ...]
    env: dict[str, str]
    plan: LaunchPlan
    flavour: Flavour
    placement: tuple[tuple[str, int], ...]  # (host, local rank) of each rank, as assumed
    notes: tuple[str, ...] = field(default=())


def mpi4py_wrapped(command: Sequence[str], python: str = sys.executable) -> tuple[list[str], str]:
    """`python [opts] script|-m mod|-c cmd ...` with `-m mpi4py` inserted, and what was done.

    Under `python -m mpi4py`, an uncaught exception on one rank calls MPI_Abort, which ends the
    whole job, instead of leaving the other ranks blocked in their next collective.
    """
    cmd = list(command)
    if not cmd or not _is_python(cmd[0], python):
        return cmd, "not a Python command: run as given"
    i = 1
    while i < len(cmd):
        arg = cmd[i]
        if arg in ("-m", "-c") or arg == "--" or not arg.startswith("-") or arg == "-":
            break
        if arg in _PY_FLAGS_WITH_VALUE:
            i += 2
            continue
        if arg[:2] not in _PY_FLAGS_WITH_VALUE and (
            arg.startswith("--") or "c" in arg or "m" in arg
        ):
            return cmd, f"python option {arg!r} not understood: run as given"
        i += 1
    if i >= len(cmd) or cmd[i] in ("-", "--"):
        return cmd, "python without a script, -m or -c: run as given"
    if cmd[i] == "-m" and cmd[i + 1 : i + 2] == ["mpi4py"]:
        return cmd, "already runs under -m mpi4py"
    wrapped = [*cmd[:i], "-m", "mpi4py", *cmd[i:]]
    return wrapped, "inserted -m mpi4py: an exception on one rank aborts the whole job"


def resolve_python(command: Sequence[str], python: str = sys.executable) -> tuple[list[str], str]:
    """The command with a bare `python`, `python3` or `python3.X` (this interpreter's version)
    replaced by `python`, the interpreter `hetcomm run` runs under, and what was done.

    Always, not only when PATH has no python: `hetcomm run` started from a virtual environment
    (by its path, as a batch script does, with nothing activated) must start that environment's
    interpreter on every rank, where hetcomm, mpi4py and the user's packages are installed. A
    path (`/usr/bin/python3`) or another version is kept as given.
    """
    cmd = list(command)
    major, minor = sys.version_info[:2]
    if cmd and cmd[0] in ("python", f"python{major}", f"python{major}.{minor}"):
        was, cmd[0] = cmd[0], python
        return cmd, f"{was} is {python} (the interpreter hetcomm run runs under)"
    return cmd, ""


def _is_python(exe: str, python: str) -> bool:
    if _PYTHON.match(os.path.basename(exe)):
        return True
    try:
        return os.path.realpath(exe) == os.path.realpath(python) and os.path.exists(exe)
    except OSError:
        return False


def _fmt(args: Sequence[str], **values: object) -> list[str]:
    return [a.format(**values) for a in args]


def host_args(flavour: Flavour, hosts: HostList) -> list[str]:
    """The flavour's host-list flags for these hosts (slots inline, or one ranks-per-host)."""
    if "{slots}" in flavour.host_item:
        items = [f"{h.name}:{h.slots}" if h.slots else h.name for h in hosts.hosts]
        return _fmt(flavour.hosts, hosts=",".join(items))
    args = _fmt(flavour.hosts, hosts=",".join(h.name for h in hosts.hosts))
    counts = {h.slots for h in hosts.hosts}
    if counts == {None}:
        return args
    if len(counts) == 1 and flavour.hosts_need_equal_slots:
        return args + _fmt(flavour.hosts_need_equal_slots, ppn=counts.pop())
    raise LaunchError(
        f"{flavour.title} cannot give hosts different slot counts in a host list "
        f"({', '.join(f'{h.name}:{h.slots}' for h in hosts.hosts)}); give every host the same "
        "count, or pass a hostfile in the launcher's own syntax"
    )


def _check(request: LaunchRequest) -> None:
    if request.n < 1:
        raise LaunchError(f"-n: expected a positive number of ranks, got {request.n}")
    if not request.command:
        raise LaunchError("no command given: hetcomm run -n N [options] -- CMD [ARGS...]")
    bad = [v for v in request.vendors if v not in VENDORS]
    if bad:
        raise LaunchError(
            f"--simulate-vendors: expected names among {', '.join(VENDORS)}, got {bad}"
        )
    if not 0 <= request.simulate_hosts <= request.n:
        raise LaunchError(
            f"--simulate-hosts: expected 1..{request.n} (at most one host per rank), "
            f"got {request.simulate_hosts}"
        )
    if request.timeout is not None and not request.timeout > 0:
        raise LaunchError(
            f"--timeout: expected a positive number of seconds, got {request.timeout}"
        )
    if request.hostfile and request.hosts:
        raise LaunchError("give either --hostfile or -H/--host, not both")
    if request.bind not in ("auto", "numa", "core", "none"):
        raise LaunchError(f"--bind: expected auto, numa, core or none, got {request.bind!r}")


def build(
    request: LaunchRequest,
    flavour: Flavour,
    launcher: str,
    *,
    environ: Mapping[str, str],
    is_root: bool,
    python: str = sys.executable,
    root: str | os.PathLike[str] = "/",
) -> Launch:
    """The launch command and environment for `request` with this launcher (pure but for sysfs)."""
    _check(request)
    notes: list[str] = []
    argv = [launcher, *_fmt(flavour.count, n=request.n)]
    env: dict[str, str] = dict(root_environment(flavour.root_flavour or flavour.name, is_root))

    hosts: HostList | None = None
    if request.hostfile:
        hosts = read_hostfile(request.hostfile)
        if flavour.hostfile and hosts.syntax in ("names", flavour.hostfile_syntax):
            argv += _fmt(flavour.hostfile, path=request.hostfile)
        else:
            argv += host_args(flavour, hosts)
            notes.append(
                f"hostfile {request.hostfile} ({hosts.syntax} syntax) given to "
                f"{flavour.title} as a host list"
            )
    elif request.hosts:
        hosts = parse_host_list(request.hosts)
        argv += host_args(flavour, hosts)
    elif flavour.name != "slurm" and flavour.oversubscribe:
        argv += list(flavour.oversubscribe)  # one machine: as many ranks as asked, cores or not
        notes.append("one machine: oversubscription allowed")

    bind = request.bind
    if bind == "auto":
        bind = "numa" if affinity.gpus(root)[0] != "cpu" else "default"
    launcher_bind = "none" if bind == "numa" else bind
    if launcher_bind in ("none", "core"):
        if launcher_bind in flavour.bind:
            argv += list(flavour.bind[launcher_bind])
        elif launcher_bind in flavour.bind_env:
            env.update(flavour.bind_env[launcher_bind])
        else:
            notes.append(f"{flavour.title} has no CPU binding option: --bind {bind} ignored")
    if request.tag_output:
        argv += list(flavour.tag_output)
    argv += list(flavour.abort_on_error)
    if request.timeout is not None:
        seconds, minutes = math.ceil(request.timeout), math.ceil(request.timeout / 60)
        argv += _fmt(flavour.timeout, seconds=seconds, minutes=minutes)
        env.update({k: v.format(seconds=seconds) for k, v in flavour.timeout_env.items()})

    torchrun, per_node = "", 0
    if request.torchrun is not None:
        addr, port, per_node = request.torchrun
        if addr is None:
            addr = hosts.hosts[0].name if hosts is not None else socket.gethostname()
        torchrun = f"{addr}:{port}"
    try:
        plan = LaunchPlan(
            flavour=flavour.name,
            size=request.n,
            vendors=request.vendors,
            hosts=request.simulate_hosts,
            rails=request.rails,
            bind=bind,
            ucx=flavour.ucx,
            torchrun=torchrun,
            per_node=per_node,
        )
    except PlanError as e:
        raise LaunchError(str(e)) from None
    env[PLAN_VARIABLE] = plan.to_json()
    names = [
        PLAN_VARIABLE,
        *sorted(k for k in environ if k.startswith("HETCOMM_")),
        *(k for k in FORWARDED if k in environ),
    ]
    for name in names:
        argv += _fmt(flavour.export_each, name=name)
    argv += _fmt(flavour.export_list, names=",".join(names))

    command, note = resolve_python(request.command, python)
    if note:
        notes.append(note)
    command, note = (
        mpi4py_wrapped(command, python)
        if request.mpi4py_abort
        else (command, "run as given (--no-mpi4py)")
    )
    notes.append(note)
    argv += [python, "-m", SHIM_MODULE, "--", *command]

    if flavour.name == "slurm" and hosts is None:
        nodes = max(1, int(environ.get("SLURM_JOB_NUM_NODES") or environ.get("SLURM_NNODES") or 1))
        per = math.ceil(request.n / nodes)
        where = [(f"node{r // per}", r % per) for r in range(request.n)]
    else:
        where = placement(request.n, hosts)
    return Launch(tuple(argv), env, plan, flavour, tuple(where), tuple(notes))


def rank_launcher_environ(launch: Launch, rank: int, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables rank `rank` would find, as far as the shim reads them (for --dry-run)."""
    rank_var, local_var = launch.flavour.rank_vars[0]
    env = {k: v for k, v in environ.items() if k != PLAN_VARIABLE}
    env[rank_var] = str(rank)
    if local_var:
        env[local_var] = str(launch.placement[rank][1])
    return env
