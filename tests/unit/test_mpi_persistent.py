"""The cache of persistent all-reduces (hetcomm.transports.mpi.persistent) on one rank.

On MPI.COMM_SELF a persistent all-reduce leaves its data as it was, which is enough to see the
cache's bookkeeping: least recently used eviction, requests freed on eviction and on close, a
request given up on while active never reused nor freed, and the transport's copies in and out
of the scratch arrays (device buffers included, with the device copy replaced by a host one).
"""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import numpy as np
import pytest
from mpi4py import MPI

from hetcomm.arrays import Buffer, as_buffer
from hetcomm.config import Config
from hetcomm.ops import ReduceOp
from hetcomm.plan import Member
from hetcomm.transports.mpi import persistent as mpi_persistent
from hetcomm.transports.mpi import transport as mpi_transport
from hetcomm.transports.mpi.datatypes import PERSISTENT
from hetcomm.transports.mpi.persistent import Recipe, Requests
from hetcomm.transports.mpi.transport import MpiTransport

pytestmark = pytest.mark.skipif(
    mpi_persistent.unavailable() is not None, reason=f"{mpi_persistent.unavailable()}"
)

F32_SUM = PERSISTENT[("float32", "sum")]
I64_MAX = PERSISTENT[("int64", "max")]


@pytest.fixture
def self_comm():
    mpi = MPI.COMM_SELF.Dup()
    members = [Member(0, "h", "nvidia", "gpu0", True)]
    comm = SimpleNamespace(
        mpi=mpi,
        name="self",
        config=Config(),
        call_timeout=None,
        _abort=lambda exc: None,
        topology=SimpleNamespace(members=lambda: members),
    )
    yield comm
    mpi.Free()


def _all_reduce(kind, count: int) -> Recipe:
    """The recipe of an in-place persistent all-reduce of `count` elements of `kind`."""

    def init(mpi: MPI.Intracomm, scratch: np.ndarray, out: np.ndarray) -> MPI.Prequest:
        return mpi.Allreduce_init(MPI.IN_PLACE, (scratch, kind.datatype), kind.op)

    return Recipe(
        ("all_reduce", kind.dtype.name, id(kind), count, -1), kind.dtype, count, None, init
    )


def _run(requests: Requests, kind, count: int) -> mpi_persistent.Slot:
    """take() a slot and run one call through it, as the short path does."""
    slot = requests.take(_all_reduce(kind, count))
    slot.active = True
    slot.make().Start()
    while not slot.test():
        pass
    return slot


def test_the_least_recently_used_request_is_freed(self_comm):
    requests = Requests(self_comm, self_comm.mpi, capacity=3)
    a, b, c = (_run(requests, F32_SUM, n) for n in (1, 2, 3))
    assert _run(requests, F32_SUM, 1) is a  # a is now the most recent
    d = _run(requests, I64_MAX, 2)  # full: b, the least recently used, goes
    assert (requests.made, requests.freed, len(requests)) == (4, 1, 3)
    assert b.request == MPI.REQUEST_NULL
    assert _run(requests, F32_SUM, 3) is c and _run(requests, I64_MAX, 2) is d
    assert _run(requests, F32_SUM, 2) is not b  # made again, evicting a
    assert a.request == MPI.REQUEST_NULL and requests.uses == 8
    requests.close()
    assert (requests.freed, len(requests)) == (5, 0)


def test_a_request_given_up_on_is_neither_reused_nor_freed(self_comm, monkeypatch):
    stranded: list[mpi_persistent.Slot] = []
    monkeypatch.setattr(mpi_persistent, "_STRANDED", stranded)
    requests = Requests(self_comm, self_comm.mpi)
    slot = _run(requests, F32_SUM, 4)
    slot.active = True  # as if started and its wait had timed out
    fresh = requests.take(_all_reduce(F32_SUM, 4))
    assert fresh is not slot and stranded == [slot] and slot.request != MPI.REQUEST_NULL
    other = _run(requests, F32_SUM, 5)
    other.active = True
    requests.close()  # frees the inactive ones only
    assert stranded == [slot, other] and other.request != MPI.REQUEST_NULL
    assert requests.freed == 0  # `fresh` was never started: there was nothing to free
    slot.active = other.active = False
    for s in (slot, other):
        s.request.Free()


def test_the_call_in_flight_is_delivered_before_its_request_is_reused(self_comm):
    requests = Requests(self_comm, self_comm.mpi)
    slot = requests.take(_all_reduce(F32_SUM, 3))
    delivered = []
    slot.scratch[...] = [1, 2, 3]
    number = slot.begin(lambda: delivered.append(slot.scratch.copy()), seq=7)
    slot.make().Start()
    assert (
        requests.take(_all_reduce(F32_SUM, 3)) is slot
    )  # waits for call 1, which copies its result out
    assert slot.delivered == number == 1 and [d.tolist() for d in delivered] == [[1, 2, 3]]
    assert slot.poll(number)  # the call's own Work: done, nothing delivered twice
    assert len(delivered) == 1
    requests.close()


def test_transport_copies_in_and_out(self_comm):
    t = MpiTransport(self_comm)
    x = np.arange(4, dtype=np.float32).reshape(2, 2)
    xb = as_buffer(x)
    run = t.prepare("all_reduce", xb, None, ReduceOp.SUM, -1)
    assert run is not None and run(x, x, 1)  # the prepared blocking call, in place
    assert x.tolist() == [[0, 1], [2, 3]]
    host = np.arange(4, dtype=np.int64)
    out = np.zeros(4, np.int64)
    xb = Buffer(
        obj=host,
        kind="numpy",
        dtype="int64",
        shape=(4,),
        device="cpu",
        device_index=None,
        ptr=-1,
        contiguous=True,
        readonly=False,
        host=host,
    )
    ob = Buffer(
        obj=out,
        kind="numpy",
        dtype="int64",
        shape=(4,),
        device="cpu",
        device_index=None,
        ptr=-1,
        contiguous=True,
        readonly=False,
        host=out,
    )
    t.all_reduce(xb, ob, ReduceOp.MAX, 2).wait()
    assert out.tolist() == [0, 1, 2, 3]
    assert t.requests.made == 2 and t.requests.uses == 2
    t.close()
    assert t.requests.freed == 2


def test_device_buffers_go_through_the_host_scratch(self_comm, monkeypatch):
    """A GPU-aware MPI's device buffers: copied to the host scratch and back (the device copy
    is replaced by a host memmove; the buffers are host memory posing as device memory)."""
    copies = []

    def memmove(dst: int, src: int, nbytes: int) -> None:
        copies.append(nbytes)
        ctypes.memmove(dst, src, nbytes)

    monkeypatch.setattr(mpi_transport, "_device_copy", memmove)
    monkeypatch.setattr(MpiTransport, "_mem", lambda self, buf: None)
    t = MpiTransport(self_comm)
    x, out = np.arange(5, dtype=np.float64), np.zeros(5)

    def device(a: np.ndarray) -> Buffer:
        return Buffer(
            obj=a,
            kind="cupy",
            dtype="float64",
            shape=a.shape,
            device="cuda",
            device_index=0,
            ptr=a.ctypes.data,
            contiguous=True,
            readonly=False,
            host=None,
        )

    t.all_reduce(device(x), device(out), ReduceOp.SUM, 1).wait()
    assert out.tolist() == [0, 1, 2, 3, 4] and copies == [40, 40]
    t.close()


def test_off_when_the_limit_is_zero(self_comm):
    self_comm.config = Config(persistent_max=0)
    t = MpiTransport(self_comm)
    x = np.ones(3)
    xb = as_buffer(x)
    run = t.prepare("all_reduce", xb, None, ReduceOp.SUM, -1)
    assert run is not None and run(x, x, 1)
    assert x.tolist() == [1, 1, 1]
    assert t.requests.uses == 0 and t.persistent_off is None
