"""Which persistent collective serves a signature of the mpi transport (mpi/persistent.py's
`Recipe`): a choice of the signature, the configuration and the MPI library alone, so every
rank makes the same one, whatever its memory, layout or path."""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from ...ops import ReduceOp
from .datatypes import DATATYPES, PERSISTENT
from .persistent import Init, Recipe

_IN_PLACE = MPI.IN_PLACE
_SUM, _AVG = ReduceOp.SUM._value_, ReduceOp.AVG
# dtypes whose numpy storage is their bits (uint16), not their values: no scratch of theirs
_BITS = ("float16", "bfloat16")


def key(op: str, dtype: str | None, count: int, rop: ReduceOp | None, root: int) -> tuple | None:
    """What every rank agrees on of a collective (x's dtype and element count), as a recipe's
    key; None where no persistent request serves it: a reduction of a kind MPI does not reduce
    itself (hetcomm's own kernels do). AVG reduces as SUM (then divides), through SUM's
    request."""
    reduction = None if rop is None else rop._value_
    if reduction is not None and (dtype, reduction) not in PERSISTENT:
        return None
    if rop is _AVG:
        reduction = _SUM
    return (op, dtype, reduction, count, root)


def make(key: tuple, rank: int, size: int, limit: int) -> Recipe | None:
    """The recipe of `key` (see `key`) on rank `rank` of `size`: up to `limit` bytes (an
    all_gather's output, the others' input) of a dtype numpy and MPI both hold; the barrier
    always. None where no persistent request serves it."""
    op, dtype, reduction, count, root = key
    if op == "barrier":
        return Recipe(key, np.dtype(np.uint8), 0, None, _barrier)
    if dtype in _BITS:
        return None
    kind = PERSISTENT[(dtype, reduction)] if reduction is not None else None
    dt = DATATYPES[dtype] if kind is None else kind.datatype
    npdtype = np.dtype(dtype) if kind is None else kind.dtype
    nbytes = count * npdtype.itemsize * (size if op == "all_gather" else 1)
    if not 0 < nbytes <= limit:
        return None
    mop = MPI.OP_NULL if kind is None else kind.op  # OP_NULL: nothing is reduced
    init = _init(op, dt, mop, root, rank == root)
    if init is None:
        return None
    # the elements of the result's own scratch (None: the result lands in the input's)
    out = {"all_gather": count * size, "reduce_scatter": count // size, "all_to_all": count}
    return Recipe(key, npdtype, count, out.get(op), init)


def _init(op: str, dt: MPI.Datatype, mop: MPI.Op, root: int, at_root: bool) -> Init | None:
    """How the request of `op` is made, bound to its scratch `s` (and result `o`)."""
    if op == "all_reduce":
        return lambda m, s, o: m.Allreduce_init(_IN_PLACE, (s, dt), mop)
    if op == "reduce" and at_root:
        return lambda m, s, o: m.Reduce_init(_IN_PLACE, (s, dt), mop, root)
    if op == "reduce":
        return lambda m, s, o: m.Reduce_init((s, dt), None, mop, root)
    if op == "broadcast":
        return lambda m, s, o: m.Bcast_init((s, dt), root)
    if op == "all_gather":
        return lambda m, s, o: m.Allgather_init((s, dt), (o, dt))
    if op == "reduce_scatter":
        return lambda m, s, o: m.Reduce_scatter_block_init((s, dt), (o, dt), mop)
    if op == "all_to_all":
        return lambda m, s, o: m.Alltoall_init((s, dt), (o, dt))
    return None


def _barrier(m: MPI.Intracomm, s: np.ndarray, o: np.ndarray) -> MPI.Prequest:
    return m.Barrier_init()
