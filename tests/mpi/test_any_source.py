"""Receiving from any source: `Communicator.recv(x, hetcomm.ANY_SOURCE)` returns the sender's
rank (a Work carries it as `source`); transports that need the sender refuse it by name."""

from __future__ import annotations

import numpy as np
import pytest

import hetcomm
from hetcomm import introspect

pytestmark = pytest.mark.mpi(min_size=2)


def _recv_transport(comm: hetcomm.Communicator, y: np.ndarray) -> str:
    # which transport the plan gives a receive of y (the same on every rank)
    return introspect.transport_of(comm, "recv", y, "y").name


def test_recv_from_any_source_returns_the_sender(hetcomm_comm, errors, rng):
    """Every other rank sends rank 0 two messages; rank 0 takes them from any source, half
    blocking and half with a Work, in whatever order they come. Each message holds its sender's
    rank, its number and a random payload drawn on every rank, so the returned rank and the data
    are both checked against what that rank sent, and one sender's two arrive in order."""
    comm = hetcomm_comm
    n = 64
    payload = rng.standard_normal((comm.size, 2, n))  # the same draw on every rank
    y = np.empty(n + 2, np.float64)
    if _recv_transport(comm, y) != "mpi":
        return  # the refusal is tested below
    if comm.rank == 0:
        seen: dict[int, list[int]] = {}
        for i in range(2 * (comm.size - 1)):
            y = np.full(n + 2, np.nan)
            if i % 2 == 0:
                sender = comm.recv(y, hetcomm.ANY_SOURCE, tag=7, timeout=30)
            else:
                work = comm.recv(y, hetcomm.ANY_SOURCE, tag=7, async_op=True, timeout=30)
                work.wait()
                sender = work.source
            errors.expect(sender == int(y[0]), f"recv returned {sender}, data from {y[0]}")
            number = int(y[1])
            seen.setdefault(sender, []).append(number)
            if 0 < sender < comm.size and number in (0, 1):
                want = payload[sender, number]
                errors.expect(np.array_equal(y[2:], want), f"payload from {sender} differs")
        want_seen = {r: [0, 1] for r in range(1, comm.size)}
        errors.expect(seen == want_seen, f"messages seen: {seen}")
    else:
        for number in range(2):
            msg = np.concatenate([[comm.rank, number], payload[comm.rank, number]])
            errors.run("send", comm.send, msg, 0, tag=7, timeout=30)
    errors.verify()


def test_recv_with_a_named_source_returns_it(hetcomm_comm, errors):
    comm = hetcomm_comm
    y = np.zeros(3, np.int32)
    if comm.rank == 0:
        errors.run("send", comm.send, np.arange(3, dtype=np.int32), 1)
    elif comm.rank == 1:
        got = comm.recv(y, 0)
        errors.expect(got == 0, f"recv returned {got}")
        errors.expect(y.tolist() == [0, 1, 2], f"recv got {y}")
    errors.verify()


def test_any_source_is_refused_by_name_where_the_transport_needs_the_sender(hetcomm_comm, errors):
    """On every transport but mpi, ANY_SOURCE raises InvalidArgument naming the transport and
    the ways out, before anything moves (y untouched); bad sources are still refused."""
    comm = hetcomm_comm
    y = np.full(8, 5.0)
    transport = _recv_transport(comm, y)
    if transport != "mpi":
        try:
            comm.recv(y, hetcomm.ANY_SOURCE)
            errors.append(f"ANY_SOURCE on {transport}: no error")
        except hetcomm.InvalidArgument as exc:
            for word in (f"'{transport}'", "src=rank", "HETCOMM_TRANSPORT=mpi"):
                errors.expect(word in str(exc), f"{word} not in: {exc}")
        errors.expect((y == 5.0).all(), f"y changed: {y}")
    for bad in (-1, -2, comm.size, True):  # -1 is a bad rank, not ANY_SOURCE
        try:
            comm.recv(y, bad)
            errors.append(f"src={bad!r}: no error")
        except hetcomm.InvalidArgument:
            pass
    errors.verify()
