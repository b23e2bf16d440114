"""A message sent on a closed Communicator never reaches another one.

MPI gives a freed communicator's context id to the next communicator made, and Open MPI hands
that one the messages still addressed to the old. Rank 0 closes a communicator; rank 1 then
sends A on it (the send completes, or fails within its timeout); both make a new communicator
and rank 1 sends B on it: rank 0 must receive B. Run on every transport the suite runs on (mpi,
and staged under --hetcomm-transport=staged).
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import hetcomm

pytestmark = pytest.mark.mpi(min_size=2)


def test_message_on_a_closed_communicator_is_not_delivered_to_the_next(hetcomm_comm, errors, rng):
    comm = hetcomm_comm
    a, b = rng.standard_normal(16).astype(np.float32), rng.standard_normal(16).astype(np.float32)
    old = comm.dup(name="isolation-old")
    # no message on `old` before: Open MPI then hands A to the next communicator that takes
    # the freed id (after a first exchange between the two it does not)
    if comm.rank == 0:
        old.close()
    comm.barrier()  # rank 0's side is closed before rank 1 sends A
    if comm.rank == 1:
        # the send may complete (eager) or time out; A is never delivered
        with contextlib.suppress(hetcomm.HetcommError):
            old.send(a, 0, timeout=3)
    old.close()
    new = comm.dup(name="isolation-new")
    got = np.full(16, np.nan, np.float32)
    if comm.rank == 1:
        errors.run("send B", new.send, b, 0, timeout=30)
    elif comm.rank == 0 and errors.run("recv B", new.recv, got, 1, timeout=30):
        errors.expect(not np.array_equal(got, a), "rank 0 received A, sent on the closed group")
        errors.expect(np.array_equal(got, b), f"rank 0 received {got[:4]}..., not B")
    new.close()
    errors.verify()
