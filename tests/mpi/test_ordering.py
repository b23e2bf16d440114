"""The ordering guard: collectives of one communicator that go through different transports
never overlap, so every rank runs them in the one order they were issued in."""

from __future__ import annotations

import numpy as np
import pytest
from _data import compare

from hetcomm import ReduceOp, introspect
from hetcomm.transports.mpi.transport import MpiTransport
from hetcomm.transports.staged.transport import StagedTransport


@pytest.mark.mpi(min_size=2)
def test_switching_transport_finishes_the_earlier_collectives_first(
    hetcomm_comm, hetcomm_shared_seed, errors
):
    """Large all-reduces go through the staged transport, small ones through mpi (routes set by
    hand: the plan sends every host buffer to one transport); issued asynchronously and
    interleaved, each switch must find the other transport's collectives complete, and every
    result is right."""
    staged = hetcomm_comm._transports.live["staged"] = StagedTransport(hetcomm_comm)
    hetcomm_comm._transports.by_class[("all_reduce", False, False)] = staged
    # the small ones through mpi, whatever --hetcomm-transport says for this run
    hetcomm_comm._transports.by_class[("all_reduce", False, True)] = hetcomm_comm._transports.live[
        "mpi"
    ] = MpiTransport(hetcomm_comm)
    rng = np.random.default_rng(hetcomm_shared_seed)
    n, r = hetcomm_comm.size, hetcomm_comm.rank
    big = [rng.standard_normal((n, 40_000)) for _ in range(3)]
    small = [rng.integers(-50, 50, (n, 16)) for _ in range(3)]
    pending = []
    for i in range(3):
        xb, xs = big[i][r].copy(), small[i][r].copy()
        wb = hetcomm_comm.all_reduce(xb, async_op=True)
        errors.expect(
            introspect.last_transport(hetcomm_comm) is staged,
            f"round {i}: the large one did not go through staged",
        )
        ws = hetcomm_comm.all_reduce(xs, op=ReduceOp.MAX, async_op=True)
        errors.expect(
            wb.test(), f"round {i}: the mpi collective started before the staged one had completed"
        )
        pending.append((wb, xb, big[i].sum(0), ws, xs, small[i].max(0)))
    for i, (wb, xb, eb, ws, xs, es) in enumerate(pending):
        wb.wait()
        ws.wait()
        errors += compare(
            xb, eb, f"round {i} staged sum", stack=big[i], op=ReduceOp.SUM, dtype="float64"
        )
        errors += compare(xs, es, f"round {i} mpi max")
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_point_to_point_is_not_held_back(hetcomm_comm, errors):
    """Sends and receives stay outside the guard: a send posted before a collective on one rank
    and its receive posted after it on the other must not deadlock."""
    if hetcomm_comm.size < 2 or hetcomm_comm.rank > 1:
        hetcomm_comm.all_reduce(np.ones(4))
        errors.verify()
        return
    x = np.full(1000, 7.0) if hetcomm_comm.rank == 0 else np.zeros(1000)
    if hetcomm_comm.rank == 0:
        w = hetcomm_comm.send(x, 1, async_op=True)
        hetcomm_comm.all_reduce(np.ones(4))
        w.wait()
    else:
        hetcomm_comm.all_reduce(np.ones(4))
        hetcomm_comm.recv(x, 0)
        errors += compare(x, np.full(1000, 7.0), "received")
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_coalesced_groups_on_two_transports(hetcomm_comm, hetcomm_shared_seed, errors):
    """A fused call whose groups go through two transports (a large float64 group through
    staged, a small int64 group through mpi, routes set by hand): the second starts only once
    the first has completed, and both results are right."""
    staged = hetcomm_comm._transports.live["staged"] = StagedTransport(hetcomm_comm)
    hetcomm_comm._transports.by_class[("all_reduce", False, False)] = staged
    hetcomm_comm._transports.by_class[("all_reduce", False, True)] = hetcomm_comm._transports.live[
        "mpi"
    ] = MpiTransport(hetcomm_comm)
    rng = np.random.default_rng(hetcomm_shared_seed)
    n, r = hetcomm_comm.size, hetcomm_comm.rank
    big, small = rng.standard_normal((n, 30_000)), rng.integers(-9, 9, (n, 7))
    xb, xs = big[r].copy(), small[r].copy()
    hetcomm_comm.all_reduce_coalesced([xb, xs])
    errors.expect(
        introspect.last_transport(hetcomm_comm) is introspect.transports(hetcomm_comm)["mpi"],
        "the last group did not go through mpi",
    )
    errors.expect(
        all(introspect.finished(w) for w in introspect.in_flight(hetcomm_comm)),
        "a group is still in flight",
    )
    errors += compare(xb, big.sum(0), "staged group", stack=big, op=ReduceOp.SUM, dtype="float64")
    errors += compare(xs, small.sum(0), "mpi group")
    errors.verify()
