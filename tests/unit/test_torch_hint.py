"""The hint added to torch's "RANK expected" error (hetcomm/torch_hint.py), without MPI."""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from hetcomm import torch_hint

RANK_ERROR = (
    "Error initializing torch.distributed using env:// rendezvous: environment variable RANK "
    "expected, but not set"
)
MPIRUN = {"OMPI_COMM_WORLD_SIZE": "2"}


@pytest.fixture
def not_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "hetcomm.torch", raising=False)


def test_under_mpirun_without_the_import(not_imported: None) -> None:
    e = torch_hint.explain(ValueError(RANK_ERROR), MPIRUN)
    assert str(e).startswith(RANK_ERROR) and "`import hetcomm.torch` first" in str(e)
    assert "hetcomm run --nproc-per-node" in str(e)


def test_imported_without_a_launcher(not_imported: None) -> None:
    e = torch_hint.explain(ValueError(RANK_ERROR), {}, imported=True)
    assert "no MPI launcher started this process" in str(e) and "mpi://" in str(e)


@pytest.mark.parametrize(
    ("environ", "imported", "message"),
    [
        ({}, False, RANK_ERROR),  # neither: torch's own words
        (MPIRUN, True, RANK_ERROR),  # imported under mpirun: hetcomm.torch's rendezvous applies
        (MPIRUN, False, "MASTER_ADDR expected"),  # another variable: not ours to explain
    ],
)
def test_left_alone(
    not_imported: None, environ: dict[str, str], imported: bool, message: str
) -> None:
    error = ValueError(message)
    assert torch_hint.explain(error, environ, imported=imported) is error


def test_the_wrapped_handler(not_imported: None, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(url: str, **kwargs: Any) -> Iterator[Any]:
        raise ValueError(RANK_ERROR)
        yield  # a generator, as torch's handlers are

    def working(url: str, **kwargs: Any) -> Iterator[Any]:
        yield ("store", 0, 1)

    for k, v in MPIRUN.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=r"import hetcomm\.torch"):
        next(torch_hint.wrap(failing)("env://"))
    assert next(torch_hint.wrap(working)("env://")) == ("store", 0, 1)


def test_a_handler_wrapped_twice_explains_once(
    not_imported: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """autoload wraps torch's handler at torch's import, hetcomm.torch again at its own: the
    hint appears once."""

    def failing(url: str, **kwargs: Any) -> Iterator[Any]:
        raise ValueError(RANK_ERROR)
        yield

    monkeypatch.setitem(sys.modules, "hetcomm.torch", sys.modules[__name__])  # imported
    twice = torch_hint.wrap(torch_hint.wrap(failing), imported=True)
    with pytest.raises(ValueError) as caught:
        next(twice("env://"))
    assert str(caught.value).count("hetcomm:") == 1, str(caught.value)


def test_torch_finds_it_at_import() -> None:
    try:
        importlib.metadata.distribution("hetcomm")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("hetcomm is not installed here: no entry points to find (a bare checkout)")
    points = importlib.metadata.entry_points(group="torch.backends")
    assert "hetcomm.torch_hint:autoload" in [p.value for p in points]
    torch = pytest.importorskip("torch")
    import importlib as il

    handlers = il.import_module("torch.distributed.rendezvous")._rendezvous_handlers
    assert torch.__version__ and (
        hasattr(handlers["env"], "hetcomm_hint") or hasattr(handlers["env"], "hetcomm_wraps")
    )
