"""`hetcomm run`: start a job through the installed MPI launcher, each rank bound and simulated."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from .launch import affinity, flavours, mpi, torchrun
from .launch.affinity import format_cpulist
from .launch.command import Launch, LaunchError, LaunchRequest, build, rank_launcher_environ
from .launch.hosts import HostSpecError
from .launch.rankenv import PLAN_VARIABLE, Addresses, rank_environment

TIMEOUT_EXIT = 124  # what timeout(1) returns
GRACE_S = 5.0  # between asking the launcher to stop and killing what is left

EPILOG = """\
examples:
  hetcomm run -n 4 -- python train.py
  hetcomm run -n 4 --simulate-vendors nvidia,amd --simulate-hosts 2 -- python -m mypkg.train
  hetcomm run -n 16 --hostfile hosts --timeout 3600 -- python train.py --epochs 3
  hetcomm run -n 8 --dry-run -- python train.py      # print the command and each rank's variables
  hetcomm run --nproc-per-node 4 train.py --lr 3     # a torchrun command line, renamed

`python` (or python3) in the command is the interpreter hetcomm run runs under, so that the
ranks use hetcomm's environment whether or not it is activated. A command that starts with
python and a script, -m module or -c code runs under `python -m mpi4py`, so that an exception
on one rank aborts the whole job (--no-mpi4py: as given). A command that starts with a .py
script (torchrun's form) runs with python. With torchrun's options each rank also gets the
variables torchrun sets (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...): docs/launch.md.
"""


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register `hetcomm run` on the subparsers object of the `hetcomm` command."""
    p = sub.add_parser(
        "run",
        help="start a job with the installed MPI launcher (mpirun, mpiexec.hydra, srun)",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "-n",
        "-np",
        "--np",
        dest="n",
        type=int,
        default=None,
        help="number of ranks (default under Slurm: SLURM_NTASKS)",
    )
    p.add_argument("--hostfile", help="hosts to run on: 'node slots=4' or 'node:4' lines")
    p.add_argument("-H", "--host", dest="hosts", help="hosts to run on: node1:4,node2:4")
    p.add_argument(
        "--simulate-vendors",
        default="",
        metavar="V1,V2,...",
        help="HETCOMM_VENDOR per rank, cycled: nvidia, amd, cpu",
    )
    p.add_argument(
        "--simulate-hosts",
        type=int,
        default=0,
        metavar="K",
        help="HETCOMM_HOST per rank: sim0..sim{K-1} in contiguous blocks of ranks",
    )
    p.add_argument(
        "--rails",
        default="auto",
        metavar="SPEC",
        help="NICs per rank: auto (nearest the rank's GPU, where sysfs tells), "
        "nic,nic (every rank) or nic,nic/nic,nic (by local rank)",
    )
    p.add_argument(
        "--bind",
        choices=("auto", "numa", "core", "none"),
        default="auto",
        help="CPU binding: numa (CPUs of the GPU's NUMA node), core, none; auto = numa "
        "with GPUs, else the launcher's default",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="S",
        help=f"end the whole job after S seconds; exit status {TIMEOUT_EXIT}",
    )
    p.add_argument("--tag-output", action="store_true", help="prefix output lines with the rank")
    p.add_argument("--launcher", help="the launcher to use (default: found, see docs/launch.md)")
    p.add_argument(
        "--no-mpi4py",
        dest="mpi4py",
        action="store_false",
        help="do not insert -m mpi4py into a python command",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the command and each rank's environment; start nothing",
    )
    p.add_argument("--verbose", "-v", action="store_true", help="print them, then run")
    torchrun.add_arguments(p)
    p.add_argument(
        "command", nargs=argparse.REMAINDER, help="-- CMD [ARGS...], or SCRIPT.py [ARGS...]"
    )
    p.set_defaults(func=main)
    return p


def _command(args: argparse.Namespace) -> list[str]:
    """The command to run: after `--`, or torchrun's SCRIPT [ARGS] (run with python)."""
    command = list(args.command)
    if command[:1] == ["--"]:
        return command[1:]
    if args.torchrun_no_python:
        return command
    if args.torchrun_module:
        return ["python", "-m", *command] if command else command
    if command and command[0].endswith(".py"):
        return ["python", *command]
    return command


def _torchrun(
    args: argparse.Namespace, environ: Mapping[str, str]
) -> tuple[int | None, tuple[str | None, int, int] | None, list[str]]:
    """(ranks, torchrun's variables for LaunchRequest, notes) from torchrun's options."""
    if not torchrun.used(args):
        return args.n, None, []
    try:
        gpus = len(affinity.gpus("/")[1])
        t = torchrun.resolve(args, gpus, torchrun.cpu_count())
    except torchrun.TorchrunError as e:
        raise LaunchError(str(e)) from None
    if args.n is not None and args.n != t.n:
        raise LaunchError(
            f"-n {args.n} but torchrun's options make {t.n} ranks "
            f"({t.per_node} per node x {t.nnodes} nodes): give one or make them agree"
        )
    if t.nnodes > 1 and not (args.hostfile or args.hosts or environ.get("SLURM_JOB_ID")):
        raise LaunchError(
            f"--nnodes {t.nnodes}: hetcomm run starts every node's ranks from one node; give "
            "the nodes with --hostfile or -H (node1:K,node2:K), or run inside a Slurm allocation"
        )
    return t.n, (t.master_addr, t.master_port, t.per_node), list(t.notes)


def _request(
    args: argparse.Namespace, environ: Mapping[str, str]
) -> tuple[LaunchRequest, list[str]]:
    command = _command(args)
    n, torch_vars, notes = _torchrun(args, environ)
    if n is None:
        if not environ.get("SLURM_NTASKS", "").isdigit():
            raise LaunchError("-n N is required (the number of ranks)")
        n = int(environ["SLURM_NTASKS"])
    vendors = tuple(v.strip().lower() for v in args.simulate_vendors.split(",") if v.strip())
    return LaunchRequest(
        command=tuple(command),
        n=n,
        hostfile=args.hostfile,
        hosts=args.hosts,
        vendors=vendors,
        simulate_hosts=args.simulate_hosts,
        rails=args.rails.strip(),
        bind=args.bind,
        timeout=args.timeout,
        tag_output=args.tag_output,
        mpi4py_abort=args.mpi4py,
        torchrun=torch_vars,
    ), notes


def main(args: argparse.Namespace) -> int:
    """Run (or with --dry-run, print) the job that `args` describes; the job's exit status."""
    environ = dict(os.environ)
    if torchrun.started_by_torchrun(environ):
        print(
            "hetcomm run: started by torchrun (TORCHELASTIC_RUN_ID is set), which would start "
            "one MPI job per torchrun process. Replace `torchrun` with `hetcomm run`: it accepts "
            "torchrun's options (--nproc-per-node, --nnodes, ...) and starts every rank itself",
            file=sys.stderr,
        )
        return 2
    if (args.torchrun_node_rank or 0) > 0 and not environ.get("SLURM_JOB_ID"):
        try:
            nodes = torchrun.nodes(args.torchrun_nnodes)
        except torchrun.TorchrunError as e:
            print(f"hetcomm run: {e}", file=sys.stderr)
            return 2
        if args.torchrun_node_rank >= nodes:
            print(
                f"hetcomm run: --node-rank: expected 0..{nodes - 1}, got {args.torchrun_node_rank}",
                file=sys.stderr,
            )
            return 2
        print(
            f"hetcomm run: --node-rank {args.torchrun_node_rank}: the ranks of every node are "
            "started by the hetcomm run of node rank 0; nothing to start here",
            file=sys.stderr,
        )
        return 0
    try:
        request, torch_notes = _request(args, environ)
        launcher = args.launcher or flavours.find_launcher(environ)
        banner = flavours.version_banner(launcher)
        flavour = flavours.detect(banner, launcher)
        launch = build(request, flavour, launcher, environ=environ, is_root=os.geteuid() == 0)
        launch = dataclasses.replace(launch, notes=(*torch_notes, *launch.notes))
    except flavours.LauncherNotFound as e:
        print(f"hetcomm run: {e}", file=sys.stderr)
        return 127
    except (LaunchError, HostSpecError, flavours.UnknownLauncher) as e:
        print(f"hetcomm run: {e}", file=sys.stderr)
        return 2
    version = mpi.version(banner) if flavour.name != "slurm" else None
    header = f"{flavour.title}{' ' + version if version else ''} at {launcher}"
    if args.dry_run or args.verbose:
        describe(launch, environ, header, sys.stdout if args.dry_run else sys.stderr)
    if args.dry_run:
        return 0
    return execute(launch.argv, {**environ, **launch.env}, request.timeout)


def command_line(launch: Launch) -> str:
    """The launch as one shell line: the launcher's added variables, then the command."""
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in launch.env.items())
    return f"{env} {shlex.join(launch.argv)}".strip()


def describe(
    launch: Launch,
    environ: Mapping[str, str],
    header: str,
    out: TextIO,
    root: str | os.PathLike[str] = "/",
    addresses: Addresses | None = None,
) -> None:
    """Print the exact command and every rank's environment (as computed on this host)."""
    print(f"# launcher: {header}", file=out)
    for note in launch.notes:
        print(f"# {note}", file=out)
    print(command_line(launch), file=out)
    print(
        "# each rank's environment, set by the shim on the rank's own host (computed here "
        "with this host's devices):",
        file=out,
    )
    for rank, (host, local) in enumerate(launch.placement):
        env = rank_launcher_environ(launch, rank, environ)
        mine = rank_environment(launch.plan, env, root=root, addresses=addresses)
        values = " ".join(f"{k}={shlex.quote(v)}" for k, v in mine.variables.items())
        cpus = f" cpus={format_cpulist(mine.cpus)}" if mine.cpus else ""
        print(
            f"rank {rank} ({host}, local rank {local}): {values or '(nothing set)'}{cpus}", file=out
        )
        for note in mine.notes[1:]:
            print(f"#   {note}", file=out)
    out.flush()


def execute(argv: Sequence[str], env: Mapping[str, str], timeout: float | None) -> int:
    """Run the launcher in its own session; end all of it on timeout or on a signal to us."""
    start = time.monotonic()
    proc = subprocess.Popen(list(argv), env=dict(env), start_new_session=True)
    received: list[int] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        _signal_group(proc.pid, signal.SIGKILL if len(received) > 1 else signum)

    previous = {
        s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    }
    try:
        try:
            code = proc.wait(timeout=timeout)
            timed_out = timeout is not None and code != 0 and time.monotonic() - start >= timeout
        except subprocess.TimeoutExpired:
            timed_out = True
            code = _end(proc)
        if received or timed_out:
            _sweep(proc.pid)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if timed_out:
        print(
            f"hetcomm run: the job ran past --timeout {timeout:g} s and was ended", file=sys.stderr
        )
        return TIMEOUT_EXIT
    return 128 - code if code < 0 else code


def _end(proc: subprocess.Popen[bytes]) -> int:
    # the launcher passes SIGTERM on to every rank, on every host; then kill what is left
    _signal_group(proc.pid, signal.SIGTERM)
    try:
        code = proc.wait(timeout=GRACE_S)
    except subprocess.TimeoutExpired:
        _signal_group(proc.pid, signal.SIGKILL)
        code = proc.wait()
    _sweep(proc.pid)
    return code


def _signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def _sweep(session: int) -> None:
    """Kill processes left in the launcher's session (ranks the launcher put in own groups)."""
    left = _session_members(session)
    for pid in left:
        _kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = _session_members(session)
    for pid in left:
        _kill(pid, signal.SIGKILL)


def _kill(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signum)


def _session_members(session: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()  # state ppid pgrp session ...
        if len(fields) > 3 and fields[3] == str(session) and fields[0] != "Z":
            members.append(int(entry.name))
    return members


__all__ = ["PLAN_VARIABLE", "add_parser", "command_line", "describe", "execute", "main"]
