"""The direct transport's collectives through the shared GPU's leader: what rank 0 queues on
the GPU for every rank sharing it (`launcher`), and the prepared blocking call of one signature
(`PreparedLeader`, hetcomm.routes.Route.run), run start to end on the calling thread while the
proxy is idle, with no Buffer, Task or Work per call.

A prepared call exchanges the messages of DirectTransport._leader_op under the same tags and in
the same order (each other rank's records to rank 0 once its stream is ready, rank 0's "done"
to each once the GPU work has run), so that ranks may take either path at any call. What
differs is where the work runs: rank 0 queues it on its caller's stream (ordered after what the
caller queued there, with no event between two streams), a buffer's record is made once per
address and allocation, and every wait is a poll on the calling thread, bounded by the call's
timeout.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
from mpi4py import MPI

from ...ops import ReduceOp
from . import schedule
from .peer import RECORD

if TYPE_CHECKING:
    from ...arrays import Buffer
    from .prepared import PreparedP2P
    from .transport import DirectTransport

# rank 0's GPU work of one collective: launch(table, x's address, out's address) queues it on
# the transport's current stream and returns what it reads that must outlive it (or None)
Launch = Callable[[np.ndarray, int, int], Any]

# the collectives the leader does for the ranks sharing its GPU, and the columns of their
# records (x; x and out)
COLUMNS = {
    "all_reduce": 2,
    "reduce_scatter": 2,
    "all_gather": 2,
    "all_to_all": 2,
    "reduce": 1,
    "broadcast": 1,
}


def launcher(
    t: DirectTransport, op: str, x: Buffer, out: Buffer | None, rop: ReduceOp | None, root: int
) -> Launch:
    """Rank 0's GPU work of `op` on arrays of the signature of `x` and `out` (their addresses
    are the call's), each rank's addresses from the records in `table` (rank 0's own: the
    addresses given)."""
    count, dtype, nbytes = x.count, x.dtype, x.nbytes
    if op == "all_reduce":
        assert rop is not None

        def all_reduce(table: np.ndarray, xp: int, op_: int) -> None:
            t._reduce_all(
                t._addresses(table, 1, op_), t._addresses(table, 0, xp), count, dtype, rop
            )

        return all_reduce
    if op == "reduce_scatter":
        assert rop is not None and out is not None
        block, n = out.nbytes, out.count

        def reduce_scatter(table: np.ndarray, xp: int, op_: int) -> None:
            xs = t._addresses(table, 0, xp)
            for r, dst in enumerate(t._addresses(table, 1, op_)):
                t._reduce(dst, [p + r * block for p in xs], n, dtype, rop)
                if rop is ReduceOp.AVG:
                    t._average(dst, n, dtype)

        return reduce_scatter
    if op == "reduce":
        assert rop is not None

        def reduce(table: np.ndarray, xp: int, _: int) -> None:
            xs = t._addresses(table, 0, xp)
            t._reduce(xs[root], xs, count, dtype, rop)
            if rop is ReduceOp.AVG:
                t._average(xs[root], count, dtype)

        return reduce
    if op == "broadcast":

        def broadcast(table: np.ndarray, xp: int, _: int) -> None:
            xs = t._addresses(table, 0, xp)
            for dst in xs:
                t._copy(dst, xs[root], nbytes)

        return broadcast
    if op == "all_gather":

        def all_gather(table: np.ndarray, xp: int, op_: int) -> None:
            # in place, a rank's x is its own block of out: that copy is skipped (_copy)
            xs = t._addresses(table, 0, xp)
            for dst in t._addresses(table, 1, op_):
                for p, src in enumerate(xs):
                    t._copy(dst + p * nbytes, src, nbytes)

        return all_gather
    if op == "all_to_all":
        assert out is not None
        block, size, onbytes = nbytes // t.size, t.size, out.nbytes

        def all_to_all(table: np.ndarray, xp: int, op_: int) -> Any:
            xs = t._addresses(table, 0, xp)
            outs = t._addresses(table, 1, op_)
            staged = None
            if any(o < a + nbytes and a < o + onbytes for a, o in zip(xs, outs)):
                # a rank's out overlaps its x (in place, which the communicator passes as it
                # is: stages_input): every x is read into scratch before any out is written,
                # all on one stream
                staged = t.cupy.cuda.alloc(size * nbytes)
                for p, src in enumerate(xs):
                    t._copy(staged.ptr + p * nbytes, src, nbytes)
                xs = [staged.ptr + p * nbytes for p in range(size)]
            for r, dst in enumerate(outs):
                for p, src in enumerate(xs):
                    t._copy(dst + p * block, src + r * block, block)
            return staged  # kept until the stream has run the copies

        return all_to_all
    raise ValueError(f"launcher: {op} is not a collective of the leader")


class PreparedLeader:
    """The prepared blocking collectives of one DirectTransport whose ranks share one GPU."""

    def __init__(self, t: DirectTransport, p2p: PreparedP2P) -> None:
        self.t, self.p2p = t, p2p
        self.svc: MPI.Intracomm = t.svc
        self._tables: dict[int, np.ndarray] = {}  # rank 0: the records received, per columns
        self._done = np.zeros(1, np.int8)  # another rank: rank 0's "done" lands here
        self.ran = 0  # calls made

    def prepare(
        self, op: str, x: Buffer | None, out: Buffer | None, rop: ReduceOp | None, root: int
    ) -> Callable[..., bool] | None:
        """The prepared call of `op` on device arrays of this signature: `run(xptr, [optr,]
        seq)` (routes.device_view's addresses; rooted ops take one). None where the proxy's
        path takes every call: host or empty arrays, another device, arrays of two libraries,
        array types whose current stream is not known here."""
        from ...kernels.device import stream_reader

        t = self.t
        cols = COLUMNS.get(op)
        if cols is None or x is None or not x.on_device or not x.count:
            return None
        if x.device_index != t.device:
            return None
        if cols == 2:
            if out is None or not out.on_device or not out.count or out.kind != x.kind:
                return None
            if out.device_index != t.device:
                return None
        stream = stream_reader(x.kind, x.device_index)
        if stream is None:
            return None
        if rop is not None:
            t._prepare(x.dtype, rop)
        launch = launcher(t, op, x, out, rop, root)
        nx = x.nbytes
        no = out.nbytes if out is not None else nx
        run = partial(self._run, op, launch, cols, nx, no, stream)
        run.in_place = True  # type: ignore[attr-defined]  # it tells overlaps apart (schedule.served)
        return run

    def _run(
        self,
        op: str,
        launch: Launch,
        cols: int,
        nx: int,
        no: int,
        stream: Callable[[], int],
        *args: int,
    ) -> bool:
        """One call (`args`: x's address, out's for two-array ops, the sequence number): False
        (nothing moved) where the general path must take it: overlaps it does not serve,
        another device current on this thread, or the proxy busy with operations issued before
        (they go first, in issue order)."""
        t = self.t
        seq = args[-1]
        xp = args[0]
        op_ = args[1] if cols == 2 else xp
        if cols == 2 and not schedule.served(op, xp, nx, op_, no, t.rank):
            return False
        if self.p2p.rt.getDevice() != t.device:
            return False
        proxy = t._proxy
        if not proxy.claim():
            return False
        p2p, svc = self.p2p, self.svc
        t.led += 1
        self.ran += 1
        t_rec, t_done = t._lead_tags(seq)
        try:
            s = t.device_kernels.external_stream(stream(), t.device)
            if t.rank != 0:
                # rank 0 reads and writes our arrays once it has the records: what our stream
                # was given before the call runs first
                if not s.done:
                    p2p.reach(s, op, seq)
                rec = p2p.record(xp, nx)
                if cols == 2:
                    rec = np.concatenate((rec, p2p.record(op_, no)))
                reqs = [
                    svc.Isend(rec.view(np.uint8), 0, t_rec),
                    svc.Irecv(self._done, 0, t_done),
                ]
                p2p.wait(partial(MPI.Request.Testall, reqs), op, seq)
                return True
            table = self._tables.get(cols)
            if table is None:
                table = self._tables[cols] = np.zeros((t.size, cols), RECORD)
            arrived = [svc.Irecv(table[p].view(np.uint8), p, t_rec) for p in t._others]
            p2p.wait(partial(MPI.Request.Testall, arrived), op, seq)
            t.stream = s
            try:
                held = launch(table, xp, op_)
            finally:
                t.stream = proxy.stream
            p2p.reach(s, op, seq)  # the others' arrays are free once the work has run
            del held
            done = t._done_flag
            sent = [svc.Isend(done, p, t_done) for p in t._others]
            p2p.wait(partial(MPI.Request.Testall, sent), op, seq)
        finally:
            proxy.release()
        return True
