"""Every code block of README.md and docs/*.md is marked, and the runnable ones run as written.

Python blocks run grouped by rank count (one mpirun per count, every block one after the other,
tests/docs/_run_blocks.py); shell blocks run in order in one temporary folder per document
(where `file` blocks were written), each under a timeout. Ordinary pytest tests (not under
mpirun), like tests/launch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from _examples import KINDS, ROOT, Block, documents, every_block

from hetcomm.testing import clean_environ, mpirun_command

RUNNER = Path(__file__).with_name("_run_blocks.py")
BLOCK_LIMIT_S = 240  # one mpirun of all the Python blocks of one rank count
SHELL_LIMIT_S = 180  # one shell block
VENV_BIN = str(Path(sys.executable).parent)
ALL = every_block()


def _have(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def _environ(folder: Path) -> dict[str, str]:
    # a user's shell with the venv activated; every wait bounded well below the test's limit
    env = clean_environ(HETCOMM_TIMEOUT="60")
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(Path(VENV_BIN).parent)
    env["PYTHONPATH"] = str(folder)
    return env


def test_every_block_is_marked() -> None:
    unmarked = [b.where for b in ALL if b.kind is None]
    assert not unmarked, (
        "code blocks without an `<!-- example: KIND ... -->` line before them (tests/docs/"
        f"_examples.py says which kinds there are): {unmarked}"
    )
    wrong = [f"{b.where}: {b.kind}" for b in ALL if b.kind is not None and b.kind not in KINDS]
    assert not wrong, f"unknown example kinds (expected one of {KINDS}): {wrong}"
    no_reason = [b.where for b in ALL if b.kind == "skip" and not b.arg]
    assert not no_reason, f"`skip` blocks must say why they cannot run here: {no_reason}"
    assert len(documents()) > 5 and len(ALL) > 10  # the documents were found


def _python_groups() -> dict[int, list[Block]]:
    groups: dict[int, list[Block]] = defaultdict(list)
    for b in ALL:
        if b.kind == "python":
            groups[b.ranks].append(b)
    return dict(groups)


@pytest.mark.parametrize("ranks", sorted(_python_groups()))
def test_python_blocks(ranks: int, tmp_path: Path) -> None:
    found = mpirun_command()
    if found is None:
        pytest.skip("no mpirun found")
    prefix, mpi_env = found
    todo, skipped = [], []
    for b in _python_groups()[ranks]:
        missing = [m for m in b.needs if not _have(m)]
        if missing:
            skipped.append(f"{b.where} (needs {', '.join(missing)})")
        else:
            todo.append((b.where, b.text))
    if not todo:
        pytest.skip(f"every {ranks}-rank block needs what is missing: {skipped}")
    listing = tmp_path / "blocks.json"
    listing.write_text(json.dumps(todo))
    argv = [*prefix, "-n", str(ranks), sys.executable, "-m", "mpi4py", str(RUNNER), str(listing)]
    done = subprocess.run(
        ["timeout", "--kill-after=10", str(BLOCK_LIMIT_S), *argv],
        capture_output=True,
        text=True,
        env={**_environ(tmp_path), **mpi_env},
        cwd=tmp_path,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    verdicts = [x for x in done.stdout.splitlines() if x.startswith("BLOCK ")]
    failed = [x for x in verdicts if " FAILED" in x]
    started = [x.split(" ", 1)[1] for x in done.stdout.splitlines() if x.startswith("START ")]
    tail = f"\n--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}"
    assert not failed, "\n".join(failed) + tail
    assert done.returncode == 0, f"exit {done.returncode}, last block started: {started[-1:]}{tail}"
    assert len(verdicts) == ranks * len(todo), tail
    if skipped:
        print(f"skipped (missing modules): {skipped}")


def _shell_documents() -> list[Path]:
    return [p for p in documents() if any(b.kind == "shell" and b.path == p for b in ALL)]


@pytest.mark.parametrize("doc", _shell_documents(), ids=lambda p: p.name)
def test_shell_blocks(doc: Path, tmp_path: Path) -> None:
    if mpirun_command() is None:
        pytest.skip("no mpirun found")
    mine = [b for b in ALL if b.path == doc]
    # the checkout's scripts/ and launch/, as the docs' commands name them from its root
    for name in ("scripts", "launch"):
        (tmp_path / name).symlink_to(ROOT / name)
    # the README's launch settings (root, oversubscription) hold for every document's commands
    setup = "".join(b.text for b in ALL if b.kind == "setup")
    for b in mine:
        if b.kind == "file":
            (tmp_path / b.arg).write_text(b.text)
        elif b.kind == "shell":
            missing = [m for m in b.needs if not _have(m)]
            if missing:
                print(f"{b.where}: skipped, needs {', '.join(missing)}")
                continue
            script = f"set -euo pipefail\ncd {tmp_path}\n{setup}\n{b.text}"
            done = subprocess.run(
                ["timeout", "--kill-after=10", str(SHELL_LIMIT_S), "bash", "-c", script],
                capture_output=True,
                text=True,
                env=_environ(tmp_path),
                cwd=tmp_path,
                check=False,
                stdin=subprocess.DEVNULL,
            )
            assert done.returncode == 0, (
                f"{b.where}: exit {done.returncode}\n{b.text}--- stdout\n{done.stdout[-3000:]}"
                f"\n--- stderr\n{done.stderr[-3000:]}"
            )
