"""The in-place all_gather (x is this rank's block of out) and reduce_scatter (out is this
rank's block of x) on device arrays, NCCL's rules: every device transport serves them as they
are, after the work queued before the call on the caller's stream, with no copy of x made by
the communicator; the result is right and nothing but out is written. On staged the in-place
all_to_all too, where the shared segment holds its size.

Run on a GPU machine: `mpirun -n 2 python -m mpi4py -m pytest --with-mpi tests/gpu` (and -n 4).
"""

from __future__ import annotations

import numpy as np
import pytest

from hetcomm import introspect
from hetcomm.testing import assert_all_ranks

cupy = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")

PAD = 64  # guard elements on each side of out
COUNTS = (1, 1000, 300_001)  # a shared-segment size, a ring-sized one
SETUPS = {
    "staged": {"transport": "staged", "vendors": ("nvidia", "amd")},
    "direct": {"transport": "direct"},
    "direct-peers": {"transport": "direct"},  # every rank reduces its own part (no leader)
    "hier": {"transport": "hier", "vendors": ("nvidia", "amd")},
    "nccl": {"transport": "nccl"},
}


def _group(world, setup):
    """The group the test runs on: nccl's ranks each on a device of their own (alone where
    the machine has one GPU: NCCL refuses two ranks on one device), else the world; for
    direct-peers, with the shared-GPU leader turned off (the path of ranks on their own GPUs)."""
    if setup == "direct-peers":
        t = introspect.transport_of(world, "reduce_scatter", cupy.zeros(2))
        assert t.name == "direct"
        t.shared = False
    if setup != "nccl":
        return world
    ndev = cupy.cuda.runtime.getDeviceCount()
    return world.split(world.rank // ndev, name=f"gpus{world.rank // ndev}")


def _backing(kind, n, dtype):
    if kind == "torch":
        return torch.full((n,), -3, dtype=getattr(torch, dtype), device="cuda")
    return cupy.full(n, -3, dtype=dtype)


def _host(a):
    if isinstance(a, torch.Tensor):
        return a.double().cpu().numpy()
    return cupy.asnumpy(a).astype(np.float64)


def _write_late(x, values, kind):
    """x = values, by work queued on the caller's current stream behind a long kernel, so the
    transport must order its read after that stream."""
    if kind == "torch":
        stream = torch.cuda.current_stream()
        torch.cuda._sleep(2_000_000)
        x.copy_(torch.from_numpy(values).to(device="cuda", dtype=x.dtype, non_blocking=True))
        return stream
    busy = cupy.ones(1 << 20, cupy.float32)
    for _ in range(20):
        busy = busy * 1.0001
    x[...] = cupy.asarray(values.astype(x.dtype))
    return cupy.cuda.get_current_stream()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("kind", ["cupy", "torch"])
@pytest.mark.parametrize("op", ["all_gather", "reduce_scatter"])
def test_own_block_is_served_in_place(
    hetcomm_make_comm, hetcomm_shared_seed, input_copies, setup, kind, op
) -> None:
    world = hetcomm_make_comm(**SETUPS[setup])
    comm = _group(world, setup)
    copies = input_copies
    n, r = comm.size, comm.rank
    rng = np.random.default_rng(hetcomm_shared_seed)
    call = getattr(comm, op)
    problems = []
    try:
        for dtype in ("float32", "int64"):
            for count in COUNTS:
                mine = slice(PAD + r * count, PAD + (r + 1) * count)
                for asynchronous in (False, True):
                    case = f"{op} {dtype}[{count}] {'async' if asynchronous else 'blocking'}"
                    data = rng.integers(-100, 100, (n, n * count)).astype(np.float64)
                    backing = _backing(kind, n * count + 2 * PAD, dtype)
                    whole = backing[PAD : PAD + n * count]
                    want = np.full(n * count + 2 * PAD, -3.0)
                    if op == "all_gather":
                        out, x = whole, backing[mine]
                        _write_late(x, data[r, :count], kind)
                        want[PAD:-PAD] = data[:, :count].reshape(-1)
                    else:
                        out, x = backing[mine], whole
                        _write_late(x, data[r], kind)
                        want[PAD:-PAD] = data[r]  # x's other blocks stay as they are
                        want[mine] = data[:, mine.start - PAD : mine.stop - PAD].sum(0)
                    w = call(out, x, async_op=asynchronous)
                    if w is not None:
                        w.wait(timeout=60)
                    bad = np.flatnonzero(_host(backing) != want)
                    if bad.size:
                        problems.append(f"{case}: {bad.size} wrong, first at {bad[:3]}")
        if copies:
            problems.append(f"the input was copied ({copies[:4]} bytes)")
        assert_all_ranks(comm, not problems, "; ".join(problems[:6]))
    finally:
        if comm is not world:
            comm.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", ["cupy", "torch"])
def test_staged_in_place_all_to_all(hetcomm_make_comm, hetcomm_shared_seed, input_copies, kind):
    """all_to_all with out = x on staged: uncopied where the shared segment holds the size
    (x is staged whole before out is written), copied first where the rings take it; the
    input written late on the caller's stream, the result right either way."""
    comm = hetcomm_make_comm(**SETUPS["staged"])
    n, r = comm.size, comm.rank
    rng = np.random.default_rng(hetcomm_shared_seed)
    problems = []
    for count in COUNTS[1:]:
        warm = _backing(kind, n * count, "float32")
        comm.all_to_all(_backing(kind, n * count, "float32"), warm)  # the segment grows
        input_copies.clear()
        for asynchronous in (False, True):
            case = f"all_to_all float32[{count}] {'async' if asynchronous else 'blocking'}"
            data = rng.integers(-100, 100, (n, n * count)).astype(np.float64)
            backing = _backing(kind, n * count + 2 * PAD, "float32")
            x = backing[PAD : PAD + n * count]
            _write_late(x, data[r], kind)
            w = comm.all_to_all(x, x, async_op=asynchronous)
            if w is not None:
                w.wait(timeout=60)
            want = np.full(n * count + 2 * PAD, -3.0)
            want[PAD:-PAD] = data[:, r * count : (r + 1) * count].reshape(-1)
            bad = np.flatnonzero(_host(backing) != want)
            if bad.size:
                problems.append(f"{case}: {bad.size} wrong, first at {bad[:3]}")
        segment = introspect.transport_of(comm, "all_to_all", x).stages_input(
            "all_to_all", x.nbytes
        )
        if segment and input_copies:
            problems.append(f"{count}: the input was copied ({input_copies[:4]} bytes)")
        if not segment and len(input_copies) != 2:
            problems.append(f"{count}: {len(input_copies)} of 2 ring-sized inputs copied")
    assert_all_ranks(comm, not problems, "; ".join(problems[:6]))
