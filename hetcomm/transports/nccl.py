"""NCCL transport: device buffers through NCCL (RCCL on ROCm builds of CuPy), on the array's stream.

The unique id travels as raw bytes over the group's MPI service communicator, never through a
TCP store. Collectives use one NCCL communicator per group, made by the first collective (every
rank reaches it); point-to-point uses one two-rank communicator per pair of ranks, made by the
first send/recv between them, so that ranks outside the pair are never needed.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from ..dtypes import BOOL_AS_MINMAX, TABLE
from ..errors import InvalidArgument
from ..ops import ReduceOp
from ..work import Work
from . import tags
from .base import Context, Transport

if TYPE_CHECKING:
    from ..arrays import Buffer
    from ..topology import Topology

# ncclDataType_t and ncclRedOp_t values (nccl.h; the same in RCCL)
_TYPES = {name: d.nccl for name, d in TABLE.items() if d.nccl is not None}
_UINT8 = 1
_SUM, _PROD, _MAX, _MIN = 0, 1, 2, 3
_OPS = {
    ReduceOp.SUM: _SUM,
    ReduceOp.AVG: _SUM,
    ReduceOp.PROD: _PROD,
    ReduceOp.MIN: _MIN,
    ReduceOp.MAX: _MAX,
}
# bool travels as uint8 0/1: its reductions are MAX ("or") and MIN ("and")
_BOOL_OPS = {
    op: _OPS[ReduceOp(BOOL_AS_MINMAX[op.value])] for op in ReduceOp if op.value in BOOL_AS_MINMAX
}
log = logging.getLogger("hetcomm")

# Every NCCL communicator this process has made and not yet ended. CuPy's NcclCommunicator
# destroys itself when the garbage collector frees it, and ncclCommDestroy waits for the other
# ranks: a communicator dropped without close() would be destroyed during whatever allocation
# set off the collector, at another moment (or in another order) on each rank, and wait there
# forever. On the 2-GPU machine that froze a later staged all_reduce of two ranks inside the
# collector. Kept here, a communicator ends only by close() (which every rank calls) or, left
# over, by an abort when the interpreter exits, given EXIT_ABORT_S.
_LIVE: dict[int, Any] = {}
_LIVE_LOCK = threading.Lock()
EXIT_ABORT_S = 5.0


def _keep(nccl_comm: Any) -> Any:
    with _LIVE_LOCK:
        _LIVE[id(nccl_comm)] = nccl_comm
    return nccl_comm


def _end(nccl_comm: Any, abort: bool) -> None:
    """Destroy (with the other ranks) or abort an NCCL communicator, and stop keeping it."""
    try:
        nccl_comm.abort() if abort else nccl_comm.destroy()
    finally:
        with _LIVE_LOCK:
            _LIVE.pop(id(nccl_comm), None)


@atexit.register
def abort_left_over(limit: float | None = None) -> int:
    """Abort the NCCL communicators never closed (at exit; returns how many there were).

    The aborts run on a daemon thread for at most `limit` seconds (EXIT_ABORT_S): an abort can
    wait for the other ranks of a node, and a rank that exits must not wait for them. Those
    not ended by then are never freed, so that the interpreter's teardown cannot destroy them.
    """
    with _LIVE_LOCK:
        left = list(_LIVE.values())
    if not left:
        return 0
    log.warning(
        "%d NCCL communicator(s) of hetcomm were not closed; aborting them at exit "
        "(close every Communicator, on every rank, to end them cleanly)",
        len(left),
    )

    def run() -> None:
        for c in left:
            with contextlib.suppress(Exception):
                _end(c, abort=True)

    ender = threading.Thread(target=run, daemon=True, name="hetcomm-nccl-exit")
    ender.start()
    ender.join(EXIT_ABORT_S if limit is None else limit)
    with _LIVE_LOCK:
        stuck = list(_LIVE.values())
    for c in stuck:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(c))  # never freed, so never destroyed
    return len(left)


def library_unavailable() -> str | None:
    """None when CuPy's NCCL (or RCCL) binding is importable and usable here, else why not."""
    try:
        from cupy.cuda import nccl
    except ImportError as exc:
        return f"cupy with NCCL is not installed ({exc}); pip install 'hetcomm[cuda]'"
    if not getattr(nccl, "available", True):
        return "this cupy was built without NCCL/RCCL"
    from ..kernels.device import unavailable

    return unavailable()  # a usable GPU runtime with a device


def group_unavailable(
    devices: Sequence[tuple[int, str | None]], vendors: Sequence[str]
) -> str | None:
    """Why NCCL cannot serve members with these (rank, device identity) and vendors, or None.

    Pure: no import of any GPU library.
    """
    kinds = sorted(set(vendors))
    if "cpu" in kinds:
        return "some members have no GPU (vendor 'cpu')"
    if len(kinds) > 1:
        return f"members span vendors {', '.join(kinds)}: NCCL and RCCL do not talk to each other"
    missing = [rank for rank, dev in devices if dev is None]
    if missing:
        return f"ranks {missing} have no device"
    seen: dict[str, int] = {}
    for rank, dev in devices:
        assert dev is not None
        if dev in seen:
            return (
                f"ranks {seen[dev]} and {rank} share device {dev}; NCCL refuses two ranks on "
                "one GPU ('duplicate GPU')"
            )
        seen[dev] = rank
    return None


class _Pending:
    """What an enqueued NCCL operation must keep alive until its event has passed."""

    __slots__ = ("event", "keep")

    def __init__(self, event: Any, keep: tuple[Any, ...]) -> None:
        self.event, self.keep = event, keep


class NcclTransport(Transport):
    """Collectives and point-to-point through NCCL, ordered on each array's current stream."""

    name: ClassVar[str] = "nccl"
    memory: ClassVar[tuple[str, ...]] = ("device",)

    def __init__(self, comm: Context) -> None:
        super().__init__(comm)
        import cupy
        from cupy.cuda import nccl

        self.cupy, self.nccl = cupy, nccl
        self.rank, self.size = comm.rank, comm.size
        self._group: Any = None  # the group's NCCL communicator, made by the first collective
        self._pairs: dict[int, Any] = {}  # peer -> two-rank communicator for send/recv
        self._device: int | None = None
        self._scratch: Any = None

    @classmethod
    def unavailable(cls, topology: Topology) -> str | None:
        """None when every member is one vendor's GPU, one per device, with NCCL importable."""
        members = topology.members()
        why = group_unavailable([(m.rank, m.device) for m in members], [m.vendor for m in members])
        if why is not None:
            return why
        why = library_unavailable()
        if why is not None:
            return why
        import cupy

        hip = bool(getattr(cupy.cuda.runtime, "is_hip", False))
        vendor = members[0].vendor
        if (vendor == "amd") != hip and all(r.vendor == r.detected_vendor for r in topology.ranks):
            built = "ROCm (RCCL)" if hip else "CUDA (NCCL)"
            return f"the members are {vendor} GPUs but cupy is a {built} build"
        return None

    # ---- communicators -------------------------------------------------------------------------

    def _bind(self, buf: Buffer, what: str) -> None:
        if buf.device_index is None or not buf.on_device:
            raise InvalidArgument(f"{what}: NCCL moves device arrays only, got {buf.describe()}")
        if self._device is None:
            self._device = buf.device_index
        elif buf.device_index != self._device:
            raise InvalidArgument(
                f"{what}: group '{self.comm.name}' runs NCCL on device {self._device}, got "
                f"{buf.describe()}; keep one device per rank"
            )

    def _make(self, size: int, rank: int, uid: np.ndarray) -> Any:
        # byte 0 says how this cupy spells a unique id: bytes (1) or a tuple of small ints (0)
        commid: Any = uid[1:].tobytes() if uid[0] else tuple(int(b) for b in uid[1:])
        with self.cupy.cuda.Device(self._device):
            return _keep(self.nccl.NcclCommunicator(size, commid, rank))

    def _new_uid(self) -> np.ndarray:
        raw = self.nccl.get_unique_id()
        uid = np.zeros(129, dtype=np.int8)
        if isinstance(raw, (bytes, bytearray)):
            uid[0], uid[1:] = 1, np.frombuffer(raw, dtype=np.int8)
        else:
            uid[1:] = np.asarray(raw, dtype=np.int64).astype(np.int8)
        return uid

    def _collective_comm(self) -> Any:
        if self._group is None:
            uid = self._new_uid() if self.rank == 0 else np.zeros(129, dtype=np.int8)
            self.comm.service.Bcast(uid, root=0)  # raw bytes over MPI
            self._group = self._make(self.size, self.rank, uid)
        return self._group

    def _pair_comm(self, peer: int) -> Any:
        found = self._pairs.get(peer)
        if found is not None:
            return found
        uid = np.zeros(129, dtype=np.int8)
        if self.rank < peer:
            uid = self._new_uid()
            self.comm.service.Send(uid, dest=peer, tag=tags.NCCL_UID)
        else:
            self.comm.service.Recv(uid, source=peer, tag=tags.NCCL_UID)
        found = self._pairs[peer] = self._make(2, int(self.rank > peer), uid)
        return found

    # ---- enqueueing ----------------------------------------------------------------------------

    def _stream(self, buf: Buffer) -> Any:
        from ..kernels.device import current_stream, external_stream

        return external_stream(current_stream(buf), self._device)

    def _run(
        self,
        op: str,
        seq: int,
        buf: Buffer,
        nbytes: int,
        body: Callable[[Any, int], tuple[Any, ...]],
    ) -> Work:
        """Enqueue `body(stream_object, stream_ptr)` on the array's stream; the Work completes
        when an event recorded after it has passed."""
        self._bind(buf, op)
        cupy = self.cupy
        with cupy.cuda.Device(self._device):
            stream = self._stream(buf)
            keep = body(stream, stream.ptr)
            event = cupy.cuda.Event(disable_timing=True)
            event.record(stream)
        pending = _Pending(event, keep)
        comms = [self._group, *self._pairs.values()]

        def poll() -> bool:
            if not pending.event.done:
                for c in comms:
                    if c is not None:
                        c.check_async_error()
                return False
            pending.keep = ()
            return True

        work = Work(self.comm, op, seq, poll)
        work.info = {"transport": self.name, "bytes": nbytes}
        return work

    def _typed(
        self, buf: Buffer, op: ReduceOp | None, stream: Any
    ) -> tuple[int, int, int, Callable[[], None] | None, tuple[Any, ...]]:
        """(pointer, count, nccl type, write-back, keep) for `buf`; int16 widens to int32 around
        a reduction (exact: wrap-around sums and products agree modulo 2^16) and moves as bytes
        otherwise, since NCCL has no 16-bit integer type."""
        if buf.dtype != "int16":
            return buf.ptr, buf.count, _TYPES[buf.dtype], None, ()
        if op is None:
            return buf.ptr, buf.nbytes, _UINT8, None, ()
        cupy = self.cupy
        with stream:
            wide = _int16_view(cupy, buf, self._device).astype(cupy.int32)
        return (
            int(wide.data.ptr),
            buf.count,
            _TYPES["int32"],
            lambda: _narrow_into(cupy, wide, buf, stream, self._device),
            (wide,),
        )

    def _average(self, buf: Buffer, stream: Any) -> None:
        from ..kernels.device import divide_on

        divide_on(stream, buf.ptr, buf.count, self.size, buf.dtype)

    @staticmethod
    def _op(buf: Buffer, op: ReduceOp) -> int:
        return _BOOL_OPS[op] if buf.dtype == "bool" else _OPS[op]

    # ---- operations ----------------------------------------------------------------------------

    def all_reduce(self, x: Buffer, out: Buffer, op: ReduceOp, seq: int) -> Work:
        """ncclAllReduce on the array's current stream (AVG divides after)."""
        self._bind(x, "all_reduce")
        nc = self._collective_comm()

        def body(stream: Any, sp: int) -> tuple[Any, ...]:
            if x.dtype == "int16":  # widen x, reduce in place, narrow into out
                src, count, dt, _, keep = self._typed(x, op, stream)
                nc.allReduce(src, src, count, dt, _OPS[op], sp)
                _narrow_into(self.cupy, keep[0], out, stream, self._device)
            else:
                nc.allReduce(x.ptr, out.ptr, x.count, _TYPES[x.dtype], self._op(x, op), sp)
                keep = ()
            if op is ReduceOp.AVG:
                self._average(out, stream)
            return keep

        return self._run("all_reduce", seq, x, x.nbytes, body)

    def reduce(self, x: Buffer, op: ReduceOp, root: int, seq: int) -> Work:
        """ncclReduce on the array's current stream (AVG divides after)."""
        self._bind(x, "reduce")
        nc = self._collective_comm()

        def body(stream: Any, sp: int) -> tuple[Any, ...]:
            ptr, count, dt, back, keep = self._typed(x, op, stream)
            rop = _OPS[op] if x.dtype == "int16" else self._op(x, op)
            nc.reduce(ptr, ptr, count, dt, rop, root, sp)
            if self.rank == root:
                if back is not None:
                    back()
                if op is ReduceOp.AVG:
                    self._average(x, stream)
            return keep

        return self._run("reduce", seq, x, x.nbytes, body)

    def broadcast(self, x: Buffer, root: int, seq: int) -> Work:
        """ncclBroadcast on the array's current stream."""
        self._bind(x, "broadcast")
        nc = self._collective_comm()

        def body(stream: Any, sp: int) -> tuple[Any, ...]:
            ptr, count, dt, _, keep = self._typed(x, None, stream)
            nc.broadcast(ptr, ptr, count, dt, root, sp)
            return keep

        return self._run("broadcast", seq, x, x.nbytes, body)

    def all_gather(self, out: Buffer, x: Buffer, seq: int) -> Work:
        """ncclAllGather on the array's current stream."""
        self._bind(x, "all_gather")
        nc = self._collective_comm()

        def body(stream: Any, sp: int) -> tuple[Any, ...]:
            _, count, dt, _, keep = self._typed(x, None, stream)
            nc.allGather(x.ptr, out.ptr, count, dt, sp)
            return keep

        return self._run("all_gather", seq, x, out.nbytes, body)

    def reduce_scatter(self, out: Buffer, x: Buffer, op: ReduceOp, seq: int) -> Work:
        """ncclReduceScatter on the array's current stream (AVG divides after)."""
        self._bind(x, "reduce_scatter")
        nc = self._collective_comm()

        def body(stream: Any, sp: int) -> tuple[Any, ...]:
            if x.dtype == "int16":
                src, _, dt, _, keep = self._typed(x, op, stream)
                wide_out = self.cupy.empty(out.count, self.cupy.int32)
                nc.reduceScatter(src, int(wide_out.data.ptr), out.count, dt, _OPS[op], sp)
                _narrow_into(self.cupy, wide_out, out, stream, self._device)
                keep = (*keep, wide_out)
            else:
                nc.reduceScatter(x.ptr, out.ptr, out.count, _TYPES[x.dtype], self._op(x, op), sp)
                keep = ()
            if op is ReduceOp.AVG:
                self._average(out, stream)
            return keep

        return self._run("reduce_scatter", seq, x, x.nbytes, body)

    def all_to_all(self, out: Buffer, x: Buffer, seq: int) -> Work:
        """One ncclSend and ncclRecv per peer in one NCCL group call."""
        self._bind(x, "all_to_all")
        nc, nccl = self._collective_comm(), self.nccl
        block = x.nbytes // self.size

        def body(stream: Any, sp: int) -> tuple[Any, ...]:
            nccl.groupStart()
            try:
                for peer in range(self.size):
                    nc.send(x.ptr + peer * block, block, _UINT8, peer, sp)
                    nc.recv(out.ptr + peer * block, block, _UINT8, peer, sp)
            finally:
                nccl.groupEnd()
            return ()

        return self._run("all_to_all", seq, x, x.nbytes, body)

    def send(self, x: Buffer, dst: int, tag: int, seq: int) -> Work:
        """ncclSend on the NCCL communicator of this pair of ranks."""
        return self._p2p("send", x, dst, seq)

    def recv(self, x: Buffer, src: int, tag: int, seq: int) -> Work:
        """ncclRecv on the NCCL communicator of this pair of ranks."""
        return self._p2p("recv", x, src, seq)

    def _p2p(self, op: str, x: Buffer, peer: int, seq: int) -> Work:
        if peer == self.rank:
            raise InvalidArgument(
                f"{op}: rank {peer} is this rank; NCCL has no send to self outside a group call"
            )
        self._bind(x, op)
        pc = self._pair_comm(peer)
        other = 1 if self.rank < peer else 0

        def body(stream: Any, sp: int) -> tuple[Any, ...]:
            if op == "send":
                pc.send(x.ptr, x.nbytes, _UINT8, other, sp)
            else:
                pc.recv(x.ptr, x.nbytes, _UINT8, other, sp)
            return ()

        return self._run(op, seq, x, x.nbytes, body)

    def barrier(self, seq: int) -> Work:
        """A one-element ncclAllReduce on the current stream; complete once it has run."""
        cupy = self.cupy
        if self._device is None:
            self._device = cupy.cuda.Device().id
        nc = self._collective_comm()
        with cupy.cuda.Device(self._device):
            if self._scratch is None:
                self._scratch = cupy.zeros(1, cupy.int32)
            stream = cupy.cuda.get_current_stream()
            nc.allReduce(
                self._scratch.data.ptr, self._scratch.data.ptr, 1, _TYPES["int32"], _SUM, stream.ptr
            )
            event = cupy.cuda.Event(disable_timing=True)
            event.record(stream)
        return Work(self.comm, "barrier", seq, lambda: bool(event.done))

    def close(self) -> None:
        """Destroy the NCCL communicators (abort them when the group was aborted)."""
        aborted = self.comm._aborted is not None
        for c in [self._group, *self._pairs.values()]:
            if c is None:
                continue
            # a failed teardown must not hide the error that ended the communicator
            with contextlib.suppress(Exception):
                _end(c, abort=aborted)
        self._group = None
        self._pairs.clear()


def _int16_view(cupy: Any, buf: Buffer, device: int | None) -> Any:
    """A cupy int16 array over `buf`'s memory (which the caller's array keeps alive)."""
    mem = cupy.cuda.UnownedMemory(buf.ptr, buf.nbytes, buf.obj, device)
    return cupy.ndarray((buf.count,), cupy.int16, cupy.cuda.MemoryPointer(mem, 0))


def _narrow_into(cupy: Any, wide: Any, out: Buffer, stream: Any, device: int | None) -> None:
    """`out` = `wide` (int32) narrowed to int16, queued on `stream`."""
    with stream:
        _int16_view(cupy, out, device)[...] = wide.astype(cupy.int16)
