"""Tensor fusion without MPI or a GPU: checks, grouping, offsets, host packing, the kernel table.

The device kernels' table is checked by a Python interpreter of exactly what fusion.cu does with
each row, run over numpy memory; device arrays are stood in for by objects that expose the CUDA
array interface over host memory (never dereferenced as device memory here).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hetcomm.kernels import fusion as fusion_kernels

from hetcomm import DtypeError, InvalidArgument, ReduceOp, fusion

torch = pytest.importorskip("torch")


def addr(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


class FakeDevice:
    """A device array as hetcomm sees one: the CUDA array interface (over host memory)."""

    def __init__(self, view: np.ndarray, device: int = 0) -> None:
        self.view = view
        strides = None if view.flags.c_contiguous else view.strides
        self.__cuda_array_interface__ = {
            "shape": view.shape,
            "typestr": view.dtype.str,
            "data": (addr(view), False),
            "strides": strides,
            "version": 3,
        }
        self.device = SimpleNamespace(id=device)


# ---- the kernel table ---------------------------------------------------------------------------


def interpret(rows: np.ndarray, memory: np.ndarray, fused: np.ndarray, unpack: bool) -> None:
    """What fusion_pack / fusion_unpack do with `rows`, element by element; `memory` is the numpy
    array every table address points into."""
    base, item = addr(memory), memory.itemsize
    for row in rows:
        ptr, off, count, nd = (int(v) for v in row[:4])
        shape, strides = (
            row[4 : 4 + nd],
            row[4 + fusion_kernels.DIMS : 4 + fusion_kernels.DIMS + nd],
        )
        for i in range(count):
            at, rest = 0, i
            for d in range(nd - 1, -1, -1):
                at += (rest % shape[d]) * strides[d]
                rest //= shape[d]
            where = (ptr - base) // item + (at if nd else i)
            if unpack:
                memory[where] = fused[off + i]
            else:
                fused[off + i] = memory[where]


def entries_of(views: list[np.ndarray]) -> tuple[list[fusion_kernels.Entry], int]:
    entries, off = [], 0
    for v in views:
        strides = tuple(s // v.itemsize for s in v.strides)
        entries.append((addr(v), off, v.size, v.shape, strides))
        off += v.size
    return entries, off


def test_collapse():
    assert fusion_kernels.collapse((4, 5), (5, 1)) == ((20,), (1,))
    assert fusion_kernels.collapse((1, 7, 1), (70, 10, 1)) == ((7,), (10,))
    assert fusion_kernels.collapse((3, 4), (1, 3)) == ((3, 4), (1, 3))  # transposed: no merge
    assert fusion_kernels.collapse((2, 3, 4), (24, 4, 1)) == ((2, 12), (24, 1))
    assert fusion_kernels.collapse((), ()) == ((), ())
    assert fusion_kernels.collapse((1, 1), (5, 9)) == ((), ())
    assert (
        fusion_kernels.dense((), ())
        and fusion_kernels.dense((12,), (1,))
        and not fusion_kernels.dense((12,), (2,))
    )


def test_table_rows():
    rows, slow = fusion_kernels.table(
        [
            (1000, 0, 6, (2, 3), (3, 1)),
            (2000, 6, 0, (0,), (1,)),
            (3000, 6, 4, (4,), (-2,)),
            (4000, 10, 6, (3, 2), (1, 3)),
        ]
    )
    assert not slow and rows.shape == (3, fusion_kernels.COLS)  # the empty array has no row
    assert list(rows[0, :4]) == [1000, 0, 6, 0]  # contiguous: ndim 0
    assert list(rows[1, :5]) == [3000, 6, 4, 1, 4] and rows[1, 4 + fusion_kernels.DIMS] == -2
    assert list(rows[2, :6]) == [4000, 10, 6, 2, 3, 2]
    assert list(rows[2, 4 + fusion_kernels.DIMS : 6 + fusion_kernels.DIMS]) == [1, 3]
    assert fusion_kernels.grid(rows) == (1, 3)
    big, _ = fusion_kernels.table([(0, 0, 10**9, (10**9,), (1,))])
    assert fusion_kernels.grid(big) == (1024, 1)
    assert fusion_kernels.grid(np.zeros((0, fusion_kernels.COLS), np.int64)) == (0, 0)


def test_table_packs_and_unpacks_like_numpy():
    rng = np.random.default_rng(5)
    memory = rng.standard_normal(4000)
    views = [
        memory[0:7],
        memory[10:11],
        memory[20:60:3],
        memory[100:160].reshape(6, 10).T,
        memory[200:320].reshape(2, 3, 4, 5).transpose(3, 1, 0, 2),
        memory[400:420][::-1],
        memory[500:500],
        memory[600:1112].reshape((2,) * 9)[:, ::-1, :, ::-1, :, ::-1, :, ::-1],
        memory[1200:1300].reshape(10, 10)[::2, 1::3],
    ]
    entries, total = entries_of(views)
    rows, slow = fusion_kernels.table(entries)
    assert len(slow) == 1 and slow[0][0] == addr(views[7])  # 9 dims, no two merge: copied alone
    fused = np.full(total, np.nan)
    interpret(rows, memory, fused, unpack=False)
    for _, off, count, _, _ in slow:
        fused[off : off + count] = views[7].reshape(-1)
    assert np.array_equal(fused, np.concatenate([v.reshape(-1) for v in views]))
    before = memory.copy()
    interpret(rows, memory, -fused, unpack=True)
    for _, off, count, _, _ in slow:
        views[7][...] = -fused[off : off + count].reshape(views[7].shape)
    touched = np.zeros(memory.size, dtype=bool)
    for v in views:
        pos = positions(memory, v)
        assert np.array_equal(memory[pos], -before[pos])
        touched[pos] = True
    assert np.array_equal(memory[~touched], before[~touched])


def positions(memory: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Index into `memory` of every element of its view `v`, in row-major order of `v`."""
    index = np.arange(memory.size, dtype=np.int64)
    assert index.itemsize == memory.itemsize
    start = (addr(v) - addr(memory)) // memory.itemsize
    return np.lib.stride_tricks.as_strided(index[start:], v.shape, v.strides).reshape(-1)


# ---- checks and groups --------------------------------------------------------------------------


def test_groups_follow_first_appearance():
    a, b, c = np.zeros(3, np.float32), np.zeros((2, 2), np.int64), np.ones(5, np.float32)
    t = torch.zeros(4, dtype=torch.bfloat16)
    d = np.zeros(0, np.float32)
    bufs, groups = fusion.prepare([b, a, t, c, d], ReduceOp.SUM, "x")
    assert [g.dtype for g in groups] == ["int64", "float32", "bfloat16"]
    f32 = groups[1]
    assert f32.index == [1, 3, 4] and f32.offsets == [0, 3, 8] and f32.total == 8
    assert len(bufs) == 5 and groups[2].total == 4 and f32.contiguous
    _, strided = fusion.prepare([a, c[::2]], ReduceOp.MAX, "x")
    assert not strided[0].contiguous and strided[0].total == 6


def test_plain_numpy_arrays_need_no_buffers():
    xs = [
        np.zeros(3, np.float32),
        np.ones((2, 2)),
        np.zeros(6, np.float32)[::2],
        np.zeros(0, np.float32),
    ]
    kept, groups = fusion.prepare(xs, ReduceOp.SUM, "x")
    assert kept == xs and all(not g.bufs for g in groups)
    assert [(g.dtype, g.index) for g in groups] == [("float32", [0, 2, 3]), ("float64", [1])]
    assert groups[0].offsets == [0, 3, 6] and groups[0].total == 6 and not groups[0].contiguous
    assert groups[1].hosts[0].shape == (4,) and groups[1].contiguous
    base = np.zeros(10)
    _, shared = fusion.prepare([base[:5], base[5:]], ReduceOp.SUM, "x")  # one allocation: checked
    assert len(shared[0].bufs) == 2 and shared[0].offsets == [0, 5]


def test_empty_list_and_tuple():
    assert fusion.prepare([], ReduceOp.SUM, "x") == ([], [])
    assert fusion.prepare((), ReduceOp.SUM, "x") == ([], [])


@pytest.mark.parametrize(
    ("arrays", "op", "exc", "words"),
    [
        (np.zeros(3), ReduceOp.SUM, InvalidArgument, ["list or tuple", "numpy.ndarray"]),
        ({"a": np.zeros(3)}, ReduceOp.SUM, InvalidArgument, ["list or tuple", "dict"]),
        ([np.zeros(3), 5], ReduceOp.SUM, InvalidArgument, ["arrays[1]", "int"]),
        ([np.zeros(3), np.zeros(2, np.complex64)], ReduceOp.SUM, DtypeError, ["arrays[1]"]),
        ([np.zeros(3), np.zeros(2, bool)], ReduceOp.AVG, DtypeError, ["arrays[1]", "AVG", "bool"]),
    ],
)
def test_bad_arguments(arrays: Any, op: ReduceOp, exc: type, words: list[str]) -> None:
    with pytest.raises(exc) as info:
        fusion.prepare(arrays, op, "all_reduce_coalesced")
    assert all(w in str(info.value) for w in [*words, "all_reduce_coalesced"]), str(info.value)


def test_integer_avg_is_accepted():
    fusion.prepare([np.zeros(3, np.int32)], ReduceOp.AVG, "x")  # truncates, as all_reduce does


def test_read_only():
    ro = np.zeros(3)
    ro.setflags(write=False)
    with pytest.raises(InvalidArgument, match=r"arrays\[2\].*read-only"):
        fusion.prepare([np.zeros(1), np.zeros(1), ro], ReduceOp.SUM, "x")


def test_aliasing():
    base = np.arange(40.0)
    other = np.zeros(5)
    with pytest.raises(InvalidArgument, match=r"arrays\[0\] and arrays\[2\] are the same"):
        fusion.prepare([other, base, other], ReduceOp.SUM, "x")
    with pytest.raises(InvalidArgument, match=r"arrays\[1\] and arrays\[2\] overlap"):
        fusion.prepare([other, base[5:15], base[0:6]], ReduceOp.SUM, "x")
    with pytest.raises(InvalidArgument, match="overlap"):
        fusion.prepare([base[::3], base[6:7]], ReduceOp.SUM, "x")
    with pytest.raises(InvalidArgument, match="same"):
        fusion.prepare([base[::3], base[::3]], ReduceOp.SUM, "x")
    with pytest.raises(InvalidArgument, match="overlap"):
        fusion.prepare([base[0:10], torch.from_numpy(base)[9:12]], ReduceOp.SUM, "x")
    t = torch.zeros(6)
    with pytest.raises(InvalidArgument, match="same"):
        fusion.prepare([t, t.view(2, 3).reshape(6)], ReduceOp.SUM, "x")
    # disjoint: neighbours, interleaved strides, empty views, the two halves of a transpose
    fusion.prepare(
        [base[0:10], base[10:20], base[20:30:2], base[21:30:2], base[5:5], base[5:5]],
        ReduceOp.SUM,
        "x",
    )
    grid = base.reshape(5, 8)
    fusion.prepare([grid[:, :4].T, grid[:, 4:].T], ReduceOp.SUM, "x")


def test_device_arrays_grouped_laid_out_and_checked():
    host = np.zeros(60, np.float32)
    d1, d2 = FakeDevice(host[0:10]), FakeDevice(host[10:40].reshape(5, 6)[:, ::2])
    h = np.ones(4, np.float32)
    _, groups = fusion.prepare([d1, h, d2], ReduceOp.SUM, "x")
    assert [(g.device, g.device_index) for g in groups] == [("cuda", 0), ("cpu", None)]
    dev = groups[0]
    assert dev.layouts == [((10,), (1,)), ((5, 3), (6, 2))] and dev.offsets == [0, 10]
    entries = fusion.device_entries(dev)
    assert entries[1] == (addr(host[10:]), 10, 15, (5, 3), (6, 2))
    fused = dev.fused(ptr=1234)
    assert fused.ptr == 1234 and fused.count == 25 and fused.on_device and fused.contiguous
    # interleaved device views are disjoint; overlapping ones are refused
    fusion.prepare([FakeDevice(host[40:60:2]), FakeDevice(host[41:60:2])], ReduceOp.SUM, "x")
    with pytest.raises(InvalidArgument, match=r"arrays\[0\] and arrays\[1\] overlap"):
        fusion.prepare([FakeDevice(host[0:30:3]), FakeDevice(host[3:4])], ReduceOp.SUM, "x")
    with pytest.raises(InvalidArgument, match="one device"):
        fusion.prepare([d1, FakeDevice(host[50:52], device=1)], ReduceOp.SUM, "x")


# ---- host packing -------------------------------------------------------------------------------


def test_pack_and_unpack_host_views():
    rng = np.random.default_rng(7)
    base = rng.standard_normal(300)
    views = [
        base[0:10],
        base[10:40:3],
        base[100:160].reshape(6, 10).T,
        base[200:201].reshape(()),
        base[250:250],
    ]
    t = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4).t()
    _, (g, tg) = fusion.prepare([*views, t], ReduceOp.SUM, "x")
    fused = np.full(g.total + 3, np.nan)
    fusion.pack_host(g, fused)
    assert np.array_equal(fused[: g.total], np.concatenate([v.reshape(-1) for v in views]))
    assert np.isnan(fused[g.total :]).all()
    before = base.copy()
    fusion.unpack_host(g, 2 * fused)
    touched = np.zeros(300, bool)
    for k in (*range(0, 10), *range(10, 40, 3), *range(100, 160), 200):
        touched[k] = True
    assert np.array_equal(base[touched], 2 * before[touched])
    assert np.array_equal(base[~touched], before[~touched])
    tf = np.empty(tg.total, np.uint16)
    fusion.pack_host(tg, tf)
    assert np.array_equal(tf, t.contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1))
    fusion.unpack_host(tg, np.zeros_like(tf))
    assert (t == 0).all()


def test_pack_and_unpack_separate_contiguous_arrays():
    rng = np.random.default_rng()
    xs = [rng.standard_normal(n).astype(np.float32) for n in (7, 0, 1, 64)]
    xs.append(rng.standard_normal((3, 5)).astype(np.float32))
    before = [x.copy() for x in xs]
    _, (g,) = fusion.prepare(xs, ReduceOp.SUM, "x")
    assert g.contiguous and not g.bufs and g.offsets == [0, 7, 7, 8, 72] and g.total == 87
    fused = np.full(g.total + 5, np.nan, np.float32)  # a reused buffer may be longer
    fusion.pack_host(g, fused)
    want = np.concatenate([b.reshape(-1) for b in before])
    assert np.array_equal(fused[: g.total], want) and np.isnan(fused[g.total :]).all()
    fused[: g.total] *= 3
    fusion.unpack_host(g, fused)
    for x, b in zip(xs, before):
        assert x.shape == b.shape and np.array_equal(x, 3 * b)


def test_host_buffers_are_taken_and_given():
    pool = fusion.HostBuffers()
    a = pool.take("float32", 100)
    assert a.dtype == np.float32 and a.size >= 100
    b = pool.take("float32", 50)
    assert b is not a  # a is out: an operation in flight keeps its own
    pool.give(a)
    assert pool.take("float32", 80) is a
    pool.give(a)
    assert pool.take("float32", 500) is not a  # too small: a fresh one
    assert pool.take("bfloat16", 4).dtype == np.uint16
    huge = np.empty((fusion.KEEP_BYTES // 4) + 1, np.float32)
    pool.give(huge)
    assert pool.take("float32", 10) is not huge


def test_compiled_copies_write_each_array_and_nothing_else():
    from hetcomm.kernels import copies

    rng = np.random.default_rng()
    memory = rng.standard_normal(100).astype(np.float32)
    views = [memory[0:7], memory[10:10], memory[20:21], memory[40:100].reshape(6, 10)]
    before = memory.copy()
    addresses = np.array([addr(v) for v in views], np.int64)
    counts = np.array([v.size for v in views], np.int64)
    fused = np.full(80, np.nan, np.float32)  # a reused buffer may be longer
    copies.gather(fused, addresses, counts, 4)
    want = np.concatenate([v.reshape(-1) for v in views])
    assert np.array_equal(fused[:68], want) and np.isnan(fused[68:]).all()
    fused[:68] *= 2
    copies.scatter(fused, addresses, counts, 4)
    touched = np.zeros(100, bool)
    touched[[*range(0, 7), 20, *range(40, 100)]] = True
    assert np.array_equal(memory[touched], 2 * before[touched])
    assert np.array_equal(memory[~touched], before[~touched])
    with pytest.raises(ValueError, match="fused holds 268 bytes, the arrays 272"):
        copies.gather(fused[:67], addresses, counts, 4)
    with pytest.raises(ValueError, match="4 addresses but 3 counts"):
        copies.scatter(fused, addresses, counts[:3], 4)
    with pytest.raises(ValueError, match="int64"):
        copies.gather(fused, addresses.astype(np.int32), counts, 4)


def test_plain_arrays_are_packed_by_address():
    rng = np.random.default_rng()
    xs = [rng.standard_normal(n).astype(np.float32) for n in (5, 3, 0, 8)]
    xs.append(rng.standard_normal((2, 3)).astype(np.float32))
    _, (g,) = fusion.prepare(xs, ReduceOp.SUM, "x")
    assert g.addresses == [addr(x) for x in xs] and g.hosts == xs and g.total == 22
    addresses, counts = fusion.host_table(g)
    assert addresses.tolist() == g.addresses and counts.tolist() == [5, 3, 0, 8, 6]
    assert fusion.host_table(g)[0] is addresses  # once per call
    before = [x.copy() for x in xs]
    fused = np.zeros(30, np.float32)
    fusion.pack_host(g, fused)
    fusion.unpack_host(g, -fused)
    for x, b in zip(xs, before):
        assert x.shape == b.shape and np.array_equal(x, -b)
    # a view or another dtype: checked array by array, without addresses
    for others in ([xs[0], xs[1][1:]], [xs[0], np.zeros(2)]):
        _, groups = fusion.prepare(others, ReduceOp.SUM, "x")
        assert all(g.addresses is None for g in groups)
    with pytest.raises(InvalidArgument, match=r"arrays\[0\] and arrays\[2\] are the same"):
        fusion.prepare([xs[0], xs[1], xs[0]], ReduceOp.SUM, "x")
