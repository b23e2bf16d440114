"""MPI transport: host buffers (and device buffers where the MPI is GPU-aware) through mpi4py."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from mpi4py import MPI

from ..ops import ReduceOp
from ..work import Work
from . import Transport

if TYPE_CHECKING:
    from ..arrays import Buffer
    from ..topology import Topology

# bool travels as uint8: MAX of 0/1 is "or", MIN is "and"
_BOOL_OPS = {
    ReduceOp.SUM: MPI.MAX, ReduceOp.MAX: MPI.MAX, ReduceOp.PROD: MPI.MIN, ReduceOp.MIN: MPI.MIN,
}  # fmt: skip
_NATIVE_OPS = {
    ReduceOp.SUM: MPI.SUM, ReduceOp.AVG: MPI.SUM, ReduceOp.PROD: MPI.PROD,
    ReduceOp.MIN: MPI.MIN, ReduceOp.MAX: MPI.MAX,
}  # fmt: skip
_DATATYPES = {
    "bool": MPI.UINT8_T, "uint8": MPI.UINT8_T, "int8": MPI.INT8_T, "int16": MPI.INT16_T,
    "int32": MPI.INT32_T, "int64": MPI.INT64_T, "float32": MPI.FLOAT, "float64": MPI.DOUBLE,
    "float16": MPI.UINT16_T, "bfloat16": MPI.UINT16_T,
}  # fmt: skip
# MPI has no bfloat16 (and float16 only as an extension): those are reduced by hetcomm's own
# kernels inside user-defined MPI operations, one per (dtype, op), created on first use.
_HALF_OPS: dict[tuple[str, ReduceOp], MPI.Op] = {}
_IN_PLACE = MPI.IN_PLACE
_AVG = ReduceOp.AVG
_OPS = {(d, op.value): mpi for d in _DATATYPES if d not in ("bool", "float16", "bfloat16")
        for op, mpi in _NATIVE_OPS.items()}  # fmt: skip


def mpi_op(dtype: str, op: ReduceOp) -> MPI.Op:
    """The MPI operation that reduces `dtype` with `op` (AVG reduces as SUM, then divides)."""
    found = _OPS.get((dtype, op._value_))
    if found is not None:
        return found
    if dtype == "bool":
        return _BOOL_OPS[op]
    if dtype in ("float16", "bfloat16"):
        key = (dtype, op)
        found = _HALF_OPS.get(key)
        if found is None:
            found = _HALF_OPS[key] = MPI.Op.Create(_half_reducer(dtype, op), commute=True)
        return found
    return _NATIVE_OPS[op]


def _half_reducer(dtype: str, op: ReduceOp) -> Callable[[Any, Any, Any], None]:
    from ..kernels import reduce as kr

    kind = "sum" if op is ReduceOp.AVG else op.value
    combine = kr.combine

    def reducer(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
        combine(
            np.frombuffer(inoutbuf, dtype=np.uint16), np.frombuffer(inbuf, dtype=np.uint16),
            kind, dtype,
        )  # fmt: skip

    return reducer


def _poll(request: MPI.Request) -> Callable[[], bool]:
    return request.Test


class MpiTransport(Transport):
    """Every operation as one non-blocking MPI call on the communicator's own MPI communicator."""

    name: ClassVar[str] = "mpi"
    memory: ClassVar[tuple[str, ...]] = ("host", "device")

    def __init__(self, comm: Any) -> None:
        super().__init__(comm)
        self._mpi: MPI.Intracomm = comm.mpi

    @classmethod
    def unavailable(cls, topology: Topology) -> str | None:
        return None  # the communicator itself is MPI, so MPI is always there

    def _work(self, op: str, seq: int, request: MPI.Request, finish: list | None = None) -> Work:
        return Work(self.comm, op, seq, request.Test, finish or [])

    def _average(self, buf: Buffer) -> list[Callable[[], None]]:
        from ..kernels import reduce as kr

        assert buf.host is not None
        host, dtype, n = buf.host.view(kr.storage_dtype(buf.dtype)), buf.dtype, self._mpi.Get_size()
        return [lambda: kr.divide(host, n, dtype)]

    def all_reduce(self, x: Buffer, out: Buffer, op: ReduceOp, seq: int) -> Work:
        dt = _DATATYPES[x.dtype]
        send = _IN_PLACE if out is x else (x.host, dt)
        req = self._mpi.Iallreduce(send, (out.host, dt), mpi_op(x.dtype, op))
        if op is _AVG:
            return Work(self.comm, "all_reduce", seq, req.Test, self._average(out))
        return Work(self.comm, "all_reduce", seq, req.Test, ())

    def reduce(self, x: Buffer, op: ReduceOp, root: int, seq: int) -> Work:
        dt = _DATATYPES[x.dtype]
        mop = mpi_op(x.dtype, op)
        if self._mpi.Get_rank() == root:
            req = self._mpi.Ireduce(MPI.IN_PLACE, (x.host, dt), mop, root)
            finish = self._average(x) if op is ReduceOp.AVG else None
        else:
            req = self._mpi.Ireduce((x.host, dt), None, mop, root)
            finish = None
        return self._work("reduce", seq, req, finish)

    def broadcast(self, x: Buffer, root: int, seq: int) -> Work:
        req = self._mpi.Ibcast((x.host, _DATATYPES[x.dtype]), root)
        return self._work("broadcast", seq, req)

    def all_gather(self, out: Buffer, x: Buffer, seq: int) -> Work:
        dt = _DATATYPES[x.dtype]
        req = self._mpi.Iallgather((x.host, dt), (out.host, dt))
        return self._work("all_gather", seq, req)

    def reduce_scatter(self, out: Buffer, x: Buffer, op: ReduceOp, seq: int) -> Work:
        dt = _DATATYPES[x.dtype]
        req = self._mpi.Ireduce_scatter_block((x.host, dt), (out.host, dt), mpi_op(x.dtype, op))
        finish = self._average(out) if op is ReduceOp.AVG else None
        return self._work("reduce_scatter", seq, req, finish)

    def all_to_all(self, out: Buffer, x: Buffer, seq: int) -> Work:
        dt = _DATATYPES[x.dtype]
        req = self._mpi.Ialltoall((x.host, dt), (out.host, dt))
        return self._work("all_to_all", seq, req)

    def send(self, x: Buffer, dst: int, tag: int, seq: int) -> Work:
        req = self._mpi.Isend((x.host, _DATATYPES[x.dtype]), dst, tag)
        return self._work("send", seq, req)

    def recv(self, x: Buffer, src: int, tag: int, seq: int) -> Work:
        req = self._mpi.Irecv((x.host, _DATATYPES[x.dtype]), src, tag)
        return self._work("recv", seq, req)

    def barrier(self, seq: int) -> Work:
        return self._work("barrier", seq, self._mpi.Ibarrier())
