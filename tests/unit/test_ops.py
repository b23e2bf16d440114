"""Unit tests for hetcomm.ops: reduction operators by enum or name, and dtype checks."""

from __future__ import annotations

import re
from typing import Any

import pytest

from hetcomm import ReduceOp as ExportedReduceOp
from hetcomm.arrays import DTYPES
from hetcomm.errors import DtypeError, InvalidArgument
from hetcomm.ops import ReduceOp, as_reduce_op, check_op_for_dtype


def test_members() -> None:
    assert [op.name for op in ReduceOp] == ["SUM", "AVG", "PROD", "MIN", "MAX"]
    assert [op.value for op in ReduceOp] == ["sum", "avg", "prod", "min", "max"]
    assert ExportedReduceOp is ReduceOp


@pytest.mark.parametrize("op", list(ReduceOp))
def test_str_is_the_name(op: ReduceOp) -> None:
    assert str(op) == op.name
    assert f"{op}" == op.name


@pytest.mark.parametrize("op", list(ReduceOp))
def test_enum_passes_through(op: ReduceOp) -> None:
    assert as_reduce_op(op) is op


@pytest.mark.parametrize(
    ("name", "op"),
    [
        ("sum", ReduceOp.SUM),
        ("SUM", ReduceOp.SUM),
        ("Sum", ReduceOp.SUM),
        ("avg", ReduceOp.AVG),
        ("AVG", ReduceOp.AVG),
        ("mean", ReduceOp.AVG),
        ("MEAN", ReduceOp.AVG),
        ("Mean", ReduceOp.AVG),
        ("prod", ReduceOp.PROD),
        ("PROD", ReduceOp.PROD),
        ("product", ReduceOp.PROD),
        ("Product", ReduceOp.PROD),
        ("PRODUCT", ReduceOp.PROD),
        ("min", ReduceOp.MIN),
        ("MIN", ReduceOp.MIN),
        ("mIn", ReduceOp.MIN),
        ("max", ReduceOp.MAX),
        ("MAX", ReduceOp.MAX),
        ("Max", ReduceOp.MAX),
    ],
)
def test_names_case_insensitive(name: str, op: ReduceOp) -> None:
    assert as_reduce_op(name) is op


@pytest.mark.parametrize("op", list(ReduceOp))
def test_name_and_value_round_trip(op: ReduceOp) -> None:
    assert as_reduce_op(op.name) is op
    assert as_reduce_op(op.value) is op
    assert as_reduce_op(str(op)) is op


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "add",
        "average",
        "sum ",
        " max",
        "band",
        "bor",
        "ReduceOp.SUM",
        "minimum",
        0,
        1,
        None,
        1.5,
        b"sum",
        ["sum"],
        ReduceOp,
    ],
)
def test_bad_op(bad: Any) -> None:
    with pytest.raises(InvalidArgument) as info:
        as_reduce_op(bad)
    assert str(info.value) == (
        f"op: expected a hetcomm.ReduceOp (SUM, AVG, PROD, MIN, MAX) or its name, got {bad!r}"
    )
    assert isinstance(info.value, ValueError)


def test_bad_op_names_the_argument() -> None:
    with pytest.raises(InvalidArgument, match=re.escape("reduce_op: expected a hetcomm.ReduceOp")):
        as_reduce_op("xor", what="reduce_op")


def test_foreign_enum_is_refused() -> None:
    import enum

    class Other(enum.Enum):
        SUM = "sum"

    with pytest.raises(InvalidArgument):
        as_reduce_op(Other.SUM)


def test_avg_on_bool_is_a_dtype_error() -> None:
    with pytest.raises(DtypeError) as info:
        check_op_for_dtype(ReduceOp.AVG, "bool", "all_reduce")
    assert str(info.value) == (
        "all_reduce: AVG needs a numeric dtype, got bool (use MAX for 'any', MIN for 'all')"
    )
    assert isinstance(info.value, InvalidArgument)
    assert isinstance(info.value, TypeError)


@pytest.mark.parametrize(
    ("op", "dtype"),
    [(op, d) for op in ReduceOp for d in DTYPES if (op, d) != (ReduceOp.AVG, "bool")],
)
def test_every_other_pairing_is_accepted(op: ReduceOp, dtype: str) -> None:
    assert check_op_for_dtype(op, dtype, "all_reduce") is None
