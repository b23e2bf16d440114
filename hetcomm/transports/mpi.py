"""MPI transport: host buffers (and device buffers where the MPI is GPU-aware) through mpi4py."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
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
# numpy dtype -> MPI datatype and (numpy dtype, op) -> MPI op, for the dtypes MPI reduces itself
_FAST_TYPES = {np.dtype(d): t for d, t in _DATATYPES.items()
               if d not in ("bool", "float16", "bfloat16")}  # fmt: skip
_FAST_OPS = {(dt, op.value): mpi for dt in _FAST_TYPES for op, mpi in _NATIVE_OPS.items()
             if op is not ReduceOp.AVG}  # fmt: skip
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


# Above this size a collective runs as a blocking MPI call on the communicator's lane thread:
# MPI libraries tune their blocking algorithms far better than their non-blocking ones (Open
# MPI's non-blocking all-reduce of 16 MiB on 2 ranks takes about twice as long), and a thread
# hand-off costs microseconds. Smaller ones are started non-blocking from the calling thread.
LANE_BYTES = 256 * 1024


class _Job(threading.Event):
    """A blocking MPI call queued on a lane; set once it has returned."""

    def __init__(self, call: Callable[[], Any]) -> None:
        super().__init__()
        self.call = call
        self.error: BaseException | None = None

    def check(self) -> None:
        if self.error is not None:
            raise self.error


class _Lane:
    """One thread running a communicator's large collectives in the order they were issued.

    Collectives must start in the same order on every rank. A small one is started directly only
    while the lane is idle (nothing queued, nothing running), under the same lock that queues
    jobs, so that a direct start can never overtake a queued one.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._cond = threading.Condition(self.lock)
        self._jobs: deque[_Job] = deque()
        self._busy = False
        self._thread: threading.Thread | None = None

    def idle(self) -> bool:
        """Call with `lock` held."""
        return not self._busy and not self._jobs

    def submit(self, call: Callable[[], Any]) -> _Job:
        """Call with `lock` held."""
        job = _Job(call)
        self._jobs.append(job)
        self._busy = True
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="hetcomm-mpi-lane",
                                            daemon=True)  # fmt: skip
            self._thread.start()
        self._cond.notify()
        return job

    def _loop(self) -> None:
        while True:
            with self.lock:
                while not self._jobs:
                    self._busy = False
                    self._cond.wait()
                job = self._jobs.popleft()
            try:
                job.call()
            except BaseException as exc:
                job.error = exc
            job.set()


class MpiTransport(Transport):
    """Every operation as MPI calls on the communicator's own MPI communicator: small ones
    non-blocking from the calling thread, large collectives blocking on a lane thread."""

    name: ClassVar[str] = "mpi"
    memory: ClassVar[tuple[str, ...]] = ("host", "device")

    def __init__(self, comm: Any) -> None:
        super().__init__(comm)
        self._mpi: MPI.Intracomm = comm.mpi
        self._lane = _Lane()

    @classmethod
    def unavailable(cls, topology: Topology) -> str | None:
        return None  # the communicator itself is MPI, so MPI is always there

    def _start(self, op: str, seq: int, nbytes: int, nonblocking: Callable[[], MPI.Request],
               blocking: Callable[[], Any], finish: Sequence[Callable[[], None]] = ()) -> Work:  # fmt: skip
        lane = self._lane
        with lane.lock:
            if nbytes <= LANE_BYTES and lane.idle():
                return Work(self.comm, op, seq, nonblocking().Test, finish)
            job = lane.submit(blocking)
        return Work(self.comm, op, seq, job.is_set, [job.check, *finish], waiter=job.wait)

    def _average(self, buf: Buffer) -> list[Callable[[], None]]:
        from ..kernels import reduce as kr

        assert buf.host is not None
        host, dtype, n = buf.host.view(kr.storage_dtype(buf.dtype)), buf.dtype, self._mpi.Get_size()
        return [lambda: kr.divide(host, n, dtype)]

    def all_reduce(self, x: Buffer, out: Buffer, op: ReduceOp, seq: int) -> Work:
        dt = _DATATYPES[x.dtype]
        send = _IN_PLACE if out is x else (x.host, dt)
        recv, mop, mpi = (out.host, dt), mpi_op(x.dtype, op), self._mpi
        finish = self._average(out) if op is _AVG else ()
        return self._start("all_reduce", seq, out.nbytes, lambda: mpi.Iallreduce(send, recv, mop),
                           lambda: mpi.Allreduce(send, recv, mop), finish)  # fmt: skip

    def all_reduce_in_place(self, x: np.ndarray, op: ReduceOp, seq: int) -> bool:
        """A small in-place all-reduce of a numpy array, done and waited for; False (nothing
        started) when the array or the lane calls for the general path."""
        mop = _FAST_OPS.get((x.dtype, op._value_))
        flags = x.flags
        if mop is None or not flags.c_contiguous or not flags.writeable or x.nbytes > LANE_BYTES:
            return False
        lane = self._lane
        with lane.lock:
            if not lane.idle():
                return False
            req = self._mpi.Iallreduce(_IN_PLACE, (x, _FAST_TYPES[x.dtype]), mop)
        if not req.Test():
            Work(self.comm, "all_reduce", seq, req.Test).wait()
        return True

    def reduce(self, x: Buffer, op: ReduceOp, root: int, seq: int) -> Work:
        dt, mpi = _DATATYPES[x.dtype], self._mpi
        mop = mpi_op(x.dtype, op)
        send: Any
        recv: Any
        if mpi.Get_rank() == root:
            send, recv = _IN_PLACE, (x.host, dt)
            finish = self._average(x) if op is ReduceOp.AVG else ()
        else:
            send, recv, finish = (x.host, dt), None, ()
        return self._start("reduce", seq, x.nbytes, lambda: mpi.Ireduce(send, recv, mop, root),
                           lambda: mpi.Reduce(send, recv, mop, root), finish)  # fmt: skip

    def broadcast(self, x: Buffer, root: int, seq: int) -> Work:
        buf, mpi = (x.host, _DATATYPES[x.dtype]), self._mpi
        return self._start("broadcast", seq, x.nbytes, lambda: mpi.Ibcast(buf, root),
                           lambda: mpi.Bcast(buf, root))  # fmt: skip

    def all_gather(self, out: Buffer, x: Buffer, seq: int) -> Work:
        dt, mpi = _DATATYPES[x.dtype], self._mpi
        send, recv = (x.host, dt), (out.host, dt)
        return self._start("all_gather", seq, out.nbytes, lambda: mpi.Iallgather(send, recv),
                           lambda: mpi.Allgather(send, recv))  # fmt: skip

    def reduce_scatter(self, out: Buffer, x: Buffer, op: ReduceOp, seq: int) -> Work:
        dt, mpi = _DATATYPES[x.dtype], self._mpi
        send, recv, mop = (x.host, dt), (out.host, dt), mpi_op(x.dtype, op)
        finish = self._average(out) if op is ReduceOp.AVG else ()
        return self._start("reduce_scatter", seq, x.nbytes,
                           lambda: mpi.Ireduce_scatter_block(send, recv, mop),
                           lambda: mpi.Reduce_scatter_block(send, recv, mop), finish)  # fmt: skip

    def all_to_all(self, out: Buffer, x: Buffer, seq: int) -> Work:
        dt, mpi = _DATATYPES[x.dtype], self._mpi
        send, recv = (x.host, dt), (out.host, dt)
        return self._start("all_to_all", seq, x.nbytes, lambda: mpi.Ialltoall(send, recv),
                           lambda: mpi.Alltoall(send, recv))  # fmt: skip

    def send(self, x: Buffer, dst: int, tag: int, seq: int) -> Work:
        req = self._mpi.Isend((x.host, _DATATYPES[x.dtype]), dst, tag)
        return Work(self.comm, "send", seq, req.Test)

    def recv(self, x: Buffer, src: int, tag: int, seq: int) -> Work:
        req = self._mpi.Irecv((x.host, _DATATYPES[x.dtype]), src, tag)
        return Work(self.comm, "recv", seq, req.Test)

    def barrier(self, seq: int) -> Work:
        mpi = self._mpi
        return self._start("barrier", seq, 0, mpi.Ibarrier, mpi.Barrier)
