"""Shared by every test folder: where torch is not installed, the test files that need it are
not collected (each named once in the summary, with the reason) instead of failing to import."""

from __future__ import annotations

import ast
import importlib.util
from functools import cache
from pathlib import Path

import pytest

HAVE_TORCH = importlib.util.find_spec("torch") is not None
# test files that need torch only when they run, not at import
NEED_TORCH_TO_RUN = {
    "test_bench_cli.py": "its sweep's baselines include gloo",
}
_left_out: list[str] = []


@cache
def _needs_torch(path: Path) -> bool:
    """Whether the module imports torch at its top level, itself or through a sibling helper
    module (tests/mpi/_data.py, say)."""
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError):
        return False
    for node in tree.body:
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            if name.split(".")[0] == "torch" or name == "hetcomm.torch":
                return True
            sibling = path.with_name(name.split(".")[0] + ".py")
            if name.startswith("_") and sibling.is_file() and _needs_torch(sibling):
                return True
    return False


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if HAVE_TORCH or collection_path.suffix != ".py" or not collection_path.name.startswith("test"):
        return None
    if _needs_torch(collection_path) or collection_path.name in NEED_TORCH_TO_RUN:
        _left_out.append(collection_path.name)
        return True
    return None


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _left_out:
        terminalreporter.write_line(
            f"torch is not installed: {len(_left_out)} test file(s) that need it were not "
            f"collected ({', '.join(sorted(set(_left_out)))}); README, 'Which torch'"
        )


@pytest.fixture
def input_copies(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the inputs the communicator's general path copies during the test (an
    input its output overlaps, outside the in-place layouts every transport serves)."""
    from hetcomm import general

    copies: list[int] = []
    real = general.contiguous_in

    def counting(b, copy=False):
        if copy:
            copies.append(b.nbytes)
        return real(b, copy)

    monkeypatch.setattr(general, "contiguous_in", counting)
    return copies
