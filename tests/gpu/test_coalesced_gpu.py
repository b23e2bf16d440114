"""Tensor fusion on device arrays: the pack/unpack kernels alone, then all_reduce_coalesced under
mpirun with ranks sharing the GPU (`mpirun -n 2 python -m mpi4py -m pytest --with-mpi tests/gpu`,
and -n 4), three ways: staged (vendors simulated, so the plan picks it exactly as across a real
boundary), direct through the shared GPU's leader (the arrays reduced where they are), and
direct with the leader off (packed, as ranks on separate GPUs do).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from hetcomm import InvalidArgument, MismatchError, ReduceOp, introspect
from hetcomm.testing import assert_all_ranks
from hetcomm.transports.direct import schedule

cupy = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")

OPS = (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX)
SENTINEL = 77


def carve(backing: Any, layout: str, n: int) -> Any:
    """A view of `n` (or n x 3 / 2 x 3 x n) elements of `backing` in `layout`, off its ends."""
    if layout == "contiguous":
        return backing[5 : 5 + n]
    if layout == "strided":
        return backing[5 : 5 + 2 * n : 2]
    if layout == "reversed":
        return backing[5 : 5 + n][::-1]
    if layout == "transposed":
        m = backing[5 : 5 + 3 * n].reshape(3, n)
        return m.T if isinstance(m, cupy.ndarray) else m.t()
    if layout == "permuted":
        m = backing[5 : 5 + 6 * n].reshape(2, 3, n)
        return m.transpose(2, 0, 1) if isinstance(m, cupy.ndarray) else m.permute(2, 0, 1)
    raise ValueError(layout)


def backing_for(lib: str, dtype: str, n: int) -> Any:
    size = 6 * n + 10
    if lib == "torch":
        return torch.full((size,), SENTINEL, dtype=getattr(torch, dtype), device="cuda")
    return cupy.full(size, SENTINEL, dtype=dtype)


def to_host(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.to(torch.float64).cpu().numpy()
    if hasattr(x, "copy_to_host"):  # numba
        return x.copy_to_host().astype(np.float64)
    return cupy.asnumpy(x).astype(np.float64)


def fill(view: Any, values: np.ndarray) -> None:
    if isinstance(view, torch.Tensor):
        view.copy_(torch.from_numpy(values).to(view.dtype).to("cuda"))
    else:
        view[...] = cupy.asarray(values.astype(view.dtype))


def small_values(
    rng: np.random.Generator, dtype: str, shape: tuple[int, ...], n: int
) -> np.ndarray:
    """Inputs of `n` ranks that every dtype holds exactly, and whose products stay in range."""
    if dtype == "bool":
        return rng.integers(0, 2, (n, *shape)).astype(np.float64)
    low, high = (0, 3) if dtype == "uint8" else (-3, 3)
    return rng.integers(low, high, (n, *shape), endpoint=True).astype(np.float64)


def reduce_ref(stack: np.ndarray, op: ReduceOp, dtype: str) -> np.ndarray:
    if dtype == "bool":
        any_ = op in (ReduceOp.SUM, ReduceOp.MAX)
        return (stack.any(0) if any_ else stack.all(0)).astype(np.float64)
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        s = stack.sum(0)
        if op is ReduceOp.AVG:
            s = s / len(stack)
            if dtype not in ("float16", "bfloat16", "float32", "float64"):
                s = np.trunc(s)
        return s
    if op is ReduceOp.PROD:
        return stack.prod(0)
    return stack.min(0) if op is ReduceOp.MIN else stack.max(0)


# ---- the kernels on one GPU (no MPI) ------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["uint8", "float16", "float32", "float64"])
def test_pack_unpack_kernels(dtype: str) -> None:
    """One pack launch over contiguous, strided, reversed, transposed, permuted, empty and
    9-dim arrays gives numpy's concatenation; one unpack writes each back and nothing else."""
    from hetcomm.kernels import fusion as fusion_kernels

    rng = np.random.default_rng(3)
    backings, views = [], []
    for layout in ("contiguous", "strided", "reversed", "transposed", "permuted"):
        for n in (1, 7, 3000):
            b = cupy.full(6 * n + 10, SENTINEL, dtype=dtype)
            views.append(carve(b, layout, n))
            backings.append(b)
    b = cupy.full(1034, SENTINEL, dtype=dtype)
    views.append(b[5:517].reshape((2,) * 9)[:, ::-1, :, ::-1, :, ::-1, :, ::-1])  # 9 dims: slow
    views.append(b[600:600])
    backings.append(b)
    for v in views:
        v[...] = cupy.asarray(rng.integers(0, 50, v.shape).astype(dtype))
    before = [cupy.asnumpy(x) for x in backings]
    entries, off = [], 0
    item = np.dtype(dtype).itemsize
    for v in views:
        entries.append((v.data.ptr, off, v.size, v.shape, tuple(s // item for s in v.strides)))
        off += v.size
    stream = cupy.cuda.get_current_stream()
    packed = fusion_kernels.shared().pack(entries, off, item, None, [stream.ptr])
    fused = cupy.ndarray(
        (off,),
        dtype,
        cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(packed.ptr, off * item, packed), 0),
    )
    want = np.concatenate([cupy.asnumpy(v).reshape(-1) for v in views])
    assert np.array_equal(cupy.asnumpy(fused), want)
    fused[...] = fused + 1
    packed.unpack()
    stream.synchronize()
    for b, old in zip(backings, before):
        now, outside = cupy.asnumpy(b), old == SENTINEL
        assert np.array_equal(now[outside], old[outside])
        assert np.array_equal(now[~outside], old[~outside] + 1)
    got = np.concatenate([cupy.asnumpy(v).reshape(-1) for v in views])
    assert np.array_equal(got, want + 1)


def test_pack_waits_for_every_stream() -> None:
    """Arrays used on two streams: the pack waits for both; both see the unpacked result."""
    from hetcomm.kernels import fusion as fusion_kernels

    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(s1):
        a = torch.zeros(1 << 22, device="cuda")
        torch.cuda._sleep(20_000_000)
        a.add_(1)
    with torch.cuda.stream(s2):
        b = torch.zeros(1 << 20, device="cuda")
        torch.cuda._sleep(20_000_000)
        b.add_(2)
    entries = [
        (a.data_ptr(), 0, a.numel(), (a.numel(),), (1,)),
        (b.data_ptr(), a.numel(), b.numel(), (b.numel(),), (1,)),
    ]
    total = a.numel() + b.numel()
    packed = fusion_kernels.shared().pack(
        entries, total, 4, torch.cuda.current_device(), [s1.cuda_stream, s2.cuda_stream]
    )
    fused = torch.as_tensor(
        cupy.ndarray(
            (total,),
            cupy.float32,
            cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(packed.ptr, total * 4, packed), 0),
        ),
        device="cuda",
    )
    s1.synchronize()
    assert float(fused[: a.numel()].min()) == 1.0 and float(fused[a.numel() :].min()) == 2.0
    with torch.cuda.stream(s1):
        fused.mul_(10)
    packed.unpack()
    with torch.cuda.stream(s2):
        bb = b * 1  # queued after the unpack on s2's side
    torch.cuda.synchronize()
    assert float(a.min()) == 10.0 and float(bb.min()) == 20.0


# ---- all_reduce_coalesced under mpirun ----------------------------------------------------------

PATHS = ["staged", "direct leader", "direct peers"]


def _comm(make: Any, path: str) -> tuple[Any, Any]:
    """A communicator whose device collectives take `path`, and its direct transport (None for
    staged); "direct peers" turns the shared GPU's leader off."""
    if path == "staged":
        return make(transport="staged", vendors=("nvidia", "amd")), None
    comm = make(transport="direct")
    t = introspect.transport_of(comm, "all_reduce", cupy.zeros(1))
    assert t.name == "direct"
    if path == "direct peers":
        t.shared = False
    return comm, t


def _led(t: Any) -> int:
    return t.stats()["led"] if t is not None else 0


def _leader_problems(t: Any, path: str, before: int) -> list[str]:
    """Whether the calls since `before` went through the shared GPU's leader, as `path` says."""
    made = _led(t) - before
    if path == "direct leader" and t.shared and not made:
        return ["no call went through the leader"]
    if path != "direct leader" and made:
        return [f"{made} calls went through the leader ({path})"]
    return []


ARRAYS = [  # (library, dtype, layout, n)
    ("cupy", "float32", "contiguous", 1000),
    ("cupy", "int32", "strided", 33),
    ("cupy", "float64", "transposed", 5),
    ("torch", "bfloat16", "contiguous", 17),
    ("torch", "float16", "permuted", 4),
    ("torch", "int64", "transposed", 9),
    ("cupy", "uint8", "reversed", 12),
    ("torch", "bool", "strided", 10),
    ("cupy", "float32", "contiguous", 0),
    ("cupy", "float32", "contiguous", 1),
    ("torch", "float32", "contiguous", 70_000),
    ("numba", "int16", "contiguous", 8),
    ("numpy", "float32", "contiguous", 6),
]


class Item:
    def __init__(
        self,
        rng: np.random.Generator,
        size: int,
        rank: int,
        lib: str,
        dtype: str,
        layout: str,
        n: int,
    ) -> None:
        self.lib, self.dtype, self.what = lib, dtype, f"{lib} {dtype} {layout} {n}"
        if lib == "numba":
            from numba import cuda

            self.stack = small_values(rng, dtype, (n,), size)
            self.backing = None
            self.array: Any = cuda.to_device(self.stack[rank].astype(dtype))
            return
        if lib == "numpy":
            self.stack = small_values(rng, dtype, (n,), size)
            self.backing = None
            self.array = self.stack[rank].astype(dtype)
            return
        self.backing = backing_for(lib, dtype, n)
        self.array = carve(self.backing, layout, n)
        self.stack = small_values(rng, dtype, tuple(self.array.shape), size)
        fill(self.array, self.stack[rank])
        self.before = to_host(self.backing)

    def problems(self, op: ReduceOp) -> list[str]:
        got = to_host(self.array) if self.lib != "numpy" else self.array.astype(np.float64)
        want = reduce_ref(self.stack, op, self.dtype)
        tol = 1e-2 if self.dtype in ("float16", "bfloat16") else 1e-6
        out = []
        if not np.allclose(got, want, rtol=tol, atol=tol):
            out.append(f"{op} {self.what}: wrong result")
        if self.backing is not None:
            now = to_host(self.backing)
            outside = self.before == SENTINEL
            if not np.array_equal(now[outside], self.before[outside]):
                out.append(f"{op} {self.what}: wrote outside the array")
        return out


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("async_op", [False, True])
def test_every_op_mixed_device_and_host(
    hetcomm_make_comm, hetcomm_shared_seed, async_op, path
) -> None:
    """Every reduce op over arrays of every library, dtype and layout (host arrays beside
    them where the path moves host memory too), checked against numpy, and nothing outside
    the arrays written."""
    comm, t = _comm(hetcomm_make_comm, path)
    rng = np.random.default_rng(hetcomm_shared_seed)
    problems: list[str] = []
    before = _led(t)
    for op in OPS:
        items = [
            Item(rng, comm.size, comm.rank, *spec)
            for spec in ARRAYS
            if not (op is ReduceOp.AVG and spec[1] == "bool")
            and not (t is not None and spec[0] == "numpy")  # direct moves device memory
        ]
        work = comm.all_reduce_coalesced([i.array for i in items], op, async_op=async_op)
        if work is not None:
            work.wait()
        torch.cuda.synchronize()
        for item in items:
            problems += item.problems(op)
    problems += _leader_problems(t, path, before)
    assert_all_ranks(comm, not problems, "; ".join(problems[:6]))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "dtype, op",
    [
        ("float32", ReduceOp.SUM),
        ("float32", ReduceOp.AVG),
        ("bfloat16", ReduceOp.SUM),
        ("float16", ReduceOp.MIN),
        ("int64", ReduceOp.MAX),
    ],
)
def test_many_arrays_of_one_dtype(hetcomm_make_comm, hetcomm_shared_seed, path, dtype, op) -> None:
    """More arrays of one dtype than a launch's table of pieces holds (the shared GPU's
    leader reduces the small ones PIECES at a time, direct/schedule.py), of 1 to 3000
    elements and one past the table's size limit, in one call: every one as numpy says,
    nothing beside them written, on every path."""
    comm, t = _comm(hetcomm_make_comm, path)
    rng = np.random.default_rng(hetcomm_shared_seed)
    sizes = [int(n) for n in rng.integers(1, 3000, 2 * schedule.PIECES + 5)]
    sizes[7] = schedule.TABLE_BYTES // np.dtype(dtype if dtype != "bfloat16" else "f2").itemsize + 3
    libs = ["torch"] if dtype == "bfloat16" else ["cupy", "torch"]
    items = [
        Item(rng, comm.size, comm.rank, libs[i % len(libs)], dtype, "contiguous", n)
        for i, n in enumerate(sizes)
    ]
    before = _led(t)
    comm.all_reduce_coalesced([i.array for i in items], op)
    torch.cuda.synchronize()
    problems = [p for item in items for p in item.problems(op)]
    problems += _leader_problems(t, path, before)
    assert_all_ranks(comm, not problems, "; ".join(problems[:6]))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("strided", [True, False], ids=["one strided", "contiguous"])
def test_stream_order(hetcomm_make_comm, path, strided) -> None:
    """Work queued before the call is seen by it; work queued after wait() sees the result."""
    comm, _ = _comm(hetcomm_make_comm, path)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        xs = [torch.zeros(n, device="cuda") for n in (8 << 20, 3, 1000)]
        torch.cuda._sleep(20_000_000)  # keep the stream busy: the adds below land late
        for x in xs:
            x.add_(comm.rank + 1)
        middle = xs[1][::2] if strided else xs[1]
        work = comm.all_reduce_coalesced([xs[0], middle, xs[2]], async_op=True)
        work.wait()
        ys = [x * 2 for x in xs]  # queued after wait(): must see the reduced values
    stream.synchronize()
    want = 2.0 * sum(range(1, comm.size + 1))
    ok = bool((ys[0] == want).all()) and bool((ys[2] == want).all())
    mid = [want, 2.0 * (comm.rank + 1), want] if strided else [want] * 3
    ok = ok and ys[1].tolist() == mid
    assert_all_ranks(comm, ok, f"expected {want} after the all_reduce_coalesced")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("path", ["staged", "direct leader"])
@pytest.mark.parametrize("odd_strided", [False, True], ids=["contiguous", "odd ranks packed"])
def test_ranks_that_cut_one_total_in_different_places(hetcomm_make_comm, odd_strided, path) -> None:
    """Arrays moved where they are (the ranks share the GPU), each rank giving two arrays of
    one total cut in a place of its own (on odd ranks the first one strided, so packed):
    every rank gets the element-wise sum of the concatenations, as a fused buffer would give,
    and nothing beside the arrays moves."""
    comm, t = _comm(hetcomm_make_comm, path)
    n, r = comm.size, comm.rank
    total = 40
    data = np.random.default_rng(11).integers(-5, 5, (n, total)).astype(np.float32)
    cut = 7 + 5 * r
    step = 2 if odd_strided and r % 2 else 1
    backing = cupy.full(3 * total + 10, SENTINEL, dtype=cupy.float32)
    where = [np.arange(2, 2 + step * cut, step), np.arange(2 * total + 5, 3 * total + 5 - cut)]
    first = backing[2 : 2 + step * cut : step]
    second = backing[2 * total + 5 : 3 * total + 5 - cut]
    first[...] = cupy.asarray(data[r, :cut])
    second[...] = cupy.asarray(data[r, cut:])
    before = cupy.asnumpy(backing)
    outside = np.ones(before.size, bool)
    outside[np.concatenate(where)] = False
    led = _led(t)
    comm.all_reduce_coalesced([first, second])
    got = np.concatenate([cupy.asnumpy(first), cupy.asnumpy(second)])
    problems = []
    if not np.array_equal(got, data.sum(0)):
        problems.append(f"wrong sum: {got.tolist()} against {data.sum(0).tolist()}")
    if not np.array_equal(cupy.asnumpy(backing)[outside], before[outside]):
        problems.append("wrote outside the arrays")
    problems += _leader_problems(t, path, led)
    assert_all_ranks(comm, not problems, "; ".join(problems))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("path", ["staged", "direct leader"])
def test_other_counts_of_arrays_raise_on_every_rank(hetcomm_make_comm, path) -> None:
    """Arrays moved where they are, rank 0 giving one array and the others two of the same
    total: a MismatchError naming the arrays on every rank, before any element moves."""
    comm, _ = _comm(hetcomm_make_comm, path)
    x0 = cupy.zeros(1, dtype=cupy.float32)
    if not introspect.transport_of(comm, "all_reduce", x0).reduces_arrays:
        pytest.skip("the ranks do not share one GPU: the arrays are packed")
    x = cupy.arange(6, dtype=cupy.float32) + comm.rank
    arrays = [x] if comm.rank == 0 else [x[:2], x[2:]]
    said = ""
    try:
        comm.all_reduce_coalesced(arrays)
    except MismatchError as exc:
        said = str(exc)
    ok = "arrays differs" in said and cupy.asnumpy(x).tolist() == list(
        range(comm.rank, comm.rank + 6)
    )
    assert_all_ranks(comm, ok, f"expected a MismatchError naming the arrays, got {said!r}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("path", PATHS)
def test_bad_device_calls(hetcomm_make_comm, path) -> None:
    comm, _ = _comm(hetcomm_make_comm, path)
    x = cupy.arange(10, dtype=cupy.float32)
    problems = []
    for what, arrays in (
        ("twice", [x, x]),
        ("overlap", [x[0:6], x[4:8]]),
        ("strided overlap", [x[::3], x[3:4]]),
    ):
        try:
            comm.all_reduce_coalesced(arrays)
            problems.append(f"{what}: accepted")
        except InvalidArgument:
            pass
    if cupy.asnumpy(x).tolist() != list(range(10)):
        problems.append("an array changed")
    if torch.cuda.device_count() > 1:
        y = torch.zeros(3, device="cuda:1")
        try:
            comm.all_reduce_coalesced([torch.zeros(3, device="cuda:0"), y])
            problems.append("two devices: accepted")
        except InvalidArgument as exc:
            if "one device" not in str(exc):
                problems.append(f"two devices: {exc}")
    interleaved = cupy.zeros(10, dtype=cupy.float32)
    comm.all_reduce_coalesced([interleaved[::2], interleaved[1::2]])  # disjoint: accepted
    assert_all_ranks(comm, not problems, "; ".join(problems))
