"""The MPI tests' own harness (conftest.py): a rank whose test raised before its
`errors.verify()` makes that verify's collective with what it raised, so the other ranks fail
there with it instead of waiting for the hang timeout."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from hetcomm.testing import assert_all_ranks

pytestmark = pytest.mark.mpi(min_size=2)


def test_a_rank_that_raised_before_verify_fails_every_rank_there(errors, request) -> None:
    harness = sys.modules[type(errors).__module__]  # conftest.py, as pytest loaded it
    me = errors.comm.rank
    if me == 0:  # its test raised here, before verify
        harness.report_raised(request.node, RuntimeError("boom on rank 0"))
        ok = errors.verified and errors == ["raised RuntimeError: boom on rank 0"]
        why = f"rank 0 reported {list(errors)}, verify made: {errors.verified}"
    else:
        try:
            errors.verify()
            seen = ""
        except AssertionError as exc:
            seen = str(exc)
        ok = (
            f"failed on 1 of {errors.comm.size} ranks: rank 0: (seed {errors.seed})" in seen
            and "raised RuntimeError: boom on rank 0" in seen
        )
        why = f"verify said {seen!r}"
    # once verify was made, a later report makes no collective
    harness.report_raised(request.node, RuntimeError("again"))
    ok = ok and "raised RuntimeError: again" not in errors
    # nothing raised, or an interrupt: nothing recorded, no collective
    fresh = type(errors)(errors.comm, errors.seed)
    for exc in (None, KeyboardInterrupt()):
        harness.report_raised(SimpleNamespace(funcargs={"errors": fresh}), exc)
    ok = ok and not fresh and not fresh.verified
    assert_all_ranks(errors.comm, ok, why)
