"""Fixtures of the MPI tests, run as `mpirun -n N python -m mpi4py -m pytest --with-mpi tests/mpi`.

The `hetcomm_comm`, `hetcomm_make_comm`, `hetcomm_shared_seed`, `hetcomm_transport` and
`hetcomm_world` fixtures come from hetcomm's own pytest plugin (hetcomm.testing, loaded by
`-p hetcomm.testing` in pyproject.toml). scripts/test runs this folder once per transport with
`--hetcomm-transport=NAME`, which the plugin turns into a parameter of every test here
(`test_x[staged]`). Tests here collect their findings in `errors` and end with `errors.verify()`,
which fails on every rank when any rank found something, so that a failure on one rank never
leaves the others waiting in the next collective. A rank whose test raised before its
`errors.verify()` makes that verify's collective itself, with what it raised, so that the
ranks waiting there fail with it rather than wait for the hang timeout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from hetcomm.testing import assert_all_ranks

if TYPE_CHECKING:
    from hetcomm import Communicator

_HERE = Path(__file__).parent
# A test that hangs (ranks out of step) ends the rank after this long, with a stack dump, instead
# of blocking the whole run: mpirun then ends the other ranks.
_HANG_TIMEOUT_S = 120


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _HERE in Path(item.path).parents and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(_HANG_TIMEOUT_S, method="thread"))


@pytest.fixture(scope="session", autouse=True)
def _transport_for_environment_readers(
    hetcomm_transport: str, pytestconfig: pytest.Config
) -> Iterator[None]:
    """Every test here takes the run's transport (--hetcomm-transport, named in its id), also
    the ones whose communicators come from code that reads the environment rather than a
    fixture: hetcomm.torch's groups, a bare hetcomm.init(), the CLI's jobs."""
    if not pytestconfig.getoption("hetcomm_transport"):
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HETCOMM_TRANSPORT", hetcomm_transport)
        rails = pytestconfig.getoption("hetcomm_rails")
        if rails:
            mp.setenv("HETCOMM_RAILS", rails)
        yield


class Errors(list[str]):
    """Mismatches found by this rank; `verify()` is collective over the test's communicator."""

    def __init__(self, comm: Communicator, seed: int) -> None:
        super().__init__()
        self.comm, self.seed = comm, seed
        self.verified = False  # verify() was entered (its collective made or under way)

    def expect(self, ok: bool, message: str) -> None:
        if not ok:
            self.append(message)

    def run(self, what: str, call: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
        """`call(*args, **kwargs)`; an exception is recorded (and False returned) instead of
        raised, so that a rank whose call failed after communicating (a root, say) goes on
        making the same calls as the others."""
        try:
            call(*args, **kwargs)
        except Exception as exc:
            self.append(f"{what}: {type(exc).__name__}: {exc}")
            return False
        return True

    def verify(self) -> None:
        self.verified = True
        shown = "; ".join(self[:5]) + (f"; and {len(self) - 5} more" if len(self) > 5 else "")
        assert_all_ranks(self.comm, not self, f"(seed {self.seed}) {shown}")


# what a test may raise on one rank and still leave the job running (not an interrupt or exit)
_RAISED = (Exception, pytest.fail.Exception, pytest.skip.Exception, pytest.xfail.Exception)


def report_raised(item: pytest.Item, exc: BaseException | None) -> None:
    """After a test's call: where it raised `exc` on this rank before its `errors.verify()`,
    make that verify's collective with what it raised (the test's own error stays its report
    on this rank), so that the other ranks, waiting there, fail with it now."""
    errors = getattr(item, "funcargs", {}).get("errors")
    if not isinstance(exc, _RAISED) or not isinstance(errors, Errors) or errors.verified:
        return
    errors.append(f"raised {type(exc).__name__}: {exc}")
    with contextlib.suppress(Exception):  # the verdict, failing here too, or MPI's error
        errors.verify()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    outcome = yield
    excinfo = outcome.excinfo
    report_raised(item, excinfo[1] if excinfo is not None else None)


@pytest.fixture
def errors(hetcomm_comm: Communicator, hetcomm_shared_seed: int) -> Errors:
    return Errors(hetcomm_comm, hetcomm_shared_seed)


@pytest.fixture
def rng(hetcomm_shared_seed: int) -> np.random.Generator:
    """The same generator on every rank: each rank can draw every rank's inputs."""
    return np.random.default_rng(hetcomm_shared_seed)


@pytest.fixture(scope="class")
def pg(hetcomm_world: Communicator) -> Iterator[Any]:
    """The default torch.distributed group on hetcomm, for a test class (torch tests only)."""
    from _torch_world import default_group

    yield from default_group()
