"""The in-place all_gather on device arrays (x is this rank's block of out, NCCL's rule): every
device transport reads x where it lies, after the work queued before the call on the caller's
stream, with no copy of x; the result is right and nothing next to out is written.

Run on a GPU machine: `mpirun -n 2 python -m mpi4py -m pytest --with-mpi tests/gpu` (and -n 4).
"""

from __future__ import annotations

import numpy as np
import pytest

from hetcomm import general
from hetcomm.testing import assert_all_ranks

cupy = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")

PAD = 64  # guard elements on each side of out
COUNTS = (1, 1000, 300_001)  # a shared-segment size, a ring-sized one
SETUPS = {
    "staged": {"transport": "staged", "vendors": ("nvidia", "amd")},
    "direct": {"transport": "direct"},
    "hier": {"transport": "hier", "vendors": ("nvidia", "amd")},
    "nccl": {"transport": "nccl"},
}


def _group(world, setup):
    """The group the test runs on: nccl's ranks each on a device of their own (alone where
    the machine has one GPU: NCCL refuses two ranks on one device), else the world."""
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
def test_own_block_is_read_in_place(
    hetcomm_make_comm, hetcomm_shared_seed, monkeypatch, setup, kind
) -> None:
    world = hetcomm_make_comm(**SETUPS[setup])
    comm = _group(world, setup)
    copies: list[int] = []
    real = general.contiguous_in

    def counting(b, copy=False):
        if copy:
            copies.append(b.nbytes)
        return real(b, copy)

    monkeypatch.setattr(general, "contiguous_in", counting)
    n, r = comm.size, comm.rank
    rng = np.random.default_rng(hetcomm_shared_seed)
    problems = []
    try:
        for dtype in ("float32", "int64"):
            for count in COUNTS:
                for asynchronous in (False, True):
                    case = f"{dtype}[{count}] {'async' if asynchronous else 'blocking'}"
                    data = rng.integers(-100, 100, (n, count)).astype(np.float64)
                    backing = _backing(kind, n * count + 2 * PAD, dtype)
                    out = backing[PAD : PAD + n * count]
                    x = out[r * count : (r + 1) * count]
                    _write_late(x, data[r], kind)
                    w = comm.all_gather(out, x, async_op=asynchronous)
                    if w is not None:
                        w.wait(timeout=60)
                    got = _host(backing)
                    if not np.array_equal(got[PAD:-PAD], data.reshape(-1)):
                        problems.append(f"{case}: wrong result")
                    if not ((got[:PAD] == -3).all() and (got[-PAD:] == -3).all()):
                        problems.append(f"{case}: wrote outside out")
        if copies:
            problems.append(f"the input was copied ({copies[:4]} bytes)")
        assert_all_ranks(comm, not problems, "; ".join(problems[:6]))
    finally:
        if comm is not world:
            comm.close()
