"""Bad calls raise the specific error before anything moves, leaving the caller's buffers as
they were. Every rank makes the same bad call, so every rank raises and none is left alone in
a collective."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _data import Cases, expect_raises

import hetcomm
from hetcomm import ReduceOp


def _readonly(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


@pytest.mark.mpi(min_size=2)
def test_out_with_wrong_dtype_or_count(hetcomm_comm, errors):
    size = hetcomm_comm.size
    x = np.arange(5, dtype=np.float32)
    out64, short = np.full(5, 9.0), np.full(4, 9.0, dtype=np.float32)
    t, t_out = torch.arange(5, dtype=torch.bfloat16), torch.zeros(5, dtype=torch.float16)
    gathered, wrong = np.full(size * 5 - 1, 9.0, dtype=np.float32), np.zeros(size * 5, np.int32)
    uneven, part = np.arange(size * 3 + 1, dtype=np.float32), np.full(3, 9.0, dtype=np.float32)
    even, big = np.arange(size * 3, dtype=np.float32), np.full(4, 9.0, dtype=np.float32)
    odd, odd_out = np.arange(size * 2 + 1), np.zeros(size * 2 + 1, dtype=np.int64)
    blocks, fewer = np.arange(size * 2), np.zeros(size * 2 - 1, dtype=np.int64)
    cases: Cases = {
        "all_reduce out dtype": (
            lambda: hetcomm_comm.all_reduce(x, out=out64),
            ("float32", "float64"),
        ),
        "all_reduce out count": (
            lambda: hetcomm_comm.all_reduce(x, out=short),
            ("5 elements", "got 4"),
        ),
        "all_reduce torch out dtype": (
            lambda: hetcomm_comm.all_reduce(t, out=t_out),
            ("bfloat16", "float16"),
        ),
        "all_gather out too small": (
            lambda: hetcomm_comm.all_gather(gathered, x),
            (f"{size * 5} elements", f"got {size * 5 - 1}"),
        ),
        "all_gather out dtype": (lambda: hetcomm_comm.all_gather(wrong, x), ("float32", "int32")),
        "reduce_scatter x not divisible": (
            lambda: hetcomm_comm.reduce_scatter(part, uneven),
            (str(size * 3 + 1),),
        ),
        "reduce_scatter out count": (lambda: hetcomm_comm.reduce_scatter(big, even), ("got 4",)),
        "all_to_all x not divisible": (
            lambda: hetcomm_comm.all_to_all(odd_out, odd),
            (str(size * 2 + 1),),
        ),
        "all_to_all out count": (
            lambda: hetcomm_comm.all_to_all(fewer, blocks),
            (f"got {size * 2 - 1}",),
        ),
        "reduce_scatter out dtype": (
            lambda: hetcomm_comm.reduce_scatter(part64, even),
            ("float32", "float64"),
        ),
        "all_to_all out dtype": (
            lambda: hetcomm_comm.all_to_all(blocks32, blocks),
            ("int64", "int32"),
        ),
        "all_gather out empty": (
            lambda: hetcomm_comm.all_gather(empty, x),
            (f"{size * 5}", "got 0"),
        ),
        "all_reduce out empty": (lambda: hetcomm_comm.all_reduce(x, out=empty), ("5", "got 0")),
    }
    part64, blocks32 = np.full(3, 9.0), np.zeros(size * 2, dtype=np.int32)
    empty = np.zeros(0, dtype=np.float32)
    buffers = (
        x,
        out64,
        short,
        t,
        t_out,
        gathered,
        wrong,
        uneven,
        part,
        even,
        big,
        odd,
        odd_out,
        blocks,
        fewer,
        part64,
        blocks32,
        empty,
    )
    expect_raises(errors, hetcomm.InvalidArgument, cases, buffers)
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_bad_ranks_and_tags(hetcomm_comm, errors):
    size = hetcomm_comm.size
    x = np.arange(3, dtype=np.int32)
    cases: Cases = {}
    for bad in (size, -1, 1.0, True, "0", None):
        cases |= {
            f"broadcast root={bad!r}": (lambda b=bad: hetcomm_comm.broadcast(x, b), ("root",)),
            f"reduce root={bad!r}": (lambda b=bad: hetcomm_comm.reduce(x, b), ("root",)),
            f"send dst={bad!r}": (lambda b=bad: hetcomm_comm.send(x, b), ("dst",)),
            f"recv src={bad!r}": (lambda b=bad: hetcomm_comm.recv(x, b), ("src",)),
        }
    for bad in (-1, -100, 1.5, "3", 2**62):
        cases |= {
            f"send tag={bad!r}": (lambda b=bad: hetcomm_comm.send(x, 0, tag=b), ("tag",)),
            f"recv tag={bad!r}": (lambda b=bad: hetcomm_comm.recv(x, 0, tag=b), ("tag",)),
        }
    expect_raises(errors, hetcomm.InvalidArgument, cases, (x,))

    # numpy integers are ranks too: a real broadcast, to be sure they are accepted
    y = np.full(3, hetcomm_comm.rank, dtype=np.int32)
    hetcomm_comm.broadcast(y, np.int64(size - 1))
    errors.expect((y == size - 1).all(), f"broadcast from np.int64 root gave {y}")
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_read_only_outputs(hetcomm_comm, errors):
    size = hetcomm_comm.size
    x, ones = np.arange(4, dtype=np.float64), np.ones(size)
    ro = _readonly(np.arange(4, dtype=np.float64))
    ro_all, ro_one, ro_size = (_readonly(np.zeros(n)) for n in (4 * size, 1, size))
    cases: Cases = {
        "all_reduce in place": (lambda: hetcomm_comm.all_reduce(ro), ("read-only",)),
        "all_reduce out=": (lambda: hetcomm_comm.all_reduce(x, out=ro), ("read-only",)),
        "all_gather out": (lambda: hetcomm_comm.all_gather(ro_all, x), ("read-only",)),
        "reduce_scatter out": (lambda: hetcomm_comm.reduce_scatter(ro_one, ones), ("read-only",)),
        "all_to_all out": (lambda: hetcomm_comm.all_to_all(ro_size, ones), ("read-only",)),
        "recv": (lambda: hetcomm_comm.recv(ro, 0), ("read-only",)),
    }
    expect_raises(errors, hetcomm.InvalidArgument, cases, (x, ones, ro, ro_all, ro_one, ro_size))
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_read_only_where_only_some_ranks_write(hetcomm_comm, errors):
    """reduce writes x at the root only, broadcast everywhere but the root: only the ranks
    that would write make the bad call (the others stay out of it), and each of them raises."""
    root = hetcomm_comm.size - 1
    ro = _readonly(np.arange(4, dtype=np.float64))
    cases: Cases = {}
    if hetcomm_comm.rank == root:
        cases["reduce at the root"] = (lambda: hetcomm_comm.reduce(ro, root), ("read-only", "root"))
    else:
        cases["broadcast off the root"] = (lambda: hetcomm_comm.broadcast(ro, root), ("read-only",))
    expect_raises(errors, hetcomm.InvalidArgument, cases, (ro,))
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_arrays_on_unsupported_devices(hetcomm_comm, errors):
    """A tensor on a device hetcomm cannot reach (torch's meta device), as x or as out of any
    operation, and a sparse tensor, raise naming what arrived."""
    size = hetcomm_comm.size
    x, xs = np.zeros(4, dtype=np.float32), np.zeros(4 * size, dtype=np.float32)
    meta, meta_all = torch.zeros(4, device="meta"), torch.zeros(4 * size, device="meta")
    sparse = torch.zeros(4).to_sparse()
    cases: Cases = {
        "all_reduce x": (lambda: hetcomm_comm.all_reduce(meta), ("meta",)),
        "all_reduce out": (lambda: hetcomm_comm.all_reduce(x, out=meta), ("meta",)),
        "reduce x": (lambda: hetcomm_comm.reduce(meta, 0), ("meta",)),
        "broadcast x": (lambda: hetcomm_comm.broadcast(meta, 0), ("meta",)),
        "all_gather x": (lambda: hetcomm_comm.all_gather(xs, meta), ("meta",)),
        "all_gather out": (lambda: hetcomm_comm.all_gather(meta_all, x), ("meta",)),
        "reduce_scatter x": (lambda: hetcomm_comm.reduce_scatter(x, meta_all), ("meta",)),
        "reduce_scatter out": (lambda: hetcomm_comm.reduce_scatter(meta, xs), ("meta",)),
        "all_to_all x": (lambda: hetcomm_comm.all_to_all(xs, meta_all), ("meta",)),
        "all_to_all out": (lambda: hetcomm_comm.all_to_all(meta_all, xs), ("meta",)),
        "send x": (lambda: hetcomm_comm.send(meta, 0), ("meta",)),
        "recv x": (lambda: hetcomm_comm.recv(meta, 0), ("meta",)),
        "all_reduce sparse": (lambda: hetcomm_comm.all_reduce(sparse), ("sparse",)),
    }
    expect_raises(errors, hetcomm.InvalidArgument, cases, (x, xs))
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_receive_of_another_size_raises(hetcomm_comm, errors):
    """Rank 0 sends 5 float32; rank 1 receives them into 8, then into 3: each receive raises
    MismatchError naming the rank and the sizes (the sender either completes or raises
    MismatchError too, depending on the transport). The staged transport, which agrees on the
    size before sending, leaves the array as it was; the mpi transport receives straight into
    it, so it may hold the first part of the message, but nothing else. Then a matching pair
    works."""
    if hetcomm_comm.rank == 0:
        for _ in range(2):
            try:
                hetcomm_comm.send(np.arange(5, dtype=np.float32), 1, tag=4, timeout=30)
            except hetcomm.MismatchError:
                pass
            except Exception as exc:
                errors.append(f"send: {type(exc).__name__}: {exc}")
        errors.run("matching send", hetcomm_comm.send, np.arange(5, dtype=np.float32), 1, tag=5)
    elif hetcomm_comm.rank == 1:
        for n in (8, 3):
            y = np.full(n, -1.0, dtype=np.float32)
            cases: Cases = {
                f"recv into {n}": (
                    lambda y=y: hetcomm_comm.recv(y, 0, tag=4, timeout=30),
                    ("rank 0", f"takes {4 * n}"),
                )
            }
            expect_raises(errors, hetcomm.MismatchError, cases)
            k = min(n, 5)
            prefix = np.concatenate([np.arange(k), np.full(n - k, -1.0)])
            errors.expect((y == -1).all() or (y == prefix).all(), f"recv into {n}: y is {y}")
        y = np.zeros(5, dtype=np.float32)
        if errors.run("matching recv", hetcomm_comm.recv, y, 0, tag=5):
            errors.expect((y == np.arange(5)).all(), f"matching recv got {y}")
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_read_only_inputs_are_accepted_where_nothing_is_written(hetcomm_comm, errors):
    """A read-only x is fine wherever hetcomm only reads it: the input of out-of-place
    operations and of send, reduce off the root and broadcast at the root."""
    size, rank = hetcomm_comm.size, hetcomm_comm.rank
    ro = _readonly(np.full(size, rank + 1.0))
    out, gathered = np.zeros(size), np.zeros(size * size)
    hetcomm_comm.all_reduce(ro, out=out)
    hetcomm_comm.all_gather(gathered, ro)
    errors.expect((out == size * (size + 1) / 2).all(), f"all_reduce out= gave {out}")
    want = np.repeat(np.arange(1.0, size + 1), size)
    errors.expect((gathered == want).all(), f"all_gather gave {gathered}")
    sent, got = hetcomm_comm.send(ro, (rank + 1) % size, async_op=True), np.zeros(size)
    hetcomm_comm.recv(got, (rank - 1) % size)
    sent.wait()
    errors.expect((got == (rank - 1) % size + 1).all(), f"received {got}")

    root = size - 1
    x = np.full(3, rank + 1, dtype=np.int64)
    if rank != root:
        _readonly(x)
    hetcomm_comm.reduce(x, root)
    want = size * (size + 1) // 2 if rank == root else rank + 1
    errors.expect((x == want).all(), f"reduce: x is {x}, expected {want}")

    y = np.full(2, rank, dtype=np.float32)
    if rank == root:
        _readonly(y)
    hetcomm_comm.broadcast(y, root)
    errors.expect((y == root).all(), f"broadcast: y is {y}")
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_unsupported_dtypes(hetcomm_comm, errors):
    ok = np.zeros(1, dtype=np.float32)
    arrays = {
        "numpy complex64": np.zeros(4, dtype=np.complex64),
        "numpy uint16": np.zeros(4, dtype=np.uint16),
        "numpy uint32": np.zeros(4, dtype=np.uint32),
        "torch complex64": torch.zeros(4, dtype=torch.complex64),
        "torch uint16": torch.zeros(4, dtype=torch.uint16),
    }
    cases: Cases = {}
    for what, a in arrays.items():
        name = what.split()[1]
        cases |= {
            f"all_reduce {what}": (lambda a=a: hetcomm_comm.all_reduce(a), (name,)),
            f"all_reduce out {what}": (lambda a=a: hetcomm_comm.all_reduce(ok, out=a), (name,)),
            f"reduce {what}": (lambda a=a: hetcomm_comm.reduce(a, 0), (name,)),
            f"broadcast {what}": (lambda a=a: hetcomm_comm.broadcast(a, 0), (name,)),
            f"all_gather out {what}": (lambda a=a: hetcomm_comm.all_gather(a, ok), (name,)),
            f"all_gather x {what}": (lambda a=a: hetcomm_comm.all_gather(ok, a), (name,)),
            f"reduce_scatter x {what}": (lambda a=a: hetcomm_comm.reduce_scatter(ok, a), (name,)),
            f"all_to_all x {what}": (lambda a=a: hetcomm_comm.all_to_all(ok, a), (name,)),
            f"send {what}": (lambda a=a: hetcomm_comm.send(a, 0), (name,)),
            f"recv {what}": (lambda a=a: hetcomm_comm.recv(a, 0), (name,)),
        }
    expect_raises(errors, hetcomm.DtypeError, cases, (ok, *arrays.values()))
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_objects_that_are_not_arrays(hetcomm_comm, errors):
    ok = np.zeros(1, dtype=np.float32)
    cases: Cases = {}
    for obj in ([1.0, 2.0], 3.0, "abc", None, object()):
        kind = type(obj).__name__
        cases |= {
            f"all_reduce x={kind}": (lambda o=obj: hetcomm_comm.all_reduce(o), (kind,)),
            f"send x={kind}": (lambda o=obj: hetcomm_comm.send(o, 0), (kind,)),
            f"all_gather out={kind}": (lambda o=obj: hetcomm_comm.all_gather(o, ok), (kind,)),
        }
        if obj is not None:  # out=None means in place
            cases[f"all_reduce out={kind}"] = (
                lambda o=obj: hetcomm_comm.all_reduce(ok, out=o),
                (kind,),
            )
    expect_raises(errors, hetcomm.InvalidArgument, cases, (ok,))
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_unknown_ops(hetcomm_comm, errors):
    x = np.arange(hetcomm_comm.size, dtype=np.float32)
    out = np.zeros(1, dtype=np.float32)
    cases: Cases = {}
    for bad in ("median", "", None, 3, "ReduceOp.SUM"):
        cases |= {
            f"all_reduce op={bad!r}": (lambda b=bad: hetcomm_comm.all_reduce(x, b), (repr(bad),)),
            f"reduce op={bad!r}": (lambda b=bad: hetcomm_comm.reduce(x, 0, b), (repr(bad),)),
            f"reduce_scatter op={bad!r}": (
                lambda b=bad: hetcomm_comm.reduce_scatter(out, x, b),
                (repr(bad),),
            ),
        }
    expect_raises(errors, hetcomm.InvalidArgument, cases, (x, out))

    # names are case-insensitive and "mean" / "product" are aliases
    for name, want in (("SUM", hetcomm_comm.size), ("Max", 1), ("mean", 1), ("product", 1)):
        y = np.ones(2, dtype=np.float64)
        if errors.run(f"op {name!r}", hetcomm_comm.all_reduce, y, name):
            errors.expect((y == want).all(), f"op {name!r} gave {y}")
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_avg_on_bool_raises(hetcomm_comm, errors):
    for lib in ("numpy", "torch"):
        x = np.array([True, False] * hetcomm_comm.size)
        if lib == "torch":
            x = torch.from_numpy(x)
        out = x[:2].clone() if lib == "torch" else x[:2].copy()
        cases: Cases = {
            f"{lib} all_reduce": (
                lambda x=x: hetcomm_comm.all_reduce(x, ReduceOp.AVG),
                ("AVG", "bool"),
            ),
            f"{lib} all_reduce 'avg'": (
                lambda x=x: hetcomm_comm.all_reduce(x, "avg"),
                ("AVG", "bool"),
            ),
            f"{lib} reduce": (lambda x=x: hetcomm_comm.reduce(x, 0, ReduceOp.AVG), ("AVG", "bool")),
            f"{lib} reduce_scatter": (
                lambda x=x, out=out: hetcomm_comm.reduce_scatter(out, x, ReduceOp.AVG),
                ("AVG", "bool"),
            ),
        }
        expect_raises(errors, hetcomm.DtypeError, cases, (x, out))
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_partial_overlap_of_out_and_x(hetcomm_comm, errors):
    buf = np.arange(10, dtype=np.float32)
    t = torch.arange(10, dtype=torch.float32)
    cases: Cases = {
        "numpy": (lambda: hetcomm_comm.all_reduce(buf[:6], out=buf[4:]), ("overlap",)),
        "torch": (lambda: hetcomm_comm.all_reduce(t[2:8], out=t[:6]), ("overlap",)),
    }
    expect_raises(errors, hetcomm.InvalidArgument, cases, (buf, t))
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_bad_split_arguments(hetcomm_comm, errors):
    cases: Cases = {
        f"split({color!r}, key={key!r})": (
            lambda c=color, k=key: hetcomm_comm.split(c, k),
            ("split",),
        )
        for color, key in ((1.5, None), ("a", None), (True, None), (0, "k"), (0, 1.0))
    }
    expect_raises(errors, hetcomm.InvalidArgument, cases)
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_bad_timeouts_raise_before_anything_moves(hetcomm_comm, errors):
    """An invalid timeout is an InvalidArgument raised before the operation starts: x keeps its
    values even after the ranks have met again (time for a wrongly started one to finish)."""
    x = np.full(4, hetcomm_comm.rank + 1, dtype=np.float64)
    y = np.full(2, hetcomm_comm.rank, dtype=np.int32)
    cases: Cases = {}
    for bad in (-1.0, 0, "5"):
        cases |= {
            f"all_reduce timeout={bad!r}": (
                lambda b=bad: hetcomm_comm.all_reduce(x, timeout=b),
                ("timeout",),
            ),
            f"broadcast timeout={bad!r}": (
                lambda b=bad: hetcomm_comm.broadcast(y, 0, timeout=b),
                ("timeout",),
            ),
        }
    expect_raises(errors, hetcomm.InvalidArgument, cases)
    for _ in range(3):
        hetcomm_comm.barrier()
    errors.expect((x == hetcomm_comm.rank + 1).all(), f"x changed to {x}")
    errors.expect((y == hetcomm_comm.rank).all(), f"y changed to {y}")
    errors.verify()
