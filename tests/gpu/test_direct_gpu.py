"""The device-direct transport: ranks sharing the GPU map each other's memory (CUDA IPC).

Run on a GPU machine: `mpirun -n 2 python -m mpi4py -m pytest --with-mpi tests/gpu` (and -n 4).
"""

from __future__ import annotations

import numpy as np
import pytest
from _refs import reference as _ref
from _refs import wrapped as _wrap

from hetcomm import InvalidArgument, ReduceOp, dtypes, introspect
from hetcomm.testing import assert_all_ranks
from hetcomm.transports.direct import schedule as direct_schedule

cupy = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")

DTYPES = dtypes.DTYPES  # every dtype of the API (tests/unit/test_dtypes.py pins them)
OPS = (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX)
SMALL, LARGE = 37, direct_schedule.ONE_SHOT_BYTES // 2 + 1001  # one-shot and two-shot counts


def _values(rng, dtype, n):
    if dtype == "bool":
        return rng.integers(0, 2, n).astype(np.float64)
    if dtype.startswith(("float", "bfloat")):
        return rng.integers(-8, 8, n) / 4.0  # exact in every float dtype, sums stay exact
    return rng.integers(0 if dtype == "uint8" else -3, 4, n).astype(np.float64)


def _tensor(values, dtype):
    return torch.from_numpy(values).to(getattr(torch, dtype)).cuda()


def _host(t):
    return t.double().cpu().numpy()


def _close(got, want, dtype):
    tol = {"float16": 2e-3, "bfloat16": 1e-2}.get(dtype, 1e-6)
    return np.allclose(got, want, rtol=tol, atol=tol)


def _direct(comm, mode: str):
    """The communicator's direct transport, made now; mode 'peers' turns off the shared-GPU
    leader so that every rank reduces its part (the path of ranks on different GPUs)."""
    t = introspect.transport_of(comm, "all_reduce", cupy.zeros(1))
    assert t.name == "direct"
    if mode == "peers":
        t.shared = False
    return t


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode", ["leader", "peers"])
@pytest.mark.parametrize("count", [SMALL, LARGE], ids=["one-shot", "two-shot"])
def test_all_reduce_every_dtype_and_op(hetcomm_make_comm, hetcomm_shared_seed, count, mode):
    comm = hetcomm_make_comm(transport="direct")
    _direct(comm, mode)
    n, r = comm.size, comm.rank
    rng = np.random.default_rng(hetcomm_shared_seed)
    problems = []
    for dtype in DTYPES:
        data = np.stack([_values(rng, dtype, count) for _ in range(n)])
        for op in OPS:
            if dtype == "bool" and op is ReduceOp.AVG:
                continue
            want = _wrap(_ref(data, op, dtype), dtype)
            x = _tensor(data[r], dtype)
            guard = _tensor(np.arange(count + 64) % 3, dtype)  # memory next to the output
            before = _host(guard)
            out = guard[32 : 32 + count]
            comm.all_reduce(x, op, out=out)
            if not _close(_host(out), want, dtype):
                problems.append(f"out-of-place {dtype} {op}")
            if not np.array_equal(_host(x), data[r]):
                problems.append(f"{dtype} {op}: input changed")
            g = _host(guard)
            if not (
                np.array_equal(g[:32], before[:32])
                and np.array_equal(g[32 + count :], before[32 + count :])
            ):
                problems.append(f"{dtype} {op}: wrote outside the output")
            comm.all_reduce(x, op)
            if not _close(_host(x), want, dtype):
                problems.append(f"in place {dtype} {op}")
            every = comm.mpi.allgather(_host(x).tobytes())
            if any(b != every[0] for b in every):
                problems.append(f"{dtype} {op}: ranks disagree bitwise")
    assert_all_ranks(comm, not problems, "; ".join(problems[:6]))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode", ["leader", "peers"])
def test_other_collectives(hetcomm_make_comm, hetcomm_shared_seed, mode):
    """Every collective but all_reduce, out of place and in place, through the shared GPU's
    leader (every collective of the group) or each rank's own copies and reductions."""
    comm = hetcomm_make_comm(transport="direct")
    t = _direct(comm, mode)
    n, r = comm.size, comm.rank
    rng = np.random.default_rng(hetcomm_shared_seed)
    problems = []
    led = t.stats()["led"]
    calls = 0
    for dtype in ("int8", "bfloat16", "float32", "float64"):
        count = 3 * n + 1
        data = np.stack([_values(rng, dtype, count * n) for _ in range(n)])
        for op in OPS:
            want = _wrap(_ref(data, op, dtype), dtype)
            y = _tensor(data[r], dtype)
            comm.reduce(y, 1 % n, op)
            if not _close(_host(y), want if r == 1 % n else data[r], dtype):
                problems.append(f"reduce {dtype} {op}")
            blk = torch.empty(count, dtype=y.dtype, device="cuda")
            comm.reduce_scatter(blk, _tensor(data[r], dtype), op)
            if not _close(_host(blk), want[r * count : (r + 1) * count], dtype):
                problems.append(f"reduce_scatter {dtype} {op}")
        b = _tensor(data[r], dtype)
        comm.broadcast(b, n - 1)
        if not np.array_equal(_host(b), data[n - 1]):
            problems.append(f"broadcast {dtype}")
        part = _tensor(data[r][:count], dtype)
        gathered = torch.empty(count * n, dtype=part.dtype, device="cuda")
        comm.all_gather(gathered, part)
        if not np.array_equal(_host(gathered), data[:, :count].reshape(-1)):
            problems.append(f"all_gather {dtype}")
        a2a = torch.empty(count * n, dtype=part.dtype, device="cuda")
        comm.all_to_all(a2a, _tensor(data[r], dtype))
        want_a2a = np.concatenate([data[i].reshape(n, count)[r] for i in range(n)])
        if not np.array_equal(_host(a2a), want_a2a):
            problems.append(f"all_to_all {dtype}")
        # in place, inside a guarded allocation: every other element stays as it was
        guard = _tensor(np.arange(count * n + 64) % 5, dtype)
        before = _host(guard)
        inner = guard[32 : 32 + count * n]
        inner[r * count : (r + 1) * count] = part
        comm.all_gather(inner, inner[r * count : (r + 1) * count])
        if not np.array_equal(_host(inner), data[:, :count].reshape(-1)):
            problems.append(f"all_gather in place {dtype}")
        inner.copy_(_tensor(data[r], dtype))
        comm.all_to_all(inner, inner)
        if not np.array_equal(_host(inner), want_a2a):
            problems.append(f"all_to_all in place {dtype}")
        g = _host(guard)
        if not (np.array_equal(g[:32], before[:32]) and np.array_equal(g[-32:], before[-32:])):
            problems.append(f"{dtype}: an in-place collective wrote outside its output")
        calls += 2 * len(OPS) + 5
    comm.barrier()
    made = t.stats()["led"] - led
    if made != (calls if mode == "leader" and t.shared else 0):
        problems.append(f"{made} of {calls} collectives went through the leader ({mode})")
    assert_all_ranks(comm, not problems, "; ".join(problems[:6]))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode", ["leader", "peers"])
def test_back_to_back_async_collectives(hetcomm_make_comm, hetcomm_shared_seed, mode):
    """Many collectives in flight at once, mixed kinds, some on buffers whose producing kernels
    are still queued on a busy stream: each result matches its reference, the output's
    neighbours are untouched, and nothing waits on another rank's later operation."""
    comm = hetcomm_make_comm(transport="direct")
    _direct(comm, mode)
    n, r = comm.size, comm.rank
    rng = np.random.default_rng(hetcomm_shared_seed)
    count = 4099  # odd: the float32 vector kernel's tail runs too
    rounds = 12
    data = rng.integers(-8, 8, (rounds, n, count)).astype(np.float64) / 4
    stream = cupy.cuda.Stream(non_blocking=True)
    works, checks = [], []
    pad = 4  # guard elements on each side (16 bytes: x stays aligned for the vector kernel)
    with stream:
        for k in range(rounds):
            padded = cupy.full(count + 2 * pad, 7.0, dtype=cupy.float32)
            if k % 3 == 0:  # keep the stream busy: the operation must wait for this work
                busy = cupy.ones(1 << 24, dtype=cupy.float32)
                for _ in range(8):
                    busy *= 1.0001
            padded[pad:-pad] = cupy.asarray(data[k, r], dtype=cupy.float32)
            x = padded[pad:-pad]
            if k % 4 == 3:
                works.append(comm.broadcast(x, k % n, async_op=True))
                want = data[k, k % n]
            else:
                op = (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.AVG)[k % 3]
                works.append(comm.all_reduce(x, op, async_op=True))
                want = _ref(data[k], op, "float32")
            checks.append((k, padded, want))
    for w in works:
        w.wait()
    comm.barrier()
    problems = []
    for k, padded, want in checks:
        got = cupy.asnumpy(padded).astype(np.float64)
        if not (np.all(got[:pad] == 7.0) and np.all(got[-pad:] == 7.0)):
            problems.append(f"round {k}: a neighbour of the output changed")
        if not np.allclose(got[pad:-pad], want, rtol=1e-6, atol=1e-6):
            problems.append(f"round {k}: wrong result")
    assert_all_ranks(comm, not problems, "; ".join(problems[:6]))


@pytest.mark.mpi(min_size=2)
def test_send_recv_ring_cupy_and_size_mismatch(hetcomm_make_comm, hetcomm_shared_seed):
    comm = hetcomm_make_comm(transport="direct")
    n, r = comm.size, comm.rank
    rng = np.random.default_rng(hetcomm_shared_seed)
    problems = []
    for nbytes in (1, 4096, 3 << 20):
        data = rng.integers(0, 255, (n, nbytes)).astype(np.uint8)
        x = cupy.asarray(data[r])
        y = cupy.zeros(nbytes, cupy.uint8)
        ws = comm.send(x, (r + 1) % n, tag=3, async_op=True)
        comm.recv(y, (r - 1) % n, tag=3)
        ws.wait()
        if not np.array_equal(cupy.asnumpy(y), data[(r - 1) % n]):
            problems.append(f"ring of {nbytes} bytes")
    if r < 2:  # a receive of the wrong size fails on both ends, naming both sizes
        for sender in (0, 1):  # rank 0 copies both ways: pushing, then pulling
            x = cupy.zeros(10 if r == sender else 12, cupy.uint8)
            try:
                (comm.send if r == sender else comm.recv)(x, 1 - r)
                problems.append(f"a size mismatch went unnoticed (sender {sender})")
            except InvalidArgument as exc:
                if "10" not in str(exc) or "12" not in str(exc):
                    problems.append(f"unclear mismatch error: {exc}")
    assert_all_ranks(comm, not problems, "; ".join(problems))


_SPIN = r"""extern "C" __global__ void spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
}"""


@pytest.mark.mpi(min_size=2)
def test_send_recv_keep_issue_order_across_streams_and_both_ways(
    hetcomm_make_comm, hetcomm_shared_seed
):
    """Ranks 0 and 1 send each other four messages of one tag at once, each from a stream of
    its own, the first stream held up by a kernel that spins before the data is written: every
    receive gets the message issued in its turn, with the data the sender's stream wrote, and
    nothing beside the receive buffers changes."""
    comm = hetcomm_make_comm(transport="direct")
    r = comm.rank
    problems = []
    if r < 2:
        peer, k, n, pad = 1 - r, 4, 70000, 64
        rng = np.random.default_rng(hetcomm_shared_seed)
        data = rng.integers(0, 255, (2, k, n)).astype(np.uint8)
        spin = cupy.RawKernel(_SPIN, "spin")
        streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(k)]
        outs = [cupy.zeros(n + 2 * pad, cupy.uint8) for _ in range(k)]
        mine = cupy.asarray(data[r])
        cupy.cuda.Device().synchronize()
        works, xs = [], []

        def sends() -> None:
            for i, s in enumerate(streams):
                with s:
                    if i == 0:
                        spin((1,), (1,), (np.int64(50_000_000),))  # some 30 ms
                    x = mine[i].copy()  # written on s (after the spin), the call returns at once
                    xs.append(x)
                    works.append(comm.send(x, peer, tag=5, async_op=True))

        def recvs() -> None:
            works.extend(comm.recv(y[pad:-pad], peer, tag=5, async_op=True) for y in outs)

        (sends, recvs)[r]()
        (recvs, sends)[r]()
        for w in works:
            w.wait()
        cupy.cuda.Device().synchronize()
        for i, y in enumerate(outs):
            got = cupy.asnumpy(y)
            if not np.array_equal(got[pad:-pad], data[peer, i]):
                problems.append(f"receive {i} got the wrong message")
            if got[:pad].any() or got[-pad:].any():
                problems.append(f"receive {i} wrote beside its buffer")
    assert_all_ranks(comm, not problems, "; ".join(problems))


@pytest.mark.mpi(min_size=2)
def test_registration_cache_hits_misses_and_close(hetcomm_make_comm, hetcomm_shared_seed):
    comm = hetcomm_make_comm(transport="direct")
    n = comm.size
    big = direct_schedule.ONE_SHOT_BYTES  # two-shot: the caller's own buffers are mapped
    x = cupy.ones(big, cupy.float32)
    t = _direct(comm, "peers")  # every rank maps its peers' buffers
    comm.all_reduce(x)
    first = t.stats()
    for _ in range(3):
        comm.all_reduce(x)  # the same buffer: hits only
    again = t.stats()
    # a new cudaMalloc of its own (a pooled array may sit in an allocation already mapped)
    mem = cupy.cuda.Memory(big * 4)
    fresh = cupy.ndarray((big,), cupy.float32, cupy.cuda.MemoryPointer(mem, 0))
    fresh.fill(2)
    comm.all_reduce(fresh)
    last = t.stats()
    ok = (
        bool((x == n**4).all())
        and bool((fresh == 2 * n).all())
        and again["misses"] == first["misses"]
        and again["hits"] > first["hits"]
        and last["misses"] > again["misses"]
    )
    comm.close()
    ok = ok and t.stats()["mapped"] == 0
    assert_all_ranks(hetcomm_make_comm(), ok, f"cache {first} -> {again} -> {last}")


@pytest.mark.mpi(min_size=2)
def test_simulated_vendors_plan_and_auto(hetcomm_make_comm, hetcomm_shared_seed):
    """Across a simulated vendor boundary on one GPU, send/recv of large arrays picks direct
    (the same-vendor mechanism stands in for the cross-vendor one here)."""
    comm = hetcomm_make_comm(vendors=("nvidia", "amd"))
    transport, why = comm.plan.lookup("send", "device", "large")
    ok = transport == "direct"
    r, n = comm.rank, comm.size
    x = torch.arange(1 << 20, dtype=torch.float32, device="cuda") + r
    y = torch.empty_like(x)
    ws = comm.send(x, (r + 1) % n, async_op=True)
    comm.recv(y, (r - 1) % n)
    ws.wait()
    ok = ok and bool((y == torch.arange(1 << 20, device="cuda") + (r - 1) % n).all())
    assert_all_ranks(comm, ok, f"plan {transport}: {why}")


def _p2p_counts(comm, op: str) -> tuple[int, int]:
    """(prepared runs, general-path uses) of every `op` route of device memory so far."""
    rows = [r for r in comm.routes() if r["op"] == op and r["transport"] == "direct"]
    return sum(r["runs"] for r in rows), sum(r["uses"] for r in rows)


@pytest.mark.mpi(min_size=2)
def test_prepared_send_recv_every_form_and_signature_change(hetcomm_make_comm, hetcomm_shared_seed):
    """Blocking device sends and receives, repeated, take the resolved route (counted) and stay
    right as the signature changes between calls (count, dtype, array type, a new allocation, the
    caller's stream), beside asynchronous ones (which keep theirs first: the call then takes the
    general path), and in both directions (on a shared GPU rank 0 copies both ways; on two
    GPUs the receiver copies). Nothing beside the receive buffer changes."""
    comm = hetcomm_make_comm(transport="direct")
    r = comm.rank
    problems = []
    if r < 2:
        peer, pad = 1 - r, 32
        rng = np.random.default_rng(hetcomm_shared_seed)

        def exchange(make, n, dtype, label):
            data = rng.integers(0, 100, (2, n)).astype(np.float64)
            x = make(data[r], dtype)
            buf = make(np.zeros(n + 2 * pad), dtype)
            y = buf[pad:-pad]
            for first in (0, 1):  # each rank sends once and receives once
                if r == first:
                    comm.send(x, peer, tag=7)
                else:
                    comm.recv(y, peer, tag=7)
            got = _host(buf) if isinstance(buf, torch.Tensor) else cupy.asnumpy(buf).astype(float)
            if not np.array_equal(got[pad:-pad], data[peer]):
                problems.append(f"{label}: wrong data")
            if got[:pad].any() or got[-pad:].any():
                problems.append(f"{label}: wrote beside the receive buffer")

        def cp(values, dtype):
            return cupy.asarray(values.astype(dtype))

        def tt(values, dtype):
            return _tensor(values, dtype)

        runs0, uses0 = _p2p_counts(comm, "send")
        for _ in range(3):
            exchange(cp, 1000, "float32", "cupy float32 x3")
        exchange(cp, 1001, "float32", "new count")
        exchange(cp, 1001, "int64", "new dtype")
        exchange(tt, 1001, "bfloat16", "torch bfloat16")
        exchange(tt, 70000, "float32", "torch 280 KB")
        # a new allocation of its own at each call: its record is made afresh
        for i in range(2):
            mem = cupy.cuda.Memory(4 * 513)
            fresh = cupy.ndarray((513,), cupy.float32, cupy.cuda.MemoryPointer(mem, 0))

            def into_fresh(values, dtype, f=fresh):
                if values.any():  # the data sent (the receive buffer is a pooled array)
                    f[...] = cupy.asarray(values.astype(dtype))
                    return f
                return cp(values, dtype)

            exchange(into_fresh, 513, "float32", f"new allocation {i}")
        runs1, uses1 = _p2p_counts(comm, "send")
        if runs1 - runs0 < 9 or uses1 != uses0:
            problems.append(f"sends: {runs1 - runs0} prepared, {uses1 - uses0} general")

        # the caller's stream: the data is written after a spinning kernel on a stream of its
        # own, and the send on that stream must carry what was written there
        spin = cupy.RawKernel(_SPIN, "spin")
        s = cupy.cuda.Stream(non_blocking=True)
        data = rng.integers(0, 100, (2, 4096)).astype(np.float32)
        x = cupy.zeros(4096, cupy.float32)
        y = cupy.zeros(4096, cupy.float32)
        cupy.cuda.Device().synchronize()
        with s:
            spin((1,), (1,), (np.int64(20_000_000),))
            x[...] = cupy.asarray(data[r])
            for first in (0, 1):
                if r == first:
                    comm.send(x, peer, tag=8)
                else:
                    comm.recv(y, peer, tag=8)
            got = cupy.asnumpy(y)  # on s: after the receive's copy
        if not np.array_equal(got, data[peer]):
            problems.append("a send after a spinning kernel on the caller's stream")

        # an asynchronous receive in flight: the blocking calls behind it wait their turn on
        # the proxy (the general path), and every message lands where it should. Its message
        # is sent only after both blocking calls, so it is in flight at each of them
        a, b, c = (cupy.asarray(data[r]), cupy.zeros(4096, cupy.float32), cupy.zeros_like(x))
        w = comm.recv(c, peer, tag=10, async_op=True)
        before = _p2p_counts(comm, "send")[1] + _p2p_counts(comm, "recv")[1]
        for first in (0, 1):
            if r == first:
                comm.send(a, peer, tag=9)
            else:
                comm.recv(b, peer, tag=9)
        after = _p2p_counts(comm, "send")[1] + _p2p_counts(comm, "recv")[1]
        comm.send(a * 2, peer, tag=10)
        w.wait()
        if not np.array_equal(cupy.asnumpy(b), data[peer]):
            problems.append("a receive behind an asynchronous one")
        if not np.array_equal(cupy.asnumpy(c), 2 * data[peer]):
            problems.append("an asynchronous receive with blocking calls after it")
        if after - before != 2:
            problems.append(
                f"{after - before} of 2 calls behind an asynchronous one took the general path"
            )
    assert_all_ranks(comm, not problems, "; ".join(problems))


@pytest.mark.mpi(min_size=2)
def test_sendrecv_pairs_and_rings_take_the_prepared_exchange(
    hetcomm_make_comm, hetcomm_shared_seed
):
    """Blocking device sendrecv, repeated: a ring shift (send right, receive left) and pairs
    exchanging (ranks 2k and 2k+1; the last of an odd group sits out), CuPy and torch arrays,
    1 to 70000 elements. Each receive holds the peer's data and nothing beside it changed, the
    send buffer is as it was, and every call took the transport's prepared exchange (counted).
    Sizes that differ raise on both ends of a pair, and the exchange after is right."""
    comm = hetcomm_make_comm(transport="direct")
    n, r = comm.size, comm.rank
    right, left = (r + 1) % n, (r - 1) % n
    partner = r ^ 1 if r ^ 1 < n else None
    rng = np.random.default_rng(hetcomm_shared_seed)
    pad = 16
    problems: list[str] = []

    def cp(values, dtype):
        return cupy.asarray(values.astype(dtype))

    def host(a):
        return _host(a) if isinstance(a, torch.Tensor) else cupy.asnumpy(a).astype(np.float64)

    def exchange(label, make, dtype, count, dst, src, tag):
        data = rng.integers(0, 100, (n, count)).astype(np.float64)
        x = make(data[r], dtype)
        buf = make(np.full(count + 2 * pad, -7.0), dtype)
        y = buf[pad:-pad]
        comm.sendrecv(x, dst, y, src, tag=tag)
        got = host(buf)
        if not np.array_equal(got[pad:-pad], data[src]):
            problems.append(f"{label}: wrong data")
        if (got[:pad] != -7).any() or (got[-pad:] != -7).any():
            problems.append(f"{label}: wrote beside the receive buffer")
        if not np.array_equal(host(x), data[r]):
            problems.append(f"{label}: the send buffer changed")

    before, _ = _p2p_counts(comm, "sendrecv")
    calls = 0
    for rep in range(2):
        for make, dtype in ((cp, "float32"), (_tensor, "bfloat16"), (cp, "int64")):
            for count in (1, 1000, 70000):
                what = f"{dtype} x{count} #{rep}"
                exchange(f"ring {what}", make, dtype, count, right, left, 3)
                calls += 1
                if partner is not None:
                    exchange(f"pair {what}", make, dtype, count, partner, partner, 4)
                    calls += 1
    runs, _ = _p2p_counts(comm, "sendrecv")
    if runs - before != calls:
        problems.append(f"{runs - before} of {calls} sendrecv calls took the prepared exchange")
    if partner is not None:
        mine = 10 + 2 * (r % 2)  # even ranks send and expect 10 elements, odd ones 12
        x, y = cupy.ones(mine, cupy.float32), cupy.zeros(mine, cupy.float32)
        try:
            comm.sendrecv(x, partner, y, partner, tag=5)
            problems.append("sizes that differ: no error")
        except InvalidArgument as exc:
            if "bytes" not in str(exc):
                problems.append(f"sizes that differ: {exc}")
        exchange("pair after a mismatch", cp, "float32", 300, partner, partner, 6)
    assert_all_ranks(comm, not problems, "; ".join(problems[:6]))
