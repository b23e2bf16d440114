"""Small collectives carried in the default check's shared records.

Where every rank of a communicator is on one host, the check goes through a shared segment
(hetcomm.agree.SharedCheck): each rank writes its signature into its own record and waits until
every rank has. That is a synchronisation of every rank, which the operation's own messages
would only follow. So a collective of at most `agree.SharedRecords.PAYLOAD` bytes of host
input carries its data in the records instead, and the check is the whole operation: the
root's input for a broadcast, every rank's input for the others. Once every record holds the
collective, each rank lands what it needs from the records: a broadcast copies the root's
bytes, a reduce (at the root), an all_reduce and a reduce_scatter (this rank's block) reduce
the ranks' rows in rank order with one kernel call (`kernels.reduce.reduce_rows`, as hostcoll's
reductions go, so every rank of an all_reduce gets the same bits), an all_gather and an
all_to_all copy rows or blocks of rows. Every rank's input is in the records before any output
is written, so in-place forms need nothing of their own. Each record's flag word says whether
its rank takes this path; where one does not (device memory, tracing, a layout the prepared
call cannot take) every rank reads so and runs the operation through its transport, as it
would have.

A blocking call lands as soon as its check completes (`run`). An asynchronous one writes its
record and returns; once its check has completed it lands where its deferred start would have
started the transport's operation (`begin`), on the thread that saw the check complete: the
call itself where the other ranks were there already, else whichever thread next drives the
communicator's deferred starts (a wait, the next collective, the starter thread). A carried
collective's records count as read only once it has landed, and a rank writes a record in which
it carried data again only once it has landed that (agree.SharedCheck).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
from mpi4py import MPI

from . import agree
from .arrays import may_share_memory
from .ops import ReduceOp
from .work import completed

if TYPE_CHECKING:
    from .arrays import Buffer
    from .comm import Communicator
    from .routes import Route
    from .work import Context, Work

# what each op's rank carries: the root's input (broadcast), or every rank's (the others)
OPS = frozenset(("broadcast", "reduce", "all_reduce", "all_gather", "reduce_scatter", "all_to_all"))
_REDUCING = frozenset(("reduce", "all_reduce", "reduce_scatter"))


def applies(op: str, xb: Buffer | None) -> bool:
    """Whether blocking calls of `op` with input `xb` ride in the records (where the check has
    them)."""
    return (
        op in OPS
        and xb is not None
        and not xb.on_device
        # nothing to carry: an empty 2-D array has no byte view to copy by
        and 0 < xb.nbytes <= agree.SharedRecords.PAYLOAD
        # host bfloat16 arrays have no buffer format to copy by; a reduction of halves rounds
        # at each step, which reduce_rows does not
        and xb.dtype not in (("float16", "bfloat16") if op in _REDUCING else ("bfloat16",))
    )


def lander(op: str, rop: ReduceOp | None, dtype: str, rank: int, size: int, root: int) -> Land:
    """What this rank makes of the records of one route's carried calls, once every rank's
    input is there: `land(check, xh, oh)`, with what the signature fixes (the reduction's
    kernel, this rank's block) worked out here, once."""
    if op == "broadcast":
        return _nothing if rank == root else _copy_root(root)
    if op == "all_gather":
        return _all_gather(size)
    if op == "all_to_all":
        return _all_to_all(rank, size)
    assert rop is not None
    from .kernels.reduce import rows_reducer  # numba's import waits for a carried reduction

    reducer = rows_reducer("sum" if rop is ReduceOp.AVG else rop.value)
    divide = _divide(size, dtype) if rop is ReduceOp.AVG else None
    if op == "reduce":
        return _reduce_rows(reducer, divide, False) if rank == root else _nothing
    if op == "all_reduce":
        return _reduce_rows(reducer, divide, True)
    return _reduce_blocks(reducer, divide, rank, size)  # reduce_scatter


def run(
    comm: Communicator,
    route: Route,
    xh: np.ndarray,
    timeout: float | None,
    oh: np.ndarray | None = None,
) -> bool:
    """The blocking call of `route` on host array `xh` (its input; for all_reduce,
    all_gather, reduce_scatter and all_to_all `oh` is the output) through the records, entered
    here (within `timeout`, None: the configured one); or, where some rank does not take this
    path, the transport's prepared call (False where it has none or cannot take these arrays:
    the general path then runs the call with the sequence number entered here)."""
    if timeout is not None:
        return bool(comm._timed(timeout, route.op, run, comm, route, xh, None, oh))
    comm._last_entered = seq = comm._arrive(route)
    if comm._deferred.queue:
        comm._flush_deferred(route.op, seq, comm.call_timeout)
    check = comm._check_blocking(route, seq, comm.call_timeout, carry(comm.rank, route, xh))
    assert isinstance(check, agree.SharedCheck)
    if not check.carried():
        return _transport(comm, route, xh, oh, seq)
    route.runs += 1
    _land(route, check, xh, oh)
    return True


def _land(route: Route, check: agree.SharedCheck, xh: np.ndarray, oh: np.ndarray | None) -> None:
    """Land a carried call of `route` from the records of its completed `check`."""
    route.carried += 1
    land = route.land
    assert land is not None
    try:
        land(check, xh, oh)
    finally:
        check.landed()


def carry(rank: int, route: Route, xh: np.ndarray) -> np.ndarray | bool:
    """What rank `rank`'s record carries in a carried call of `route` on input `xh`: the
    root's input for a broadcast (False elsewhere: it takes the path with no data), every
    rank's for the others."""
    return xh if route.op != "broadcast" or rank == route.root else False


def begin(
    comm: Context,
    route: Route,
    check: agree.SharedCheck,
    start: Callable[[int], Work],
    xh: np.ndarray,
    oh: np.ndarray | None,
    seq: int,
) -> Work:
    """The start of an asynchronous call of `route` whose check (started with `carry`'s data)
    has completed and agreed: where every rank took the carried path, it lands here from the
    records and its Work is complete; else the transport's start (`start(seq)`: the prepared
    one, or the general path's), as every other rank then starts it."""
    if not check.carried():
        return start(seq)
    _land(route, check, xh, oh)
    return completed(comm, route.op, seq)


def _transport(
    comm: Communicator, route: Route, xh: np.ndarray, oh: np.ndarray | None, seq: int
) -> bool:
    """Some rank did not take the carried path: the transport's prepared call, where it has
    one that takes these arrays (an output overlapping the input only where it says so)."""
    prepared = route.run
    if prepared is None:
        return False
    if oh is None:
        arrays: tuple[np.ndarray, ...] = (xh,)
    elif oh is xh or getattr(prepared, "in_place", False) or not may_share_memory(xh, oh):
        arrays = (xh, oh)
    else:
        return False
    route.runs += 1
    try:
        return prepared(*arrays, seq)
    except MPI.Exception as exc:
        raise comm._mpi_error(route.op, seq, exc) from exc


# ---- landers (see lander) ----------------------------------------------------------------------

Land = Callable[[agree.SharedCheck, np.ndarray, "np.ndarray | None"], None]
Reducer = Callable[[np.ndarray, np.ndarray], None]


def _nothing(check: agree.SharedCheck, xh: np.ndarray, oh: np.ndarray | None) -> None:
    """A rank whose arrays the operation leaves as they are (a broadcast's or reduce's root
    and non-root respectively)."""


def _copy_root(root: int) -> Land:
    def land(check: agree.SharedCheck, xh: np.ndarray, oh: np.ndarray | None) -> None:
        xh.data.cast("B")[:] = check.payload(root, xh.nbytes)

    return land


def _divide(size: int, dtype: str) -> Callable[[np.ndarray], None]:
    from .transports.local import divide_host

    return lambda flat: divide_host(flat, size, dtype)


def _reduce_rows(
    reducer: Reducer, divide: Callable[[np.ndarray], None] | None, into_out: bool
) -> Land:
    """Every rank's input reduced in rank order into `oh` (all_reduce) or `xh` (reduce)."""

    def land(check: agree.SharedCheck, xh: np.ndarray, oh: np.ndarray | None) -> None:
        dst = oh if into_out else xh
        assert dst is not None
        flat = dst if dst.ndim == 1 else dst.reshape(-1)
        reducer(check.rows(xh.dtype, xh.size), flat)
        if divide is not None:
            divide(flat)

    return land


def _reduce_blocks(
    reducer: Reducer, divide: Callable[[np.ndarray], None] | None, rank: int, size: int
) -> Land:
    """Block `rank` of every rank's input reduced in rank order into `oh` (reduce_scatter)."""

    def land(check: agree.SharedCheck, xh: np.ndarray, oh: np.ndarray | None) -> None:
        assert oh is not None
        flat = oh if oh.ndim == 1 else oh.reshape(-1)
        reducer(_own_blocks(check, xh, rank, size), flat)
        if divide is not None:
            divide(flat)

    return land


def _all_gather(size: int) -> Land:
    def land(check: agree.SharedCheck, xh: np.ndarray, oh: np.ndarray | None) -> None:
        assert oh is not None
        oh.reshape(size, xh.size)[...] = check.rows(xh.dtype, xh.size)

    return land


def _all_to_all(rank: int, size: int) -> Land:
    def land(check: agree.SharedCheck, xh: np.ndarray, oh: np.ndarray | None) -> None:
        assert oh is not None
        oh.reshape(size, -1)[...] = _own_blocks(check, xh, rank, size)

    return land


def _own_blocks(check: agree.SharedCheck, xh: np.ndarray, rank: int, size: int) -> np.ndarray:
    """Block `rank` (of `size`) of every rank's carried input, one row per rank."""
    block = xh.size // size
    return check.block(xh.dtype, xh.size, rank * block, rank * block + block)
