"""`hetcomm run` with torchrun's options and its interpreter resolution (dry runs, no MPI)."""

from __future__ import annotations

import os
import shlex
import stat
import sys
from pathlib import Path

import pytest
from hetcomm.launch.command import resolve_python
from hetcomm.launch.rankenv import PLAN_VARIABLE, LaunchPlan, PlanError, rank_environment

from hetcomm.cli import main

BANNER = "mpirun (Open MPI) 5.0.11"


@pytest.fixture
def launcher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fake Open MPI mpirun that answers --version and nothing else; a clean environment."""
    for key in list(os.environ):
        if key.startswith(("HETCOMM_", "SLURM_", "OMPI_", "PMI_", "PMIX_", "TORCHELASTIC_")):
            monkeypatch.delenv(key)
    path = tmp_path / "mpirun"
    path.write_text(f"#!/bin/sh\n[ \"$1\" = --version ] && echo '{BANNER}' && exit 0\nexit 99\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def dry_run(launcher: Path, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(["run", "--launcher", str(launcher), "--dry-run", *args])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def shim_command(out: str, launcher: Path) -> list[str]:
    line = next(x for x in out.splitlines() if str(launcher) in x and "shim" in x)
    return shlex.split(line)


def test_a_torchrun_command_line_with_the_name_changed(
    launcher: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = dry_run(
        launcher,
        capsys,
        "--nproc-per-node",
        "3",
        "--nnodes",
        "1",
        "--node-rank",
        "0",
        "--master-addr",
        "10.0.0.7",
        "--master_port",
        "29611",
        "--rdzv-backend",
        "c10d",
        "train.py",
        "--lr",
        "3",
    )
    assert code == 0, out
    words = shim_command(out, launcher)
    assert words[words.index("-n") + 1] == "3"
    assert words[-6:] == [sys.executable, "-m", "mpi4py", "train.py", "--lr", "3"]
    plan = LaunchPlan.from_json(
        next(w for w in words if w.startswith(PLAN_VARIABLE)).partition("=")[2]
    )
    assert (plan.torchrun, plan.per_node, plan.size) == ("10.0.0.7:29611", 3, 3)
    assert "--rdzv-backend c10d ignored" in out
    for rank in range(3):
        expect = (
            f"RANK={rank} LOCAL_RANK={rank} WORLD_SIZE=3 LOCAL_WORLD_SIZE=3 GROUP_RANK=0 "
            f"GROUP_WORLD_SIZE=1 ROLE_RANK={rank} ROLE_WORLD_SIZE=3 MASTER_ADDR=10.0.0.7 "
            "MASTER_PORT=29611"
        )
        assert expect in out


def test_module_and_no_python_forms(launcher: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = dry_run(launcher, capsys, "--nproc_per_node", "2", "-m", "pkg.train", "--x")
    assert code == 0, out
    assert shim_command(out, launcher)[-6:] == [
        sys.executable,
        "-m",
        "mpi4py",
        "-m",
        "pkg.train",
        "--x",
    ]
    code, out = dry_run(launcher, capsys, "--nproc-per-node", "2", "--no-python", "./a.out")
    assert code == 0, out
    assert shim_command(out, launcher)[-2:] == ["--", "./a.out"]
    assert "MASTER_ADDR=127.0.0.1 MASTER_PORT=29500" in out  # torchrun's defaults


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nnodes", "1:4"], "elastic range"),
        (["--max-restarts", "3"], "not restarted"),
        (["--nproc-per-node", "0"], "expected a positive number, got 0"),
        (["--nproc-per-node", "many"], "expected a number, got 'many'"),
        (["--nnodes", "2"], "give the nodes with --hostfile"),
        (["--nnodes", "2", "--standalone", "-H", "a:1,b:1"], "--standalone is one node"),
        (["--nnodes", "2", "--node-rank", "2", "-H", "a:1,b:1"], "--node-rank: expected 0..1"),
        (["-n", "4", "--nproc-per-node", "2"], "-n 4 but torchrun's options make 2 ranks"),
    ],
)
def test_options_that_cannot_be_honoured(
    launcher: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    code, out = dry_run(launcher, capsys, *args, "train.py")
    assert code == 2
    assert message in out


def test_several_nodes_from_a_host_list(launcher: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = dry_run(
        launcher, capsys, "--nnodes", "2", "--nproc-per-node", "2", "-H", "n1:2,n2:2", "t.py"
    )
    assert code == 0, out
    assert "--host n1:2,n2:2" in out or "n1:2,n2:2" in out
    assert "RANK=3 LOCAL_RANK=1 WORLD_SIZE=4 LOCAL_WORLD_SIZE=2 GROUP_RANK=1" in out
    assert "MASTER_ADDR=n1" in out  # the first host


def test_other_node_ranks_start_nothing(launcher: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["run", "--launcher", str(launcher), "--nnodes", "2", "--node-rank", "1", "t.py"])
    assert code == 0
    assert "nothing to start here" in capsys.readouterr().err


def test_refused_under_torchrun(
    launcher: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    code, out = dry_run(launcher, capsys, "-n", "2", "--", "python", "t.py")
    assert code == 2
    assert "started by torchrun" in out and "Replace `torchrun` with `hetcomm run`" in out


def test_python_is_the_running_interpreter() -> None:
    major, minor = sys.version_info[:2]
    for name in ("python", f"python{major}", f"python{major}.{minor}"):
        cmd, note = resolve_python([name, "t.py"], "/venv/bin/python")
        assert cmd == ["/venv/bin/python", "t.py"] and name in note
    for kept in (["/usr/bin/python3", "t.py"], ["python2.7", "t.py"], ["./a.out"]):
        assert resolve_python(kept, "/venv/bin/python") == (kept, "")


def test_plan_checks_its_torchrun_fields() -> None:
    with pytest.raises(PlanError, match="torchrun: expected 'addr:port'"):
        LaunchPlan(flavour="openmpi5", size=2, torchrun="host", per_node=2)
    with pytest.raises(PlanError, match=r"1\.\.2 ranks per node"):
        LaunchPlan(flavour="openmpi5", size=2, torchrun="h:1", per_node=3)
    plan = LaunchPlan(flavour="openmpi5", size=2, torchrun="h:7", per_node=2)
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
    mine = rank_environment(plan, env, root="/nonexistent")
    assert mine.variables["RANK"] == "1" and mine.variables["MASTER_PORT"] == "7"
    assert LaunchPlan(flavour="openmpi5", size=2).torchrun == ""  # off unless asked
