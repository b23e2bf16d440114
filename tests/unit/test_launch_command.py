"""Unit tests for hetcomm.launch.command and .hosts: the dry-run command of every MPI flavour."""

from __future__ import annotations

import re
import subprocess
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
from hetcomm.launch.command import (
    SHIM_MODULE,
    LaunchError,
    LaunchRequest,
    build,
    host_args,
    mpi4py_wrapped,
    rank_launcher_environ,
)
from hetcomm.launch.flavours import FLAVOURS
from hetcomm.launch.hosts import (
    Host,
    HostList,
    HostSpecError,
    parse_host_list,
    parse_hostfile,
    placement,
)
from hetcomm.launch.rankenv import PLAN_VARIABLE, LaunchPlan

from hetcomm.config import ENV_NAMES

PY = "/venv/bin/python"
SHIM = [PY, "-m", SHIM_MODULE, "--", PY, "-m", "mpi4py", "train.py"]  # `python` resolved to PY
ENVIRON = {"HETCOMM_LOG": "info", "PATH": "/usr/bin", "HOME": "/root"}
FULL = LaunchRequest(
    command=("python", "train.py"),
    n=4,
    hosts="a:2,b:2",
    vendors=("nvidia", "amd"),
    simulate_hosts=2,
    bind="core",
    timeout=90,
    tag_output=True,
)


def make(
    flavour: str, request: LaunchRequest, tmp_path: Path, **kw: Any
) -> tuple[list[str], dict[str, str]]:
    kwargs: dict[str, Any] = {
        "environ": ENVIRON,
        "is_root": True,
        "python": PY,
        "root": tmp_path,
        **kw,
    }
    launch = build(request, FLAVOURS[flavour], "/mpi/bin/launcher", **kwargs)
    env = dict(launch.env)
    assert LaunchPlan.from_json(env.pop(PLAN_VARIABLE)) == launch.plan
    return list(launch.argv[1:]), env


# ---- every flavour, every option -----------------------------------------------------------------

GOLDEN: dict[str, tuple[list[str], dict[str, str]]] = {
    "openmpi5": (
        [
            "-n",
            "4",
            "--host",
            "a:2,b:2",
            "--bind-to",
            "core",
            "--output",
            "tag",
            "--timeout",
            "90",
            "-x",
            PLAN_VARIABLE,
            "-x",
            "HETCOMM_LOG",
            "-x",
            "PATH",
        ],
        {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"},
    ),
    "openmpi4": (
        [
            "-n",
            "4",
            "--host",
            "a:2,b:2",
            "--bind-to",
            "core",
            "--tag-output",
            "--timeout",
            "90",
            "-x",
            PLAN_VARIABLE,
            "-x",
            "HETCOMM_LOG",
            "-x",
            "PATH",
        ],
        {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"},
    ),
    "mpich": (
        [
            "-n",
            "4",
            "-hosts",
            "a:2,b:2",
            "-bind-to",
            "core",
            "-prepend-rank",
            "-genvlist",
            f"{PLAN_VARIABLE},HETCOMM_LOG,PATH",
        ],
        {"MPIEXEC_TIMEOUT": "90"},
    ),
    "mvapich": (
        [
            "-n",
            "4",
            "-hosts",
            "a:2,b:2",
            "-bind-to",
            "core",
            "-prepend-rank",
            "-genvlist",
            f"{PLAN_VARIABLE},HETCOMM_LOG,PATH",
        ],
        {"MPIEXEC_TIMEOUT": "90"},
    ),
    "intel": (
        [
            "-n",
            "4",
            "-hosts",
            "a,b",
            "-ppn",
            "2",
            "-prepend-rank",
            "-genvlist",
            f"{PLAN_VARIABLE},HETCOMM_LOG,PATH",
        ],
        {"I_MPI_PIN": "1", "I_MPI_PIN_DOMAIN": "core", "I_MPI_JOB_TIMEOUT": "90"},
    ),
    "slurm": (
        [
            "--ntasks=4",
            "--nodelist=a,b",
            "--ntasks-per-node=2",
            "--cpu-bind=cores",
            "--label",
            "--kill-on-bad-exit=1",
            "--time=2",
            "--export=ALL",
        ],
        {},
    ),
}


@pytest.mark.parametrize("flavour", sorted(GOLDEN))
def test_golden_commands(flavour: str, tmp_path: Path) -> None:
    argv, env = make(flavour, FULL, tmp_path)
    want_argv, want_env = GOLDEN[flavour]
    assert argv == [*want_argv, *SHIM]
    assert env == want_env


def test_every_flavour_has_a_golden_command() -> None:
    assert set(GOLDEN) == set(FLAVOURS)


@pytest.mark.parametrize(
    ("flavour", "extra"),
    [
        ("openmpi5", ["--oversubscribe"]),
        ("openmpi4", ["--oversubscribe"]),
        ("mpich", []),
        ("intel", []),
        ("slurm", []),
    ],
)
def test_one_machine(flavour: str, extra: list[str], tmp_path: Path) -> None:
    request = LaunchRequest(command=("./a.out",), n=2)
    argv, env = make(flavour, request, tmp_path, environ={}, is_root=False)
    count = ["--ntasks=2"] if flavour == "slurm" else ["-n", "2"]
    assert argv[: len(count) + len(extra)] == count + extra
    assert argv[-2:] == ["--", "./a.out"]
    assert env == {}  # not root, no timeout, no binding asked on a CPU-only host


def test_plan_in_the_launch(tmp_path: Path) -> None:
    launch = build(
        FULL,
        FLAVOURS["mpich"],
        "mpiexec.hydra",
        environ={},
        is_root=False,
        python=PY,
        root=tmp_path,
    )
    assert launch.plan == LaunchPlan("mpich", 4, ("nvidia", "amd"), 2, "auto", "core", True)
    assert launch.placement == (("a", 0), ("a", 1), ("b", 0), ("b", 1))
    env = rank_launcher_environ(launch, 3, {PLAN_VARIABLE: "x", "HOME": "/root"})
    assert env == {"HOME": "/root", "PMI_RANK": "3", "MPI_LOCALRANKID": "1"}


def test_bind_none_and_auto(tmp_path: Path) -> None:
    request = LaunchRequest(command=("x",), n=1, bind="none")
    assert make("openmpi5", request, tmp_path)[0][2:5] == ["--oversubscribe", "--bind-to", "none"]
    assert make("intel", request, tmp_path)[1] == {"I_MPI_PIN": "0"}
    auto = LaunchRequest(command=("x",), n=1)  # CPU-only host: the launcher's own default
    assert "--bind-to" not in make("openmpi5", auto, tmp_path)[0]


def test_fractional_timeout_rounds_up(tmp_path: Path) -> None:
    request = LaunchRequest(command=("x",), n=1, timeout=61.5)
    assert "--timeout" in (argv := make("openmpi5", request, tmp_path)[0])
    assert argv[argv.index("--timeout") + 1] == "62"
    assert "--time=2" in make("slurm", request, tmp_path)[0]


@pytest.mark.parametrize(
    ("request_", "match"),
    [
        (LaunchRequest(command=(), n=2), "no command"),
        (LaunchRequest(command=("x",), n=0), "positive number of ranks"),
        (LaunchRequest(command=("x",), n=2, vendors=("intel",)), "simulate-vendors"),
        (LaunchRequest(command=("x",), n=2, simulate_hosts=3), "simulate-hosts"),
        (LaunchRequest(command=("x",), n=2, timeout=0), "timeout"),
        (LaunchRequest(command=("x",), n=2, hosts="a", hostfile="f"), "not both"),
        (LaunchRequest(command=("x",), n=2, rails="eth0,"), "rails"),
        (LaunchRequest(command=("x",), n=2, bind="socket"), "bind"),
    ],
)
def test_bad_requests(request_: LaunchRequest, match: str, tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match=match):
        make("openmpi5", request_, tmp_path)


# ---- python -m mpi4py ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("command", "wrapped"),
    [
        (["python", "train.py", "--lr", "1"], ["python", "-m", "mpi4py", "train.py", "--lr", "1"]),
        (["python3", "-m", "pkg.train"], ["python3", "-m", "mpi4py", "-m", "pkg.train"]),
        (
            ["/usr/bin/python3.11", "-u", "-W", "ignore", "t.py"],
            ["/usr/bin/python3.11", "-u", "-W", "ignore", "-m", "mpi4py", "t.py"],
        ),
        (
            ["python", "-Wignore::DeprecationWarning", "t.py"],
            ["python", "-Wignore::DeprecationWarning", "-m", "mpi4py", "t.py"],
        ),
        (["python", "-c", "print(1)"], ["python", "-m", "mpi4py", "-c", "print(1)"]),
        (["python", "--", "t.py"], ["python", "--", "t.py"]),
        (["python", "-m", "mpi4py", "t.py"], ["python", "-m", "mpi4py", "t.py"]),
        (["python"], ["python"]),
        (["python", "-"], ["python", "-"]),
        (["python", "-uc", "print(1)"], ["python", "-uc", "print(1)"]),
        (["./a.out", "x.py"], ["./a.out", "x.py"]),
        (["pythonic", "x.py"], ["pythonic", "x.py"]),
        ([PY, "x.py"], [PY, "-m", "mpi4py", "x.py"]),
    ],
)
def test_mpi4py_wrapped(command: list[str], wrapped: list[str]) -> None:
    assert mpi4py_wrapped(command, PY)[0] == wrapped


def test_no_mpi4py(tmp_path: Path) -> None:
    request = LaunchRequest(command=("python", "t.py"), n=1, mpi4py_abort=False)
    assert make("mpich", request, tmp_path)[0][-3:] == ["--", PY, "t.py"]


# ---- hosts --------------------------------------------------------------------------------------

OMPI_FILE = """\
# two nodes
node1 slots=4
node2 slots=2 max_slots=8   # trailing comment
"""


def test_hostfile_syntaxes() -> None:
    assert parse_hostfile(OMPI_FILE) == HostList((Host("node1", 4), Host("node2", 2)), "openmpi")
    hydra = parse_hostfile("node1:4\nnode2:2\n\n")
    assert hydra == HostList((Host("node1", 4), Host("node2", 2)), "hydra")
    assert parse_hostfile("a\nb\na\n") == HostList((Host("a"), Host("b")), "names")
    assert parse_hostfile("a:2\na:3\n").hosts == (Host("a", 5),)
    assert parse_hostfile("a slots=2\nb\n").total_slots() is None


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", "names no host"),
        ("a:2\nb slots=2\n", "mixes"),
        ("a slots=x\n", "positive"),
        ("a:0\n", "positive"),
        ("a:2 extra\n", "line 1"),
    ],
)
def test_bad_hostfiles(text: str, match: str) -> None:
    with pytest.raises(HostSpecError, match=match):
        parse_hostfile(text)


def test_host_lists() -> None:
    assert parse_host_list("a:2,b:2") == HostList((Host("a", 2), Host("b", 2)), "hydra")
    assert parse_host_list("a, b") == HostList((Host("a"), Host("b")), "names")
    with pytest.raises(HostSpecError, match="host:slots"):
        parse_host_list("a:2,,b")


def test_placement_fills_hosts_by_slot() -> None:
    hosts = parse_host_list("a:2,b:1")
    assert placement(3, hosts) == [("a", 0), ("a", 1), ("b", 0)]
    assert placement(5, hosts) == [("a", 0), ("a", 1), ("b", 0), ("a", 2), ("a", 3)]
    assert placement(3, parse_host_list("a,b")) == [("a", 0), ("b", 0), ("a", 1)]
    assert placement(2, None) == [("localhost", 0), ("localhost", 1)]


def test_hostfile_passed_natively_or_as_a_list(tmp_path: Path) -> None:
    ompi_file = tmp_path / "hosts.ompi"
    ompi_file.write_text(OMPI_FILE)
    hydra_file = tmp_path / "hosts.hydra"
    hydra_file.write_text("node1:2\nnode2:2\n")

    def argv_for(flavour: str, path: Path) -> list[str]:
        request = LaunchRequest(command=("x",), n=4, hostfile=str(path))
        return make(flavour, request, tmp_path)[0][2:4]

    assert argv_for("openmpi5", ompi_file) == ["--hostfile", str(ompi_file)]
    assert argv_for("openmpi5", hydra_file) == ["--host", "node1:2,node2:2"]
    assert argv_for("mpich", hydra_file) == ["-f", str(hydra_file)]
    assert argv_for("mpich", ompi_file) == ["-hosts", "node1:4,node2:2"]
    assert argv_for("intel", hydra_file) == ["-machinefile", str(hydra_file)]
    assert make("slurm", LaunchRequest(command=("x",), n=4, hostfile=str(hydra_file)), tmp_path)[0][
        1:3
    ] == ["--nodelist=node1,node2", "--ntasks-per-node=2"]
    with pytest.raises(LaunchError, match="different slot counts"):
        argv_for("intel", ompi_file)  # 4 and 2 slots: -hosts with one -ppn cannot say it
    with pytest.raises(HostSpecError, match="cannot read"):
        argv_for("mpich", tmp_path / "missing")


def test_host_args_without_slots() -> None:
    names = parse_host_list("a,b")
    assert host_args(FLAVOURS["intel"], names) == ["-hosts", "a,b"]
    assert host_args(FLAVOURS["openmpi5"], names) == ["--host", "a,b"]
    assert host_args(FLAVOURS["slurm"], names) == ["--nodelist=a,b"]


# ---- the shipped examples -----------------------------------------------------------------------


def test_examples_are_shipped_and_valid(tmp_path: Path) -> None:
    examples = resources.files("hetcomm.launch") / "examples"
    hosts = parse_hostfile((examples / "hostfile").read_text(), "examples/hostfile")
    assert hosts == HostList((Host("gpu-a1", 4), Host("gpu-b1", 4)), "openmpi")
    assert placement(8, hosts)[3:5] == [("gpu-a1", 3), ("gpu-b1", 0)]
    sbatch = (examples / "slurm.sbatch").read_text()
    assert sbatch.startswith("#!/bin/bash\n") and "#SBATCH --nodes=" in sbatch
    assert 'hetcomm run -n "$SLURM_NTASKS"' in sbatch
    names = set(re.findall(r"\bHETCOMM_[A-Z_]*[A-Z]\b", sbatch))
    assert names <= set(ENV_NAMES), "an unknown HETCOMM_* name would fail every rank"
    script = tmp_path / "job.sbatch"
    script.write_text(sbatch)
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0
