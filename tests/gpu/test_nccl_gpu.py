"""The nccl transport on device arrays, under mpirun on a GPU machine.

Every op runs through NCCL on groups whose ranks each have a device of their own (rank r is on
device r % devices): of size 1 on a one-GPU machine (NCCL refuses two ranks on one device), of
as many ranks as GPUs on a larger one. A group in which ranks share a device is refused with the
reason.
"""

from __future__ import annotations

import numpy as np
import pytest
from _refs import reference as _ref
from _refs import small_values as _values
from _refs import wrapped as _wrap

from hetcomm import ReduceOp, TransportUnavailable, dtypes
from hetcomm.testing import assert_all_ranks

cupy = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")

DTYPES = dtypes.DTYPES  # every dtype of the API (tests/unit/test_dtypes.py pins them)
OPS = (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX)


def _own_gpu_group(world):
    """Groups of ranks on distinct devices (conftest puts rank r on device r % devices): ranks
    0..d-1 form one, d..2d-1 the next; each rank alone where the machine has one GPU."""
    ndev = cupy.cuda.runtime.getDeviceCount()
    return world.split(world.rank // ndev, name=f"gpus{world.rank // ndev}")


@pytest.fixture
def group_of(request):
    """group_of(world): _own_gpu_group(world), closed when the test ends."""
    made = []

    def make(world):
        made.append(_own_gpu_group(world))
        return made[-1]

    yield make
    for g in made:
        g.close()


def _tensor(values, dtype):
    return torch.from_numpy(values).to(getattr(torch, dtype)).cuda()


@pytest.mark.mpi(min_size=1)
def test_every_op_through_nccl(hetcomm_make_comm, group_of, hetcomm_shared_seed):
    world = hetcomm_make_comm(transport="nccl")
    group = group_of(world)
    n, r = group.size, group.rank
    rng = np.random.default_rng(hetcomm_shared_seed + world.rank // max(n, 1))
    problems = []
    side = torch.cuda.Stream()  # the ops follow the caller's current stream, not the default one
    with torch.cuda.stream(side):
        for dtype in DTYPES:
            count = 3 * n + 2
            data = np.stack([_values(rng, dtype, count * n) for _ in range(n)])
            for op in OPS:
                if dtype == "bool" and op is ReduceOp.AVG:
                    continue
                x = _tensor(data[r], dtype)
                out = torch.empty_like(x)
                group.all_reduce(x, op, out=out)
                want = _wrap(_ref(data, op, dtype), dtype)
                if not np.allclose(out.double().cpu().numpy(), want, rtol=1e-2):
                    problems.append(f"all_reduce {dtype} {op}")
                if not np.array_equal(x.double().cpu().numpy(), data[r]):
                    problems.append(f"all_reduce {dtype} {op}: input changed")
                y = _tensor(data[r], dtype)
                group.reduce(y, 0, op)
                got = y.double().cpu().numpy()
                if not np.allclose(got, want if r == 0 else data[r], rtol=1e-2):
                    problems.append(f"reduce {dtype} {op}")
                blocks = torch.empty(count, dtype=x.dtype, device="cuda")
                group.reduce_scatter(blocks, _tensor(data[r], dtype), op)
                if not np.allclose(
                    blocks.double().cpu().numpy(), want[r * count : (r + 1) * count], rtol=1e-2
                ):
                    problems.append(f"reduce_scatter {dtype} {op}")
            b = _tensor(data[r], dtype)
            group.broadcast(b, 0)
            if not np.array_equal(b.double().cpu().numpy(), data[0]):
                problems.append(f"broadcast {dtype}")
            part = _tensor(data[r][:count], dtype)
            gathered = torch.empty(count * n, dtype=part.dtype, device="cuda")
            group.all_gather(gathered, part)
            if not np.array_equal(gathered.double().cpu().numpy(), data[:, :count].reshape(-1)):
                problems.append(f"all_gather {dtype}")
            a2a = torch.empty_like(_tensor(data[r], dtype))
            group.all_to_all(a2a, _tensor(data[r], dtype))
            want_a2a = np.concatenate([data[i].reshape(n, count)[r] for i in range(n)])
            if not np.array_equal(a2a.double().cpu().numpy(), want_a2a):
                problems.append(f"all_to_all {dtype}")
    group.barrier()
    plan = str(group.plan)
    if "nccl" not in plan:
        problems.append(f"plan does not name nccl:\n{plan}")
    assert_all_ranks(world, not problems, "; ".join(problems[:8]))


@pytest.mark.mpi(min_size=1)
def test_cupy_arrays_and_async(hetcomm_make_comm, group_of, hetcomm_shared_seed):
    world = hetcomm_make_comm(transport="nccl")
    group = group_of(world)
    rng = np.random.default_rng(hetcomm_shared_seed)
    data = rng.standard_normal((group.size, 1 << 20)).astype(np.float32)
    x = cupy.asarray(data[group.rank])
    work = group.all_reduce(x, async_op=True)
    work.wait()
    ok = np.allclose(cupy.asnumpy(x), data.sum(0), rtol=1e-5, atol=1e-5)
    assert_all_ranks(world, ok and work.test(), "cupy all_reduce through nccl")


@pytest.mark.mpi(min_size=2)
def test_dropped_communicators_do_not_hang(hetcomm_make_comm):
    """Communicators dropped without close(), in opposite orders on the two ranks of a pair:
    their NCCL communicators must not be destroyed by the garbage collector (ncclCommDestroy
    waits for the other ranks, and each rank collects at its own moments and in its own order),
    so the ranks go on; they are aborted at exit instead (nccl.abort_left_over)."""
    import gc
    import weakref

    from hetcomm.transports import nccl

    world = hetcomm_make_comm(transport="nccl")
    if world.size > cupy.cuda.runtime.getDeviceCount():
        pytest.skip("needs two ranks on GPUs of their own: NCCL refuses two ranks on one GPU")
    groups = [_own_gpu_group(world) for _ in range(2)]
    for g in groups:
        x = cupy.full(8, g.rank + 1, dtype=cupy.float32)
        g.all_reduce(x)
        assert float(x[0]) == g.size * (g.size + 1) / 2
    del g  # the loop's name would keep the last group alive
    kept = len(nccl._LIVE)
    if world.rank % 2:
        groups.reverse()
    refs = [weakref.ref(g) for g in groups]
    while groups:
        groups.pop(0)
        gc.collect()
    # the communicators are gone; their NCCL communicators are kept, not destroyed
    assert_all_ranks(world, all(r() is None for r in refs), "a dropped group was not freed")
    assert_all_ranks(
        world,
        len(nccl._LIVE) == kept,
        f"NCCL communicators kept: {len(nccl._LIVE)}, before the drop: {kept}",
    )
    y = cupy.ones(4, dtype=cupy.float32)
    world.all_reduce(y)  # the ranks are not stuck: world (staged or other) still works
    assert_all_ranks(world, float(y[0]) == world.size, "all_reduce after the drop")


@pytest.mark.mpi(min_size=2)
def test_shared_gpu_is_refused_with_the_reason(hetcomm_make_comm):
    world = hetcomm_make_comm(transport="nccl")
    if world.size <= cupy.cuda.runtime.getDeviceCount():
        pytest.skip("every rank has a GPU of its own here")
    x = torch.ones(16, device="cuda")
    try:
        world.all_reduce(x)
        message = ""
    except TransportUnavailable as exc:
        message = str(exc)
    assert_all_ranks(
        world,
        "duplicate" in message and "share device" in message,
        f"expected a refusal naming the shared device, got {message!r}",
    )
    auto = hetcomm_make_comm()
    assert_all_ranks(
        world,
        auto.plan.lookup("all_reduce", "device", "large")[0] != "nccl",
        "the automatic plan chose nccl for a shared GPU",
    )
