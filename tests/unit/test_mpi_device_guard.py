"""A device pointer never reaches an MPI library that is not GPU-aware (Debian's Open MPI
segfaults on one): the mpi transport refuses it with the reason, before MPI sees anything."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from hetcomm.arrays import Buffer
from hetcomm.config import Config
from hetcomm.errors import TransportUnavailable
from hetcomm.ops import ReduceOp
from hetcomm.plan import Member
from hetcomm.transports.mpi.transport import MpiTransport


class _Calls:
    """An MPI communicator stand-in that fails the test if any call reaches it."""

    def Get_size(self):
        return 2

    def Get_rank(self):
        return 0

    def __getattr__(self, name):
        def call(*args, **kwargs):
            raise AssertionError(f"MPI.{name} was called with a device buffer")

        return call


def _transport(aware: list[bool]) -> MpiTransport:
    members = [Member(r, "h", "nvidia", f"gpu{r}", a) for r, a in enumerate(aware)]
    comm = SimpleNamespace(
        mpi=_Calls(), name="dp", config=Config(), topology=SimpleNamespace(members=lambda: members)
    )
    return MpiTransport(comm)


def _device(dtype: str = "float32", n: int = 8) -> Buffer:
    return Buffer(
        obj=object(),
        kind="cupy",
        dtype=dtype,
        shape=(n,),
        device="cuda",
        device_index=0,
        ptr=0x7F0000000000,
        contiguous=True,
        readonly=False,
        host=None,
    )


@pytest.mark.parametrize("op", ["all_reduce", "broadcast", "all_gather", "send", "recv"])
def test_not_gpu_aware_refuses_device_buffers(op):
    t = _transport([True, False])
    x = _device()
    calls = {
        "all_reduce": lambda: t.all_reduce(x, x, ReduceOp.SUM, 1),
        "broadcast": lambda: t.broadcast(x, 0, 1),
        "all_gather": lambda: t.all_gather(_device(n=16), x, 1),
        "send": lambda: t.send(x, 1, 0, 1),
        "recv": lambda: t.recv(x, 1, 0, 1),
    }
    with pytest.raises(TransportUnavailable, match=r"not GPU-aware on ranks \[1\]"):
        calls[op]()


def test_half_reductions_of_device_arrays_are_refused_even_when_aware():
    t = _transport([True, True])
    x = _device("bfloat16")
    with pytest.raises(TransportUnavailable, match="cannot reduce bfloat16 device arrays"):
        t.all_reduce(x, x, ReduceOp.SUM, 1)


def test_host_buffers_still_go_through():
    t = _transport([False, False])
    host = np.zeros(4, np.float32)
    b = Buffer(
        obj=host,
        kind="numpy",
        dtype="float32",
        shape=(4,),
        device="cpu",
        device_index=None,
        ptr=-1,
        contiguous=True,
        readonly=False,
        host=host,
    )
    assert t._mem(b) is host
