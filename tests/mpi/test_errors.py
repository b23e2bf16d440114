"""Bad calls raise the specific error before anything moves, leaving the caller's buffers as
they were. Every rank makes the same bad call, so every rank raises and none is left alone in
a collective; the few checks that depend on the rank say why they are safe."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import hetcomm
from hetcomm import ReduceOp


def expect_raise(
    errors,
    what: str,
    exc_type: type[BaseException],
    call: Callable[[], Any],
    *words: str,
    untouched: tuple[Any, ...] = (),
) -> None:
    """`call()` must raise `exc_type` whose message holds every one of `words`, and leave each
    array of `untouched` with the contents it had before."""
    before = [_snapshot(a) for a in untouched]
    try:
        call()
    except exc_type as exc:
        missing = [w for w in words if w not in str(exc)]
        errors.expect(not missing, f"{what}: message {str(exc)!r} lacks {missing}")
    except Exception as exc:
        errors.append(f"{what}: raised {type(exc).__name__}({exc}), not {exc_type.__name__}")
    else:
        errors.append(f"{what}: did not raise {exc_type.__name__}")
    for i, (a, old) in enumerate(zip(untouched, before)):
        errors.expect(np.array_equal(_snapshot(a), old), f"{what}: buffer {i} was changed")


def _snapshot(a: Any) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        return a.detach().to(torch.float64).numpy().copy()
    return np.array(a, copy=True)


def _readonly(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


@pytest.mark.mpi(min_size=2)
def test_out_with_wrong_dtype_or_count(comm, errors):
    size = comm.size
    x = np.arange(5, dtype=np.float32)
    out64 = np.full(5, 9.0)
    short = np.full(4, 9.0, dtype=np.float32)
    expect_raise(
        errors,
        "all_reduce out dtype",
        hetcomm.InvalidArgument,
        lambda: comm.all_reduce(x, out=out64),
        "float32",
        "float64",
        untouched=(x, out64),
    )
    expect_raise(
        errors,
        "all_reduce out count",
        hetcomm.InvalidArgument,
        lambda: comm.all_reduce(x, out=short),
        "5 elements",
        "got 4",
        untouched=(x, short),
    )
    t = torch.arange(5, dtype=torch.bfloat16)
    t_out = torch.zeros(5, dtype=torch.float16)
    expect_raise(
        errors,
        "all_reduce torch out dtype",
        hetcomm.InvalidArgument,
        lambda: comm.all_reduce(t, out=t_out),
        "bfloat16",
        "float16",
        untouched=(t, t_out),
    )

    gathered = np.full(size * 5 - 1, 9.0, dtype=np.float32)
    expect_raise(
        errors,
        "all_gather out too small",
        hetcomm.InvalidArgument,
        lambda: comm.all_gather(gathered, x),
        f"{size * 5} elements",
        f"got {size * 5 - 1}",
        untouched=(x, gathered),
    )
    wrong = np.zeros(size * 5, dtype=np.int32)
    expect_raise(
        errors,
        "all_gather out dtype",
        hetcomm.InvalidArgument,
        lambda: comm.all_gather(wrong, x),
        "float32",
        "int32",
        untouched=(x, wrong),
    )

    uneven = np.arange(size * 3 + 1, dtype=np.float32)
    part = np.full(3, 9.0, dtype=np.float32)
    expect_raise(
        errors,
        "reduce_scatter x not divisible",
        hetcomm.InvalidArgument,
        lambda: comm.reduce_scatter(part, uneven),
        str(size * 3 + 1),
        untouched=(uneven, part),
    )
    even = np.arange(size * 3, dtype=np.float32)
    big = np.full(4, 9.0, dtype=np.float32)
    expect_raise(
        errors,
        "reduce_scatter out count",
        hetcomm.InvalidArgument,
        lambda: comm.reduce_scatter(big, even),
        "got 4",
        untouched=(even, big),
    )

    odd = np.arange(size * 2 + 1, dtype=np.int64)
    odd_out = np.zeros(size * 2 + 1, dtype=np.int64)
    expect_raise(
        errors,
        "all_to_all not divisible",
        hetcomm.InvalidArgument,
        lambda: comm.all_to_all(odd_out, odd),
        str(size * 2 + 1),
        untouched=(odd, odd_out),
    )
    blocks = np.arange(size * 2, dtype=np.int64)
    fewer = np.zeros(size * 2 - 1, dtype=np.int64)
    expect_raise(
        errors,
        "all_to_all out count",
        hetcomm.InvalidArgument,
        lambda: comm.all_to_all(fewer, blocks),
        f"got {size * 2 - 1}",
        untouched=(blocks, fewer),
    )
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_bad_ranks_and_tags(comm, errors):
    size = comm.size
    x = np.arange(3, dtype=np.int32)
    for bad in (size, -1, 1.0, True, "0", None):
        expect_raise(
            errors,
            f"broadcast root={bad!r}",
            hetcomm.InvalidArgument,
            lambda b=bad: comm.broadcast(x, b),
            "root",
            untouched=(x,),
        )
        expect_raise(
            errors,
            f"reduce root={bad!r}",
            hetcomm.InvalidArgument,
            lambda b=bad: comm.reduce(x, b),
            "root",
            untouched=(x,),
        )
        expect_raise(
            errors,
            f"send dst={bad!r}",
            hetcomm.InvalidArgument,
            lambda b=bad: comm.send(x, b),
            "dst",
            untouched=(x,),
        )
        expect_raise(
            errors,
            f"recv src={bad!r}",
            hetcomm.InvalidArgument,
            lambda b=bad: comm.recv(x, b),
            "src",
            untouched=(x,),
        )
    for bad in (-1, -100, 1.5, "3", 2**62):
        expect_raise(
            errors,
            f"send tag={bad!r}",
            hetcomm.InvalidArgument,
            lambda b=bad: comm.send(x, 0, tag=b),
            "tag",
            untouched=(x,),
        )
        expect_raise(
            errors,
            f"recv tag={bad!r}",
            hetcomm.InvalidArgument,
            lambda b=bad: comm.recv(x, 0, tag=b),
            "tag",
            untouched=(x,),
        )
    # numpy integers are ranks too: a real broadcast, to be sure they are accepted
    y = np.full(3, comm.rank, dtype=np.int32)
    comm.broadcast(y, np.int64(size - 1))
    errors.expect((y == size - 1).all(), f"broadcast from np.int64 root gave {y}")
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_read_only_outputs(comm, errors):
    size = comm.size
    x = np.arange(4, dtype=np.float64)
    ro = _readonly(np.arange(4, dtype=np.float64))
    ro_big = _readonly(np.zeros(4 * size))
    ro_part = _readonly(np.zeros(1))
    cases = {
        "all_reduce in place": lambda: comm.all_reduce(ro),
        "all_reduce out=": lambda: comm.all_reduce(x, out=ro),
        "all_gather out": lambda: comm.all_gather(ro_big, x),
        "reduce_scatter out": lambda: comm.reduce_scatter(ro_part, np.ones(size)),
        "all_to_all out": lambda: comm.all_to_all(_readonly(np.zeros(size)), np.ones(size)),
        "recv": lambda: comm.recv(ro, 0),
    }
    for what, call in cases.items():
        expect_raise(
            errors,
            what,
            hetcomm.InvalidArgument,
            call,
            "read-only",
            untouched=(x, ro, ro_big, ro_part),
        )
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_read_only_inputs_are_accepted_where_nothing_is_written(comm, errors):
    """A read-only x is fine for reduce off the root and for broadcast at the root."""
    root = comm.size - 1
    x = np.full(3, comm.rank + 1, dtype=np.int64)
    if comm.rank != root:
        _readonly(x)
    comm.reduce(x, root)
    want = comm.size * (comm.size + 1) // 2 if comm.rank == root else comm.rank + 1
    errors.expect((x == want).all(), f"reduce: x is {x}, expected {want}")

    y = np.full(2, comm.rank, dtype=np.float32)
    if comm.rank == root:
        _readonly(y)
    comm.broadcast(y, root)
    errors.expect((y == root).all(), f"broadcast: y is {y}")
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_unsupported_dtypes_and_objects(comm, errors):
    ok = np.zeros(4, dtype=np.float32)
    arrays = {
        "numpy complex64": np.zeros(4, dtype=np.complex64),
        "numpy uint16": np.zeros(4, dtype=np.uint16),
        "numpy uint32": np.zeros(4, dtype=np.uint32),
        "torch complex64": torch.zeros(4, dtype=torch.complex64),
        "torch uint16": torch.zeros(4, dtype=torch.uint16),
    }
    for what, a in arrays.items():
        name = what.split()[1]
        expect_raise(
            errors,
            f"all_reduce {what}",
            hetcomm.DtypeError,
            lambda a=a: comm.all_reduce(a),
            name,
            untouched=(a,),
        )
        expect_raise(
            errors,
            f"broadcast {what}",
            hetcomm.DtypeError,
            lambda a=a: comm.broadcast(a, 0),
            name,
            untouched=(a,),
        )
        expect_raise(
            errors,
            f"all_gather out {what}",
            hetcomm.DtypeError,
            lambda a=a: comm.all_gather(a, ok[:1]),
            name,
            untouched=(a, ok),
        )
    for obj in ([1.0, 2.0], 3.0, "abc", None, object()):
        expect_raise(
            errors,
            f"all_reduce {type(obj).__name__}",
            hetcomm.InvalidArgument,
            lambda o=obj: comm.all_reduce(o),
            type(obj).__name__,
        )
        expect_raise(
            errors,
            f"all_reduce out={type(obj).__name__}",
            hetcomm.InvalidArgument,
            lambda o=obj: comm.all_reduce(ok, out=o),
            untouched=(ok,),
        )
        expect_raise(
            errors,
            f"send {type(obj).__name__}",
            hetcomm.InvalidArgument,
            lambda o=obj: comm.send(o, 0),
        )
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_unknown_ops(comm, errors):
    x = np.arange(comm.size, dtype=np.float32)
    out = np.zeros(1, dtype=np.float32)
    for bad in ("median", "", None, 3, "ReduceOp.SUM"):
        expect_raise(
            errors,
            f"all_reduce op={bad!r}",
            hetcomm.InvalidArgument,
            lambda b=bad: comm.all_reduce(x, b),
            repr(bad),
            untouched=(x,),
        )
        expect_raise(
            errors,
            f"reduce op={bad!r}",
            hetcomm.InvalidArgument,
            lambda b=bad: comm.reduce(x, 0, b),
            untouched=(x,),
        )
        expect_raise(
            errors,
            f"reduce_scatter op={bad!r}",
            hetcomm.InvalidArgument,
            lambda b=bad: comm.reduce_scatter(out, x, b),
            untouched=(x, out),
        )
    # names are case-insensitive and "mean" / "product" are aliases
    for name, want in (("SUM", comm.size), ("Max", 1), ("mean", 1), ("product", 1)):
        y = np.ones(2, dtype=np.float64)
        comm.all_reduce(y, name)
        errors.expect((y == want).all(), f"op {name!r} gave {y}")
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_avg_on_bool_raises(comm, errors):
    for lib in ("numpy", "torch"):
        x = np.array([True, False] * comm.size)
        if lib == "torch":
            x = torch.from_numpy(x)
        out = x[:2].clone() if lib == "torch" else x[:2].copy()
        calls = {
            "all_reduce": lambda x=x: comm.all_reduce(x, ReduceOp.AVG),
            "all_reduce avg": lambda x=x: comm.all_reduce(x, "avg"),
            "reduce": lambda x=x: comm.reduce(x, 0, ReduceOp.AVG),
            "reduce_scatter": lambda x=x, out=out: comm.reduce_scatter(out, x, ReduceOp.AVG),
        }
        for what, call in calls.items():
            expect_raise(
                errors, f"{lib} {what}", hetcomm.DtypeError, call, "AVG", "bool", untouched=(x, out)
            )
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_partial_overlap_of_out_and_x(comm, errors):
    buf = np.arange(10, dtype=np.float32)
    expect_raise(
        errors,
        "all_reduce out overlapping x",
        hetcomm.InvalidArgument,
        lambda: comm.all_reduce(buf[:6], out=buf[4:]),
        "overlap",
        untouched=(buf,),
    )
    t = torch.arange(10, dtype=torch.float32)
    expect_raise(
        errors,
        "all_reduce torch out overlapping x",
        hetcomm.InvalidArgument,
        lambda: comm.all_reduce(t[2:8], out=t[:6]),
        "overlap",
        untouched=(t,),
    )
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_bad_timeouts_raise_before_anything_moves(comm, errors):
    """An invalid timeout is an InvalidArgument raised before the operation starts: x keeps its
    values even after the ranks have synchronised again."""
    x = np.full(4, comm.rank + 1, dtype=np.float64)
    y = np.full(2, comm.rank, dtype=np.int32)
    for bad in (-1.0, 0, "5"):
        expect_raise(
            errors,
            f"all_reduce timeout={bad!r}",
            hetcomm.InvalidArgument,
            lambda b=bad: comm.all_reduce(x, timeout=b),
            "timeout",
        )
        expect_raise(
            errors,
            f"broadcast timeout={bad!r}",
            hetcomm.InvalidArgument,
            lambda b=bad: comm.broadcast(y, 0, timeout=b),
            "timeout",
        )
    # anything a faulty call started would finish while the ranks meet again
    for _ in range(3):
        comm.barrier()
    errors += [f"x changed to {x}"] if (x != comm.rank + 1).any() else []
    errors += [f"y changed to {y}"] if (y != comm.rank).any() else []
    errors.verify()
