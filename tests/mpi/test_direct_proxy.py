"""The direct transport's proxy thread, without a GPU: operations are generators of MPI waits.

The proxy sleeps on a condition while idle and in MPI_Waitany while operations wait for other
ranks; an operation queued in either state must be picked up, collectives must run one at a time
in issue order, and sends/receives must progress beside a collective that waits for them.
"""

from __future__ import annotations

import time
import types

import numpy as np
import pytest

from hetcomm.transports.direct.proxy import Proxy, Task

_NO_GPU = types.SimpleNamespace(
    cuda=types.SimpleNamespace(
        Device=lambda d: types.SimpleNamespace(use=lambda: None), Stream=lambda non_blocking: None
    )
)


def _proxy(comm):
    return Proxy(0, _NO_GPU, comm.mpi.Dup())


def _wait(task: Task) -> None:
    assert task.finished.wait(20), "the proxy never finished the operation"
    if task.error is not None:
        raise task.error


@pytest.mark.mpi(min_size=2)
def test_ring_of_operations_with_idle_spells(comm, errors):
    p = _proxy(comm)
    mpi, r, n = comm.mpi, comm.rank, comm.size
    got = []

    def ring(i):
        buf = np.zeros(1, np.int64)
        yield [
            mpi.Isend(np.array([i * n + r], np.int64), (r + 1) % n, 7),
            mpi.Irecv(buf, (r - 1) % n, 7),
        ]
        got.append(int(buf[0]))

    try:
        for i in range(60):
            mpi.Barrier()
            task = Task(ring(i))
            p.submit(task, True)
            _wait(task)
            if i % 20 == 0:
                time.sleep(0.02)  # idle: the proxy sleeps on its condition
    finally:
        p.stop()
    want = [i * n + (r - 1) % n for i in range(60)]
    errors.expect(got == want, f"received {got[:5]}..., expected {want[:5]}...")
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_point_to_point_progresses_beside_a_waiting_collective(comm, errors):
    """Rank 0 queues a collective (a barrier) and then a send; rank 1 receives before it joins
    the barrier. The send must go out while the barrier waits, or both ranks wait forever."""
    p = _proxy(comm)
    mpi, r = comm.mpi, comm.rank
    buf = np.zeros(4, np.int64)

    def barrier():
        yield mpi.Ibarrier()

    def send():
        yield mpi.Isend(np.arange(4, dtype=np.int64), 1, 9)

    def recv():
        yield mpi.Irecv(buf, 0, 9)

    try:
        if r == 0:
            coll, pt = Task(barrier()), Task(send())
            p.submit(coll, True)
            time.sleep(0.05)  # the barrier is waiting in MPI_Waitany when the send arrives
            p.submit(pt, False)
            _wait(pt)
            _wait(coll)
        else:
            if r == 1:
                pt = Task(recv())
                p.submit(pt, False)
                _wait(pt)
            coll = Task(barrier())
            p.submit(coll, True)
            _wait(coll)
    finally:
        p.stop()
    if r == 1:
        errors.expect(buf.tolist() == [0, 1, 2, 3], f"received {buf.tolist()}")
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_collectives_run_in_issue_order_and_errors_reach_the_caller(comm, errors):
    p = _proxy(comm)
    mpi = comm.mpi
    order = []

    def step(i):
        yield mpi.Ibarrier()
        order.append(i)

    def broken():
        yield None
        raise ValueError("broken step")

    try:
        tasks = [Task(step(i)) for i in range(5)]
        for t in tasks:
            p.submit(t, True)
        bad = Task(broken())
        p.submit(bad, True)
        for t in tasks:
            _wait(t)
        assert bad.finished.wait(20)
    finally:
        p.stop()
    errors.expect(order == list(range(5)), f"ran in order {order}")
    errors.expect(isinstance(bad.error, ValueError), f"error {bad.error!r}")
    errors.verify()
