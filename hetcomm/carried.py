"""Small broadcasts and reduces carried in the default check's shared records.

Where every rank of a communicator is on one host, the check goes through a shared segment
(hetcomm.agree.SharedCheck): each rank writes its signature into its own record and waits until
every rank has. That is a synchronisation of every rank, which a broadcast's or a reduce's own
messages would only follow (the root sends once the others are known to agree). So a blocking
one of at most `agree.SharedRecords.PAYLOAD` bytes of host memory carries its data in the
records instead: the root's input for a broadcast, every rank's for a reduce, which the root
reduces in rank order with one kernel call (`kernels.reduce.reduce_rows`, as hostcoll's
reductions go). Each record's flag word says whether its rank takes this path; where one does
not (an asynchronous call, a timeout of its own, device memory, tracing), every rank reads so
and runs the operation through its transport, as it would have.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
from mpi4py import MPI

from . import agree
from .ops import ReduceOp

if TYPE_CHECKING:
    from .arrays import Buffer
    from .comm import Communicator
    from .routes import Route

OPS = frozenset(("broadcast", "reduce"))
_reduce_rows: Callable[[np.ndarray, np.ndarray, str], None] | None = None  # kernels.reduce's


def applies(op: str, xb: Buffer | None) -> bool:
    """Whether blocking calls of `op` on `xb` ride in the records (where the check has them)."""
    return (
        op in OPS
        and xb is not None
        and not xb.on_device
        # nothing to carry: an empty 2-D array has no byte view to copy by
        and 0 < xb.nbytes <= agree.SharedRecords.PAYLOAD
        # host bfloat16 arrays have no buffer format to copy by; a reduce of halves rounds at
        # each step, which reduce_rows does not
        and xb.dtype not in (("float16", "bfloat16") if op == "reduce" else ("bfloat16",))
    )


def run(comm: Communicator, route: Route, xh: np.ndarray, timeout: float | None) -> bool:
    """The blocking call of `route` on host array `xh` through the records, entered here
    (within `timeout`, None: the configured one); or, where some rank does not take this path,
    the transport's prepared call (False where it has none: the general path then runs the
    call with the sequence number entered here)."""
    if timeout is not None:
        return bool(comm._timed(timeout, route.op, run, comm, route, xh, None))
    comm._last_entered = seq = comm._arrive(route)
    if comm._deferred.queue:
        comm._flush_deferred(route.op, seq, comm.call_timeout)
    root = route.root
    # a broadcast's data comes from the root; a reduce's from every rank
    carries = route.op == "reduce" or comm.rank == root
    check = comm._check_blocking(route, seq, comm.call_timeout, xh if carries else False)
    assert isinstance(check, agree.SharedCheck)
    if not check.carried():
        prepared = route.run
        if prepared is None:
            return False
        route.runs += 1
        try:
            return prepared(xh, seq)
        except MPI.Exception as exc:
            raise comm._mpi_error(route.op, seq, exc) from exc
    route.runs += 1
    route.carried += 1
    if route.op == "broadcast":
        if not carries:
            xh.data.cast("B")[:] = check.payload(root, xh.nbytes)
    elif comm.rank == root:
        _reduce(comm.size, route, check, xh)
    return True


def _reduce(size: int, route: Route, check: agree.SharedCheck, xh: np.ndarray) -> None:
    """The root's part of a carried reduce: every rank's input (the root's own included:
    every rank carries it) reduced in rank order into `xh`."""
    global _reduce_rows
    if _reduce_rows is None:  # numba's import waits for the first carried reduce
        from .kernels.reduce import reduce_rows

        _reduce_rows = reduce_rows
    flat, rop = xh if xh.ndim == 1 else xh.reshape(-1), route.rop
    assert rop is not None and route.dtype is not None
    _reduce_rows(
        check.rows(flat.dtype, flat.size), flat, "sum" if rop is ReduceOp.AVG else rop.value
    )
    if rop is ReduceOp.AVG:
        from .transports.local import divide_host

        divide_host(flat, size, route.dtype)
