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


def _p2p_counts(comm, op: str) -> tuple[int, int]:
    """(prepared runs, general-path uses) of every staged `op` route so far."""
    rows = [r for r in comm.routes() if r["op"] == op and r["transport"] == "staged"]
    return sum(r["runs"] for r in rows), sum(r["uses"] for r in rows)


@pytest.mark.mpi(min_size=2)
def test_prepared_device_send_recv(hetcomm_make_comm, hetcomm_shared_seed) -> None:
    """Blocking device sends and receives, repeated, take the resolved route (counted) and
    stay right as the signature changes between calls (count, dtype, array type, eager and
    rails sizes, the caller's stream with its data written late), beside an asynchronous
    receive in flight; nothing beside the receive buffer changes."""
    comm = hetcomm_make_comm(transport="staged", vendors=("nvidia", "amd"))
    r = comm.rank
    problems = []
    if r < 2:
        peer, pad = 1 - r, 32
        rng = np.random.default_rng(hetcomm_shared_seed)

        def exchange(kind, n, dtype, label, tag=7):
            data = rng.integers(0, 100, (2, n)).astype(np.float64)
            x = _to_device(data[r], dtype, kind)
            buf = _to_device(np.zeros(n + 2 * pad), dtype, kind)
            y = buf[pad:-pad]
            for first in (0, 1):
                if r == first:
                    comm.send(x, peer, tag=tag)
                else:
                    comm.recv(y, peer, tag=tag)
            got = _to_numpy(buf)
            if not np.array_equal(got[pad:-pad], data[peer]):
                problems.append(f"{label}: wrong data")
            if got[:pad].any() or got[-pad:].any():
                problems.append(f"{label}: wrote beside the receive buffer")

        runs0, uses0 = _p2p_counts(comm, "send")
        for _ in range(3):
            exchange("cupy", 1000, "float32", "cupy float32 x3")
        exchange("cupy", 1001, "float32", "new count")
        exchange("cupy", 1001, "int64", "new dtype")
        exchange("torch", 1001, "bfloat16", "torch bfloat16")
        exchange("torch", 70000, "float32", "torch 280 KB (rails)")
        exchange("cupy", 5, "int8", "5 bytes")
        runs1, uses1 = _p2p_counts(comm, "send")
        if runs1 - runs0 < 8 or uses1 != uses0:
            problems.append(f"sends: {runs1 - runs0} prepared, {uses1 - uses0} general")

        # a message that fits the ring's slot is copied on the caller's stream, with no event
        # recorded there; a larger one's chunks wait for one
        gpu = comm._transports.make("staged").staging()
        events = []
        record = gpu._recorded  # every event it records on a stream (ready_on, as_event)
        gpu._recorded = lambda stream: events.append(stream) or record(stream)
        try:
            exchange("cupy", 1000, "float32", "eager, events counted")
            eager = len(events)
            exchange("torch", 70000, "float32", "rails, events counted")
        finally:
            del gpu._recorded
        if eager or len(events) < 2:
            problems.append(f"events on the caller's stream: {eager} eager, {len(events)} in all")

        # the caller's stream: the data written behind a long kernel on a stream of its own
        data = rng.integers(0, 100, (2, 4096)).astype(np.float32)
        x = torch.zeros(4096, device="cuda")
        y = torch.zeros(4096, device="cuda")
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(20_000_000)
            x.copy_(torch.from_numpy(data[r]).to("cuda", non_blocking=True))
            for first in (0, 1):
                if r == first:
                    comm.send(x, peer, tag=8)
                else:
                    comm.recv(y, peer, tag=8)
            got = y.cpu().numpy()  # on the stream: after the receive's copy
        if not np.array_equal(got, data[peer]):
            problems.append("a send after a long kernel on the caller's stream")

        # an asynchronous receive in flight on another tag: blocking calls beside it
        a = cupy.asarray(data[r])
        b, c = cupy.zeros(4096, cupy.float32), cupy.zeros(4096, cupy.float32)
        w = comm.recv(c, peer, tag=10, async_op=True)
        for first in (0, 1):
            if r == first:
                comm.send(a, peer, tag=9)
            else:
                comm.recv(b, peer, tag=9)
        comm.send(a * 2, peer, tag=10)
        w.wait()
        if not np.array_equal(cupy.asnumpy(b), data[peer]):
            problems.append("a receive beside an asynchronous one")
        if not np.array_equal(cupy.asnumpy(c), 2 * data[peer]):
            problems.append("an asynchronous receive with blocking calls beside it")
    assert_all_ranks(comm, not problems, "; ".join(problems))


class TestStagedStreams(StreamContract):
    """The stream contract (tests/gpu/_stream_contract.py) on this module's communicators."""

    options: ClassVar[dict[str, Any]] = {"transport": "staged", "vendors": ("nvidia", "amd")}
