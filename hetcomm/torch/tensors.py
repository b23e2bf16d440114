"""Arguments as torch passes them, and tensors as hetcomm moves and reduces them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..dtypes import DTYPES
from ..errors import DtypeError
from ..ops import ReduceOp
from .errors import ArgumentError

# the dtypes hetcomm knows (hetcomm.dtypes): it reduces these (and complex ones as real views)
# and moves the rest as bytes
_NATIVE = frozenset(DTYPES)

# the same as torch dtypes (a set lookup where a name would be built per call)
_NATIVE_DTYPES = frozenset(getattr(torch, name) for name in _NATIVE)
_MISSING = object()

# ---- arguments ----------------------------------------------------------------------------------


def _opt(opts: Any, name: str, default: Any = None) -> Any:
    """Field `name` of torch's options object; the convenience forms pass the value itself
    (`allreduce(t, op)`, `broadcast(t, root)`)."""
    value = getattr(opts, name, _MISSING)  # an options object (None and the rest have none)
    if value is not _MISSING:
        return value
    if name == "reduceOp" and default is None:
        default = dist.ReduceOp.SUM
    if opts is None or isinstance(opts, timedelta):
        return default
    is_rank = isinstance(opts, int) and not isinstance(opts, bool)
    if (name == "rootRank" and is_rank) or (name == "reduceOp" and not is_rank):
        return opts
    return default


def _listed(tensors: Any) -> Any:
    return [tensors] if isinstance(tensors, torch.Tensor) else tensors


def _nonempty(ts: Sequence[Any], what: str) -> None:
    if not ts:
        raise ArgumentError(f"hetcomm {what}: expected at least one tensor, got an empty list")


def _one(ts: Sequence[Any], what: str) -> Any:
    _nonempty(ts, what)
    if len(ts) != 1:
        raise ArgumentError(
            f"hetcomm {what}: expected one tensor (or list) per process, got "
            f"{len(ts)}; several per process is the multi-device API torch has "
            "deprecated"
        )
    return ts[0]


def _pairs(outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor], what: str) -> None:
    _nonempty(ins, what)
    if len(outs) != len(ins):
        raise ArgumentError(f"hetcomm {what}: {len(outs)} outputs for {len(ins)} inputs")


def _same_dtype(t: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    if t.dtype != ref.dtype:
        raise TypeError(f"hetcomm {what}: expected dtype {ref.dtype} like the input, got {t.dtype}")
    if t.device != ref.device:
        raise ArgumentError(
            f"hetcomm {what}: expected a tensor on {ref.device} like the input, got {t.device}"
        )


# ---- tensors ------------------------------------------------------------------------------------


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _reducible(t: torch.Tensor, op: ReduceOp, what: str) -> torch.Tensor:
    """`t` as hetcomm reduces it: itself, or the real view of a complex tensor (SUM/AVG)."""
    if t.dtype in _NATIVE_DTYPES:
        return t
    if t.is_complex():
        if op not in (ReduceOp.SUM, ReduceOp.AVG):
            raise ArgumentError(
                f"hetcomm {what}: complex tensors reduce with SUM or AVG only, got {op.name}"
            )
        return torch.view_as_real(t)
    if _dtype_name(t) not in _NATIVE:
        raise DtypeError(
            f"hetcomm {what}: cannot reduce {t.dtype}; expected one of "
            f"{', '.join(sorted(_NATIVE))} or a complex dtype"
        )
    return t


def _movable(t: torch.Tensor, write: bool) -> tuple[torch.Tensor, list[Callable[[], None]]]:
    """`t` as hetcomm moves it (no arithmetic): itself, a real view, or its bytes.

    Dtypes hetcomm does not know (float8, uint32, ...) travel as bytes; a non-contiguous one goes
    through a contiguous copy, written back after the operation when `write`.
    """
    if t.dtype in _NATIVE_DTYPES:
        return t, []
    if t.is_complex():
        return torch.view_as_real(t), []
    if t.is_contiguous():
        return t.reshape(-1).view(torch.uint8), []
    packed = t.contiguous()
    steps = [_copier(t, packed)] if write else []
    return packed.reshape(-1).view(torch.uint8), steps


def split_rows(
    t: torch.Tensor, splits: Sequence[int] | None, n: int, what: str
) -> list[torch.Tensor]:
    """`t` cut along dim 0 into `n` pieces of `splits` rows (equal pieces when splits is empty)."""
    rows = t.shape[0] if t.dim() else 1
    if not splits:
        if rows % n:
            raise ArgumentError(f"hetcomm {what}: {rows} rows do not split evenly over {n} ranks")
        splits = [rows // n] * n
    if len(splits) != n or any(s < 0 for s in splits) or sum(splits) != rows:
        raise ArgumentError(
            f"hetcomm {what}: expected {n} non-negative split sizes adding up to "
            f"{rows} rows, got {list(splits)}"
        )
    return list(torch.split(t, list(splits), dim=0)) if t.dim() else [t]


def _copier(target: torch.Tensor, source: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        target.copy_(source.reshape(target.shape))

    return step


def _copy_rows(flat: torch.Tensor, outs: Sequence[torch.Tensor]) -> Callable[[], None]:
    def step() -> None:
        for row, out in zip(flat, outs):
            out.copy_(_restore(row, out))

    return step


def _restore(moved: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Undo _movable: `moved` seen with the dtype and shape of `like`."""
    if like.is_complex():
        return torch.view_as_complex(moved.reshape(*like.shape, 2))
    if moved.dtype != like.dtype:
        return moved.reshape(-1).view(like.dtype).reshape(like.shape)
    return moved.reshape(like.shape)
