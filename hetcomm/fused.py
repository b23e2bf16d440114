"""Small blocking collectives carried by the default check itself.

Where the check gathers (groups of up to agree.GATHER_RANKS ranks), every rank's block holds its
signature and agree.PAYLOAD bytes. A blocking collective whose input fits there packs it into its
block; once the gather has completed and every rank's signature is this rank's, each rank
computes its own result from the gathered inputs: one MPI call for the check and the operation
together, where checking apart costs two. Every rank combines the inputs in rank order with the
transports' own host kernels (transports/local.py: the bool rule, halves, AVG dividing once at
the end), so every rank gets the same bits. Nothing is written before the signatures agree: a
mismatch leaves every buffer as it was.

`plan` gives the pack and unpack steps of one route's signature, or None where the operation
does not fit (or has no data to carry: barrier; point to point has no check).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from .agree import PAYLOAD
from .ops import ReduceOp
from .transports.local import combine_host, divide_host

if TYPE_CHECKING:
    from .arrays import Buffer


class Fused:
    """The steps of one signature on this rank: `pack(payload, x)` (x's bytes into this
    rank's payload) before the check starts and `unpack(payloads, y)` (the result into y)
    once it has agreed; x and y are contiguous host arrays. `writes`: whether this rank's
    result goes anywhere (not at a broadcast's root, nor at a reduce's other ranks)."""

    __slots__ = ("pack", "unpack", "writes")

    def __init__(
        self,
        pack: Callable[[np.ndarray, np.ndarray], None],
        unpack: Callable[[np.ndarray, np.ndarray], None],
        writes: bool = True,
    ) -> None:
        self.pack, self.unpack, self.writes = pack, unpack, writes


def _bytes(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint8) if a.ndim == 1 else a.reshape(-1).view(np.uint8)


def _pack_x(payload: np.ndarray, x: np.ndarray) -> None:
    b = _bytes(x)
    payload[: b.size] = b


def _nothing(payload: np.ndarray, x: np.ndarray) -> None:
    pass


# numpy's own elementwise ufunc where it computes what the transports' kernels do (for bool:
# SUM/MAX are "or", PROD/MIN "and"; integers wrap); halves take the kernels (transports/local)
_UFUNCS = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,
    ReduceOp.PROD: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
}
_NUMPY_DTYPES = frozenset(
    ("bool", "int8", "int16", "int32", "int64", "uint8", "float32", "float64")
)


def _reducer(
    dtype: str, op: ReduceOp, size: int
) -> Callable[[np.ndarray, int, int, np.ndarray], None]:
    """reduce(payloads, start, stop, dst): dst's bytes = bytes [start, stop) of every rank's
    payload combined in rank order (AVG divided by the group's size)."""
    ufunc = _UFUNCS[op] if dtype in _NUMPY_DTYPES else None
    storage = np.dtype(dtype) if ufunc is not None else np.dtype(np.uint8)

    def reduce(payloads: np.ndarray, start: int, stop: int, dst: np.ndarray) -> None:
        rows = payloads[:, start:stop]
        acc = rows[0].copy()
        if ufunc is not None:
            values, typed = acc.view(storage), rows.view(storage)
            for r in range(1, size):
                ufunc(values, typed[r], out=values)
        else:
            for r in range(1, size):
                combine_host(acc, rows[r], dtype, op)
        if op is ReduceOp.AVG:
            divide_host(acc, size, dtype)
        dst[...] = acc

    return reduce


def plan(
    op: str,
    x: Buffer | None,
    out: Buffer | None,
    rop: ReduceOp | None,
    root: int,
    rank: int,
    size: int,
) -> Fused | None:
    """The pack and unpack steps of a collective of this signature, or None where its input
    does not fit the check's payload."""
    if x is None or x.nbytes > PAYLOAD or op not in _PLANS:
        return None
    return _PLANS[op](x, out, rop, root, rank, size)


def _all_reduce(
    x: Buffer, out: Buffer | None, rop: ReduceOp | None, root: int, rank: int, size: int
) -> Fused:
    assert rop is not None
    reduce, n = _reducer(x.dtype, rop, size), x.nbytes

    def unpack(payloads: np.ndarray, y: np.ndarray) -> None:
        reduce(payloads, 0, n, _bytes(y))

    return Fused(_pack_x, unpack)


def _reduce(
    x: Buffer, out: Buffer | None, rop: ReduceOp | None, root: int, rank: int, size: int
) -> Fused:
    assert rop is not None
    reduce, n = _reducer(x.dtype, rop, size), x.nbytes

    def unpack(payloads: np.ndarray, y: np.ndarray) -> None:
        reduce(payloads, 0, n, _bytes(y))

    return Fused(_pack_x, unpack, rank == root)


def _broadcast(
    x: Buffer, out: Buffer | None, rop: ReduceOp | None, root: int, rank: int, size: int
) -> Fused:
    n = x.nbytes

    def unpack(payloads: np.ndarray, y: np.ndarray) -> None:
        _bytes(y)[...] = payloads[root, :n]

    return Fused(_pack_x if rank == root else _nothing, unpack, rank != root)


def _all_gather(
    x: Buffer, out: Buffer | None, rop: ReduceOp | None, root: int, rank: int, size: int
) -> Fused:
    n = x.nbytes

    def unpack(payloads: np.ndarray, y: np.ndarray) -> None:
        _bytes(y).reshape(size, n)[...] = payloads[:, :n]

    return Fused(_pack_x, unpack)


def _reduce_scatter(
    x: Buffer, out: Buffer | None, rop: ReduceOp | None, root: int, rank: int, size: int
) -> Fused:
    assert rop is not None
    reduce, b = _reducer(x.dtype, rop, size), x.nbytes // size

    def unpack(payloads: np.ndarray, y: np.ndarray) -> None:
        reduce(payloads, rank * b, (rank + 1) * b, _bytes(y))

    return Fused(_pack_x, unpack)


def _all_to_all(
    x: Buffer, out: Buffer | None, rop: ReduceOp | None, root: int, rank: int, size: int
) -> Fused:
    b = x.nbytes // size

    def unpack(payloads: np.ndarray, y: np.ndarray) -> None:
        blocks = _bytes(y).reshape(size, b)
        blocks[...] = payloads[:, rank * b : (rank + 1) * b]

    return Fused(_pack_x, unpack)


_PLANS = {
    "all_reduce": _all_reduce,
    "reduce": _reduce,
    "broadcast": _broadcast,
    "all_gather": _all_gather,
    "reduce_scatter": _reduce_scatter,
    "all_to_all": _all_to_all,
}
