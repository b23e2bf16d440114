"""The direct transport's prepared collectives (hetcomm.routes.Route.run): a blocking
collective of device arrays of one signature, its steps run start to end on the calling thread
while the proxy is idle, with no Buffer, Task or Work per call.

The steps are the proxy's own (DirectTransport.steps): the same messages under the same tags,
so that ranks may take either path at any call (an asynchronous call, or one behind it, takes
the proxy's). What differs is where they run: the GPU work goes on the caller's stream
(ordered after what the caller queued there, with no event between two streams), and every
wait is a poll on the calling thread, bounded by the call's timeout.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Protocol

from mpi4py import MPI

from . import schedule
from .proxy import Mark, Step

if TYPE_CHECKING:
    from ...arrays import Buffer
    from ...ops import ReduceOp
    from .prepared import PreparedP2P
    from .transport import DirectTransport

# the collectives prepared here, and whether they take an output besides x
OPS = {
    "all_reduce": True,
    "reduce_scatter": True,
    "all_gather": True,
    "all_to_all": True,
    "reduce": False,
    "broadcast": False,
}


class Span(Protocol):
    """What a collective's steps read of an array: a Buffer, or a prepared call's Placed."""

    @property
    def ptr(self) -> int:
        """The device address."""

    @property
    def nbytes(self) -> int:
        """Bytes."""

    @property
    def count(self) -> int:
        """Elements."""

    @property
    def dtype(self) -> str:
        """The dtype's name."""

    @property
    def itemsize(self) -> int:
        """Bytes per element."""


class Placed:
    """An array of a prepared call's signature (`like`) at this call's address."""

    __slots__ = ("count", "dtype", "itemsize", "nbytes", "ptr")

    def __init__(self, ptr: int, like: Span) -> None:
        self.ptr = ptr
        self.nbytes, self.count, self.dtype, self.itemsize = (
            like.nbytes,
            like.count,
            like.dtype,
            like.itemsize,
        )


class PreparedCollectives:
    """The prepared blocking collectives of one DirectTransport."""

    def __init__(self, t: DirectTransport, p2p: PreparedP2P) -> None:
        self.t, self.p2p = t, p2p
        self.ran = 0  # calls made

    def prepare(
        self, op: str, x: Buffer | None, out: Buffer | None, rop: ReduceOp | None, root: int
    ) -> Callable[..., bool] | None:
        """The prepared call of `op` on device arrays of this signature: `run(xptr, [optr,]
        seq)` (routes.device_view's addresses; rooted ops take one). None where the proxy's
        path takes every call: host or empty arrays, another device, arrays of two
        libraries, array types whose current stream is not known here."""
        from ...kernels.device import stream_reader

        t = self.t
        two = OPS.get(op)
        if two is None or x is None or not x.on_device or not x.count:
            return None
        if out is None and op == "all_reduce":
            out = x  # in place: the call gives x twice
        if x.device_index != t.device:
            return None
        if two and (out is None or not out.on_device or not out.count or out.kind != x.kind):
            return None
        if two and out is not None and out.device_index != t.device:
            return None
        stream = stream_reader(x.kind, x.device_index)
        if stream is None:
            return None
        if rop is not None:
            t._prepare(x.dtype, rop)
        like_out = Placed(0, out) if two and out is not None else None
        reads_first = t.stages_input(op, x.nbytes)
        run = partial(self._run, op, rop, root, Placed(0, x), like_out, reads_first, stream)
        run.in_place = True  # type: ignore[attr-defined]  # tells overlaps apart (schedule.served)
        return run

    def _run(
        self,
        op: str,
        rop: ReduceOp | None,
        root: int,
        like_x: Placed,
        like_out: Placed | None,
        reads_first: bool,
        stream: Callable[[], int],
        *args: int,
    ) -> bool:
        """One call (`args`: x's address, out's for two-array ops, the sequence number): False
        (nothing moved) where the general path must take it: overlaps it does not serve,
        another device current on this thread, or the proxy busy with operations issued before
        (they go first, in issue order)."""
        t = self.t
        seq = args[-1]
        x, out = Placed(args[0], like_x), None
        if like_out is not None:
            out = Placed(args[1], like_out)
            if not schedule.served(op, x.ptr, x.nbytes, out.ptr, out.nbytes, t.rank, reads_first):
                return False
        if self.p2p.rt.getDevice() != t.device:
            return False
        proxy = t._proxy
        if not proxy.claim():
            return False
        self.ran += 1
        try:
            s = t.device_kernels.external_stream(stream(), t.device)
            if not (s.done or t.size == 1 or (t.shared and t.rank == 0)):
                # other ranks read and write our arrays once they have our records: what our
                # stream was given before the call runs first (rank 0 of a shared GPU queues
                # all its work on this stream itself)
                self.p2p.reach(s, op, seq)
            t.stream = s
            try:
                steps, _ = t.steps(op, seq, x, out, rop, root)
                self._drive(steps(), op, seq)
            finally:
                t.stream = proxy.stream
        finally:
            proxy.release()
        return True

    def _drive(self, steps: Step, op: str, seq: int) -> None:
        """Run `steps` here, polling each wait: an MPI request or a list of them, a mark on
        the stream (the caller's), an event."""
        wait = self.p2p.wait
        for w in steps:
            if w is None:
                continue
            if w.__class__ is Mark:
                wait(partial(getattr, w.event, "done"), op, seq)
            elif w.__class__ is list:
                wait(partial(MPI.Request.Testall, w), op, seq)
            elif isinstance(w, MPI.Request):
                wait(w.Test, op, seq)
            else:
                wait(partial(getattr, w, "done"), op, seq)
