"""The code blocks of README.md and docs/*.md, with the mark that says how each one runs.

Every fenced block is preceded by an HTML comment (invisible on GitHub) that says what it is:

    <!-- example: python N -->          Python, run on N ranks under mpirun (N=1: one process)
    <!-- example: python N, torch -->   the same, skipped with a reason where torch is missing
    <!-- example: file NAME -->         written to NAME in the document's folder for later blocks
    <!-- example: shell -->             bash, run in that folder with the venv's bin first on PATH
    <!-- example: shell torch -->       the same, skipped with a reason where torch is missing
    <!-- example: setup -->             shell lines sourced before each shell block of the document
    <!-- example: output -->            what a program prints: nothing to run
    <!-- example: skip REASON -->       not runnable on a CPU-only machine of one host (the reason)

tests/docs/test_examples.py fails on a block without a mark, and runs the others.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# owned and kept by the benchmark work (their blocks are commands for GPU machines); the
# changelog has no blocks
NOT_CHECKED = ("BENCHMARKS.md", "bench.md", "CHANGELOG.md")
KINDS = ("python", "file", "shell", "setup", "output", "skip")
_MARK = re.compile(r"^<!--\s*example:\s*(?P<kind>\w+)\s*(?P<arg>.*?)\s*-->\s*$")
_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>```+|~~~+)(?P<lang>[\w+-]*)\s*$")


@dataclass
class Block:
    """One fenced block: where it is, its mark, its text."""

    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    kind: str | None  # None: no mark
    arg: str = ""
    ranks: int = 1
    needs: tuple[str, ...] = field(default=())

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def documents() -> list[Path]:
    """README.md and docs/*.md, less those in NOT_CHECKED."""
    docs = sorted(p for p in (ROOT / "docs").glob("*.md") if p.name not in NOT_CHECKED)
    return [ROOT / "README.md", *docs]


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of one document, each with the mark on the line before it (if any)."""
    lines = path.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, indent = m["fence"], len(m["indent"])
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        text = "\n".join(x[indent:] for x in lines[i + 1 : j]) + "\n"
        before = next((x for x in reversed(lines[:i]) if x.strip()), "")
        mark = _MARK.match(before.strip())
        block = Block(path, i + 1, m["lang"], text, mark["kind"] if mark else None)
        if mark:
            block.arg = mark["arg"]
            if block.kind in ("python", "shell"):
                words = [w.strip() for w in block.arg.replace(",", " ").split()]
                if block.kind == "python":
                    block.ranks = int(words.pop(0)) if words and words[0].isdigit() else 1
                block.needs = tuple(words)
        found.append(block)
        i = j + 1
    return found


def every_block() -> list[Block]:
    """Every block of every checked document, in order."""
    return [b for p in documents() for b in blocks(p)]
