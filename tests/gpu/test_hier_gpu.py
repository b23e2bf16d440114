"""The hier transport on device arrays (CuPy, torch CUDA), ranks sharing the GPU under mpirun.

Run on a GPU machine: `mpirun -n 2 python -m mpi4py -m pytest --with-mpi tests/gpu` (and -n 4).
Vendors (and hosts) are simulated per rank by `make_comm`, so the groups span islands exactly
as across a real vendor boundary: the plan picks hier for device collectives by itself, and the
parts inside hier pick their own transports (staged where ranks share one GPU).
"""

from __future__ import annotations

import hashlib
from typing import Any, ClassVar

import numpy as np
import pytest
from _refs import reference as _reduce
from _refs import small_values as _values
from _stream_contract import StreamContract

from hetcomm import ReduceOp, introspect
from hetcomm.testing import assert_all_ranks

cupy = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")

DTYPES = ("bool", "int8", "int32", "int64", "uint8", "float16", "bfloat16", "float32", "float64")
OPS = (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX)
# rank i gets vendors[i % len]: on 4 ranks "pairs" makes islands (0, 2) and (1, 3), "three-one"
# makes (0, 1, 3) and (2,), "hosts" four islands of one rank
SETUPS = {
    "pairs": {"vendors": ("nvidia", "amd")},
    "three-one": {"vendors": ("nvidia", "nvidia", "amd", "nvidia")},
    "hosts": {"vendors": ("nvidia", "amd"), "hosts": ("ha", "ha", "hb", "hb")},
}


def _to_device(values: np.ndarray, dtype: str, kind: str) -> object:
    if kind == "torch":
        return torch.from_numpy(values).to(getattr(torch, dtype)).to("cuda")
    return cupy.asarray(values.astype(dtype))


def _to_numpy(x: object) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.to(torch.float64).cpu().numpy()
    return cupy.asnumpy(x).astype(np.float64)


def _bits(x: object) -> bytes:
    if isinstance(x, torch.Tensor):
        return x.cpu().view(torch.uint8).numpy().tobytes()
    return cupy.asnumpy(x).tobytes()


def _close(got: np.ndarray, want: np.ndarray, dtype: str, op: ReduceOp) -> bool:
    if op is ReduceOp.AVG and dtype in ("float16", "bfloat16"):
        return bool(np.allclose(got, want, rtol=1e-2, atol=1e-2))
    return bool(np.array_equal(got, want))  # small integers: every other result is exact


def _own_devices(comm, island) -> bool:
    """Whether the island's ranks are on distinct devices (rank r on device r % devices)."""
    return len({comm.topology.ranks[r].device for r in island}) == len(island)


@pytest.mark.mpi(min_size=4)
def test_islands_of_own_gpus_reduce_through_nccl(hetcomm_make_comm, hetcomm_shared_seed) -> None:
    """Ranks 0-1 'nvidia' and 2-3 'amd' (RCCL's part played by NCCL): on a machine that gives
    each member of an island a GPU of its own, the islands reduce through NCCL; where they share
    one, through another transport. The result is exact either way."""
    comm = hetcomm_make_comm(transport="hier", vendors=("nvidia", "nvidia", "amd", "amd"))
    n, r = comm.size, comm.rank
    rng = np.random.default_rng(hetcomm_shared_seed)
    data = rng.integers(-1000, 1000, size=(n, 3 * n + 5)).astype(np.float32)
    x = torch.from_numpy(data[r]).cuda()
    comm.all_reduce(x)
    ok = np.array_equal(x.cpu().numpy().astype(np.float64), data.astype(np.float64).sum(0))
    hier = introspect.transports(comm)["hier"]
    own = _own_devices(comm, hier.islands[hier.index])
    inside = hier.island.plan.lookup("all_reduce", "device", "large")[0]
    assert_all_ranks(
        comm,
        ok and (inside == "nccl") == own,
        f"sum {'right' if ok else 'wrong'}; own devices {own}, inside {inside}",
    )


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("setup", list(SETUPS))
def test_plan_picks_hier_for_device_collectives(hetcomm_make_comm, setup) -> None:
    """Islands on several (simulated) hosts go hier; on one host whose GPUs map each other's
    memory (simulated vendors sharing one GPU), direct serves them in one hop instead."""
    comm = hetcomm_make_comm(**SETUPS[setup])
    islands = comm.topology.islands()
    choice = comm.plan.lookup("all_reduce", "device", "large")
    if len(set(comm.topology.hosts())) == 1:
        # one island whose ranks each have a GPU of their own: NCCL; else direct
        ok = choice[0] == (
            "nccl" if len(islands) == 1 and _own_devices(comm, islands[0]) else "direct"
        )
    elif len(islands) > 1:
        ok = choice == (
            "hier",
            f"{len(islands)} vendor islands: native inside, staged/direct between",
        )
    else:
        ok = choice[0] != "hier"
    assert_all_ranks(comm, ok, f"islands {islands}: plan {choice}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("kind", ["cupy", "torch"])
def test_every_collective(hetcomm_make_comm, hetcomm_shared_seed, setup, kind) -> None:
    comm = hetcomm_make_comm(transport="hier", **SETUPS[setup])
    n, r = comm.size, comm.rank
    rng = np.random.default_rng(hetcomm_shared_seed)
    problems = []
    digest = hashlib.sha256()
    for dtype in DTYPES:
        if kind == "cupy" and dtype == "bfloat16":
            continue  # cupy has no bfloat16: torch covers it
        for count in (1, 4 * n + 3, 300_001):
            data = np.stack([_values(rng, dtype, (count * n,)) for _ in range(n)])
            for op in OPS:
                if dtype == "bool" and op is ReduceOp.AVG:
                    continue
                x = _to_device(data[r, :count], dtype, kind)
                comm.all_reduce(x, op)
                if not _close(_to_numpy(x), _reduce(data[:, :count], op, dtype), dtype, op):
                    problems.append(f"all_reduce {dtype}[{count}] {op}")
                digest.update(_bits(x))
                xs = _to_device(data[r], dtype, kind)
                out = _to_device(np.zeros(count), dtype, kind)
                comm.reduce_scatter(out, xs, op)
                want = _reduce(data, op, dtype)[r * count : (r + 1) * count]
                if not _close(_to_numpy(out), want, dtype, op):
                    problems.append(f"reduce_scatter {dtype}[{count}] {op}")
                if not np.array_equal(_to_numpy(xs), data[r]):
                    problems.append(f"reduce_scatter {dtype}[{count}] {op}: x changed")
            x = _to_device(data[r, :count], dtype, kind)
            comm.broadcast(x, n - 1)
            if not np.array_equal(_to_numpy(x), data[n - 1, :count]):
                problems.append(f"broadcast {dtype}[{count}]")
            out = _to_device(np.zeros(count * n), dtype, kind)
            comm.all_gather(out, _to_device(data[r, :count], dtype, kind))
            if not np.array_equal(_to_numpy(out), data[:, :count].reshape(-1)):
                problems.append(f"all_gather {dtype}[{count}]")
    digests = comm.mpi.allgather(digest.hexdigest())
    if len(set(digests)) != 1:
        problems.append("all_reduce results differ in their bits across ranks")
    assert_all_ranks(comm, not problems, ", ".join(problems[:10]))


class TestHierStreams(StreamContract):
    """The stream contract (tests/gpu/_stream_contract.py) on this module's communicators."""

    # the plan's own choice, as test_plan_picks_hier_for_device_collectives expects it: hier
    # where the islands span hosts; ranks of one host sharing a GPU get direct instead
    options: ClassVar[dict[str, Any]] = SETUPS["pairs"]
