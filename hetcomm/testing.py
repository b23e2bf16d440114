"""pytest plugin: per-test communicators, simulated vendors and hosts, rank-wide assertions.

Loaded automatically where hetcomm is installed (entry point `pytest11`). Under
`mpirun -n N python -m mpi4py -m pytest --with-mpi` every rank runs every test; the fixtures
below give each test its own communicator so that a failed test cannot leave messages behind
for the next one.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from .comm import Communicator


def simulated_config(rank: int, vendors: Sequence[str] | None = None,
                     hosts: Sequence[str] | None = None, **options: Any) -> Any:  # fmt: skip
    """The Config a rank gets when `vendors` / `hosts` are cycled over ranks (rank i gets
    vendors[i % len(vendors)]), on top of the environment and `options`."""
    from .config import Config

    if vendors:
        options["vendor"] = vendors[rank % len(vendors)]
    if hosts:
        options["host"] = hosts[rank % len(hosts)]
    return Config.load(**options)


@pytest.fixture(scope="session")
def hetcomm_world() -> Iterator[Communicator]:
    """One Communicator over COMM_WORLD for the whole session (tests should use `comm`)."""
    import hetcomm

    world = hetcomm.init(name="tests")
    yield world
    world.close()


@pytest.fixture
def comm(hetcomm_world: Communicator, request: pytest.FixtureRequest) -> Iterator[Communicator]:
    """A fresh Dup of the world for this test, closed afterwards."""
    c = hetcomm_world.dup(name=request.node.name[:40])
    yield c
    c.close()


@pytest.fixture
def make_comm() -> Iterator[Callable[..., Communicator]]:
    """Factory: make_comm(vendors=("nvidia","amd"), hosts=("a","b"), timeout=5, ...) gives a
    Communicator over COMM_WORLD whose ranks pretend to be those vendors and hosts."""
    from mpi4py import MPI

    import hetcomm

    made: list[Communicator] = []

    def factory(vendors: Sequence[str] | None = None, hosts: Sequence[str] | None = None,
                **options: Any) -> Communicator:  # fmt: skip
        name = options.pop("name", None)
        config = simulated_config(MPI.COMM_WORLD.Get_rank(), vendors, hosts, **options)
        c = hetcomm.init(config=config, name=name)
        made.append(c)
        return c

    yield factory
    for c in made:
        c.close()


@pytest.fixture
def shared_seed(hetcomm_world: Communicator) -> int:
    """A fresh random seed, the same on every rank (drawn on rank 0, broadcast)."""
    seed = int.from_bytes(os.urandom(8), "little") if hetcomm_world.rank == 0 else None
    return int(hetcomm_world.mpi.bcast(seed, root=0))


def assert_all_ranks(comm: Communicator, ok: bool, message: str = "") -> None:
    """Fail on every rank when `ok` is False on any rank, naming the failing ranks.

    An assertion that fails on one rank only would leave the others blocked in the next
    collective; gathering the verdict first keeps the ranks in step.
    """
    verdicts = comm.mpi.allgather((bool(ok), message if not ok else ""))
    bad = [(r, m) for r, (good, m) in enumerate(verdicts) if not good]
    if bad:
        detail = "; ".join(f"rank {r}: {m}" if m else f"rank {r}" for r, m in bad)
        raise AssertionError(f"failed on {len(bad)} of {comm.size} ranks: {detail}")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA or ROCm device (skipped without one)")
