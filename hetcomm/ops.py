"""Reduction operators and which dtypes each accepts."""

from __future__ import annotations

import enum
from typing import Any

from .errors import DtypeError, InvalidArgument


class ReduceOp(enum.Enum):
    """How values from the ranks combine: SUM, AVG, PROD, MIN, MAX."""

    SUM = "sum"
    AVG = "avg"
    PROD = "prod"
    MIN = "min"
    MAX = "max"

    def __str__(self) -> str:
        return self.name

    # members are singletons: identity hashes them in C, where Enum's hash(self._name_) is a
    # Python call (routes are keyed by the op at every call)
    __hash__ = object.__hash__


_BY_NAME = {op.value: op for op in ReduceOp} | {"product": ReduceOp.PROD, "mean": ReduceOp.AVG}


def as_reduce_op(op: Any, what: str = "op") -> ReduceOp:
    """ReduceOp from a ReduceOp or its name ('sum', 'SUM', 'avg', ...)."""
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str):
        found = _BY_NAME.get(op.lower())
        if found is not None:
            return found
    raise InvalidArgument(
        f"{what}: expected a hetcomm.ReduceOp (SUM, AVG, PROD, MIN, MAX) or its name, got {op!r}"
    )


def check_op_for_dtype(op: ReduceOp, dtype: str, what: str) -> None:
    """AVG has no meaning for bool; every other pairing is accepted."""
    if op is ReduceOp.AVG and dtype == "bool":
        raise DtypeError(
            f"{what}: AVG needs a numeric dtype, got bool (use MAX for 'any', MIN for 'all')"
        )
