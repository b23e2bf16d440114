"""docs/api.md is what scripts/apiref makes from the docstrings of the installed code."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "apiref.py"


def _apiref():
    spec = importlib.util.spec_from_file_location("apiref", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_api_reference_is_current() -> None:
    pytest.importorskip("torch", reason="hetcomm.torch (documented there) needs torch")
    apiref = _apiref()
    made = apiref.render()
    assert apiref.OUT.read_text() == made, "docs/api.md is not current: run scripts/apiref"


def test_every_public_name_is_there() -> None:
    pytest.importorskip("torch", reason="hetcomm.torch (documented there) needs torch")
    import hetcomm
    import hetcomm.testing
    import hetcomm.torch

    text = _apiref().OUT.read_text()
    for module in (hetcomm, hetcomm.torch, hetcomm.testing):
        for name in module.__all__:
            assert f"### `{module.__name__}.{name}`" in text, f"{module.__name__}.{name} missing"
    assert "`Communicator.all_reduce(" in text and "`ParallelGroups.items(" in text
