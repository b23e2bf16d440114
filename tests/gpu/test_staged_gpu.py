"""The staged transport on device arrays (CuPy, torch CUDA), ranks sharing the GPU under mpirun.

Run on a GPU machine: `mpirun -n 2 python -m mpi4py -m pytest --with-mpi tests/gpu` (and -n 4).
Vendors and hosts are simulated, so the plan picks staged exactly as across a real boundary.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import pytest
from _refs import reference as _reduce
from _refs import small_values as _values
from _stream_contract import StreamContract

from hetcomm import ReduceOp
from hetcomm.testing import assert_all_ranks

cupy = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")

DTYPES = ("bool", "int8", "int32", "int64", "uint8", "float16", "bfloat16", "float32", "float64")
OPS = (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX)
SETUPS = {
    "vendors": {"vendors": ("nvidia", "amd")},
    "hosts": {"vendors": ("nvidia", "amd"), "hosts": ("ha", "hb")},
    "mpi-rail": {"vendors": ("nvidia", "amd"), "hosts": ("ha", "hb"), "rails": "mpi"},
}


def _to_device(values: np.ndarray, dtype: str, kind: str) -> object:
    if kind == "torch":
        return torch.from_numpy(values).to(getattr(torch, dtype)).to("cuda")
    if dtype == "bfloat16":
        t = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        return cupy.asarray(t)
    return cupy.asarray(values.astype(dtype))


def _to_numpy(x: object) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.to(torch.float64).cpu().numpy()
    return cupy.asnumpy(x).astype(np.float64)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("kind", ["cupy", "torch"])
def test_every_collective(hetcomm_make_comm, hetcomm_shared_seed, setup, kind) -> None:
    comm = hetcomm_make_comm(transport="staged", **SETUPS[setup])
    n, r = comm.size, comm.rank
    rng = np.random.default_rng(hetcomm_shared_seed)
    problems = []
    for dtype in DTYPES:
        if kind == "cupy" and dtype == "bfloat16":
            continue  # cupy has no bfloat16: torch covers it
        count = 4 * n + 3
        data = np.stack([_values(rng, dtype, count * n) for _ in range(n)])
        for op in OPS:
            if dtype == "bool" and op is ReduceOp.AVG:
                continue
            x = _to_device(data[r, :count], dtype, kind)
            comm.all_reduce(x, op)
            want = _reduce(data[:, :count], op, dtype)
            if not np.allclose(_to_numpy(x), want, rtol=1e-2, atol=1e-2):
                problems.append(f"all_reduce {dtype} {op}")
            xs = _to_device(data[r], dtype, kind)
            out = _to_device(np.zeros(count), dtype, kind)
            comm.reduce_scatter(out, xs, op)
            want = _reduce(data, op, dtype)[r * count : (r + 1) * count]
            if not np.allclose(_to_numpy(out), want, rtol=1e-2, atol=1e-2):
                problems.append(f"reduce_scatter {dtype} {op}")
        x = _to_device(data[r, :count], dtype, kind)
        comm.broadcast(x, n - 1)
        if not np.array_equal(_to_numpy(x), data[n - 1, :count]):
            problems.append(f"broadcast {dtype}")
        out = _to_device(np.zeros(count * n), dtype, kind)
        comm.all_gather(out, _to_device(data[r, :count], dtype, kind))
        if not np.array_equal(_to_numpy(out), data[:, :count].reshape(-1)):
            problems.append(f"all_gather {dtype}")
        out = _to_device(np.zeros(count * n), dtype, kind)
        comm.all_to_all(out, _to_device(data[r], dtype, kind))
        want = np.concatenate([data[s, r * count : (r + 1) * count] for s in range(n)])
        if not np.array_equal(_to_numpy(out), want):
            problems.append(f"all_to_all {dtype}")
    assert_all_ranks(comm, not problems, ", ".join(problems))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("nbytes", [0, 4, 4 << 20, (9 << 20) + 12])
def test_send_recv_sizes(hetcomm_make_comm, hetcomm_shared_seed, nbytes) -> None:
    comm = hetcomm_make_comm(transport="staged", vendors=("nvidia", "amd"))
    rng = np.random.default_rng(hetcomm_shared_seed)
    data = rng.integers(0, 255, nbytes, dtype=np.uint8)
    ok = True
    if comm.rank == 0:
        comm.send(cupy.asarray(data), 1, tag=5)
    elif comm.rank == 1:
        y = cupy.full(nbytes + 64, 7, dtype=cupy.uint8)
        comm.recv(y[:nbytes], 0, tag=5)
        got = cupy.asnumpy(y)
        ok = np.array_equal(got[:nbytes], data) and (got[nbytes:] == 7).all()
    assert_all_ranks(comm, ok, "payload or the bytes after it differ")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("memory", ["host to device", "device to host"])
@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "async"])
def test_send_recv_across_memories(hetcomm_make_comm, hetcomm_shared_seed, memory, blocking):
    """A large message from a host array into a device array (the receiver reads the sender's
    memory, then copies it up) and from a device array into a host one (over the rails behind
    a RAILS marker), each side's other bytes untouched; the device copy is on the caller's
    stream's side of the contract (visible to work queued after the call or the wait)."""
    comm = hetcomm_make_comm(transport="staged", vendors=("nvidia", "amd"))
    rng = np.random.default_rng(hetcomm_shared_seed)
    nbytes = (3 << 20) + 8
    data = rng.integers(0, 255, nbytes, dtype=np.uint8)
    host_sends = memory == "host to device"
    ok = True
    if comm.rank == 0:
        x = data.copy() if host_sends else cupy.asarray(data)
        work = comm.send(x, 1, tag=6, async_op=not blocking)
        if not blocking:
            work.wait()
        ok = np.array_equal(x if host_sends else cupy.asnumpy(x), data)  # the sender's array
    elif comm.rank == 1:
        if host_sends:
            y = cupy.full(nbytes + 64, 7, dtype=cupy.uint8)
        else:
            y = np.full(nbytes + 64, 7, dtype=np.uint8)
        work = comm.recv(y[:nbytes], 0, tag=6, async_op=not blocking)
        if not blocking:
            work.wait()
        got = cupy.asnumpy(y) if host_sends else y
        ok = np.array_equal(got[:nbytes], data) and (got[nbytes:] == 7).all()
    assert_all_ranks(comm, ok, f"{memory}: payload or the bytes around it differ")


class TestStagedStreams(StreamContract):
    """The stream contract (tests/gpu/_stream_contract.py) on this module's communicators."""

    options: ClassVar[dict[str, Any]] = {"transport": "staged", "vendors": ("nvidia", "amd")}
