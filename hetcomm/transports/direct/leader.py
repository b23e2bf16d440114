"""What the shared GPU's leader (rank 0, DirectTransport._lead) queues on the GPU for every
rank sharing it, per collective: one pass of a reduction over every rank's input into every
rank's output, copies on one stream."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ...ops import ReduceOp

if TYPE_CHECKING:
    from .collectives import Span
    from .transport import DirectTransport

# rank 0's GPU work of one collective: launch(table of every rank's records) queues it on the
# transport's current stream and returns what it reads that must outlive it (or None)
Launch = Callable[[np.ndarray], Any]


def launcher(
    t: DirectTransport, op: str, x: Span, out: Span | None, rop: ReduceOp | None, root: int
) -> Launch:
    """Rank 0's GPU work of `op` on `x` and `out`, every other rank's addresses from its
    records in `table`."""
    count, dtype, nbytes = x.count, x.dtype, x.nbytes
    xp = x.ptr
    op_ = xp if out is None else out.ptr
    if op == "all_reduce":
        assert rop is not None

        def all_reduce(table: np.ndarray) -> None:
            t._reduce_all(
                t._addresses(table, 1, op_), t._addresses(table, 0, xp), count, dtype, rop
            )

        return all_reduce
    if op == "reduce_scatter":
        assert rop is not None and out is not None
        block, n = out.nbytes, out.count

        def reduce_scatter(table: np.ndarray) -> None:
            xs = t._addresses(table, 0, xp)
            for r, dst in enumerate(t._addresses(table, 1, op_)):
                t._reduce(dst, [p + r * block for p in xs], n, dtype, rop)
                if rop is ReduceOp.AVG:
                    t._average(dst, n, dtype)

        return reduce_scatter
    if op == "reduce":
        assert rop is not None

        def reduce(table: np.ndarray) -> None:
            xs = t._addresses(table, 0, xp)
            t._reduce(xs[root], xs, count, dtype, rop)
            if rop is ReduceOp.AVG:
                t._average(xs[root], count, dtype)

        return reduce
    if op == "broadcast":

        def broadcast(table: np.ndarray) -> None:
            xs = t._addresses(table, 0, xp)
            for dst in xs:
                t._copy(dst, xs[root], nbytes)

        return broadcast
    if op == "all_gather":

        def all_gather(table: np.ndarray) -> None:
            # in place, a rank's x is its own block of out: that copy is skipped (_copy)
            xs = t._addresses(table, 0, xp)
            for dst in t._addresses(table, 1, op_):
                for p, src in enumerate(xs):
                    t._copy(dst + p * nbytes, src, nbytes)

        return all_gather
    if op == "all_to_all":
        assert out is not None
        block, size, onbytes = nbytes // t.size, t.size, out.nbytes

        def all_to_all(table: np.ndarray) -> Any:
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
