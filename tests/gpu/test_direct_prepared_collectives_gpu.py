"""The direct transport's prepared collectives (direct/collectives.py): a blocking collective
of device arrays, repeated, runs its steps on the calling thread with no Work, every op form,
through the shared GPU's leader and without it (each rank's own steps: the path of ranks on
GPUs of their own), and meets the proxy's path of the same call on other ranks.

Run on a GPU machine: `mpirun -n 2 python -m mpi4py -m pytest --with-mpi tests/gpu` (and -n 4).
"""

from __future__ import annotations

import numpy as np
import pytest
from _refs import reference, small_values, wrapped

from hetcomm import ReduceOp, introspect
from hetcomm.testing import assert_all_ranks

cupy = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")

PAD = 16  # guard elements on each side of every output


MODES = ["leader", "peers"]


def _direct(comm, mode):
    """The communicator's direct transport; mode 'peers' turns off the shared GPU's leader,
    'leader' needs one."""
    t = introspect.transport_of(comm, "all_reduce", cupy.zeros(1))
    assert t.name == "direct"
    if mode == "peers":
        t.shared = False
    elif not t.shared:
        pytest.skip("the ranks do not share one GPU: no leader")
    return t


def _prepared(t) -> tuple[int, int]:
    """(collectives made by the prepared call, through the leader) so far."""
    stats = t.stats()
    return stats["prepared"], stats["led"]


def _make(kind, values, dtype):
    if kind == "torch":
        return torch.from_numpy(values).to(getattr(torch, dtype)).cuda()
    return cupy.asarray(values.astype(dtype))


def _host(a):
    if isinstance(a, torch.Tensor):
        return a.double().cpu().numpy()
    return cupy.asnumpy(a).astype(np.float64)


def _close(got, want, dtype):
    tol = {"float16": 2e-3, "bfloat16": 1e-2}.get(dtype, 1e-6)
    return np.allclose(got, want, rtol=tol, atol=tol)


class Forms:
    """Every op form on one signature (kind, dtype, per-rank block `count`), each call with
    fresh data in fresh guarded allocations, checked against numpy float64."""

    def __init__(self, comm, rng, kind, dtype, count, problems, mode):
        self.comm, self.rng, self.kind, self.dtype, self.count = comm, rng, kind, dtype, count
        self.n, self.r = comm.size, comm.rank
        self.problems = problems
        self.calls = 0
        # calls the general path takes: without the leader, an in-place all_to_all's x is
        # copied first (every rank's steps write outputs others still read)
        self.general = 0
        self.mode = mode

    def _data(self, per_rank):
        return np.stack([small_values(self.rng, self.dtype, per_rank) for _ in range(self.n)])

    def _guarded(self, values):
        """(backing, view): `values` in the middle of an allocation of -3s (True for bool)."""
        back = _make(self.kind, np.full(len(values) + 2 * PAD, -3.0), self.dtype)
        back[PAD:-PAD] = _make(self.kind, values, self.dtype)
        return back, back[PAD:-PAD]

    def _check(self, label, back, want):
        got = _host(back)
        guard = _host(_make(self.kind, np.full(PAD, -3.0), self.dtype))
        if not _close(got[PAD:-PAD], want, self.dtype):
            self.problems.append(f"{label}: wrong result")
        if (got[:PAD] != guard).any() or (got[-PAD:] != guard).any():
            self.problems.append(f"{label}: wrote beside the output")

    def run(self, op):
        comm, n, r, c, dtype = self.comm, self.n, self.r, self.count, self.dtype
        label = f"{self.kind} {dtype} x{c}"
        reduces = op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.AVG) and not (
            dtype == "bool" and op is ReduceOp.AVG
        )
        if reduces:
            data = self._data(c)
            want = wrapped(reference(data, op, dtype), dtype)
            back, x = self._guarded(data[r])
            comm.all_reduce(x, op)
            self._check(f"all_reduce in place {op} {label}", back, want)
            x = _make(self.kind, data[r], dtype)
            back, out = self._guarded(np.zeros(c))
            comm.all_reduce(x, op, out=out)
            self._check(f"all_reduce {op} {label}", back, want)
            if not np.array_equal(_host(x), data[r]):
                self.problems.append(f"all_reduce {op} {label}: input changed")
            root = (self.calls + 1) % n
            back, x = self._guarded(data[r])
            comm.reduce(x, root, op)
            self._check(f"reduce {op} {label}", back, want if r == root else data[r])
            data = self._data(c * n)
            want = wrapped(reference(data, op, dtype), dtype)
            x = _make(self.kind, data[r], dtype)
            back, out = self._guarded(np.zeros(c))
            comm.reduce_scatter(out, x, op)
            self._check(f"reduce_scatter {op} {label}", back, want[r * c : (r + 1) * c])
            back, x = self._guarded(data[r])
            comm.reduce_scatter(x[r * c : (r + 1) * c], x, op)  # in place: NCCL's layout
            mine = data[r].copy()
            mine[r * c : (r + 1) * c] = want[r * c : (r + 1) * c]
            self._check(f"reduce_scatter in place {op} {label}", back, mine)
            self.calls += 5
        data = self._data(c)
        root = self.calls % n
        back, x = self._guarded(data[r])
        comm.broadcast(x, root)
        self._check(f"broadcast {label}", back, data[root])
        x = _make(self.kind, data[r], dtype)
        back, out = self._guarded(np.zeros(c * n))
        comm.all_gather(out, x)
        self._check(f"all_gather {label}", back, data.reshape(-1))
        back, out = self._guarded(np.zeros(c * n))
        out[r * c : (r + 1) * c] = x
        comm.all_gather(out, out[r * c : (r + 1) * c])  # in place: NCCL's layout
        self._check(f"all_gather in place {label}", back, data.reshape(-1))
        data = self._data(c * n)
        want = np.concatenate([data[i].reshape(n, c)[r] for i in range(n)])
        x = _make(self.kind, data[r], dtype)
        back, out = self._guarded(np.zeros(c * n))
        comm.all_to_all(out, x)
        self._check(f"all_to_all {label}", back, want)
        back, x = self._guarded(data[r])
        comm.all_to_all(x, x)
        self._check(f"all_to_all in place {label}", back, want)
        self.calls += 5
        self.general += self.mode == "peers"


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode", MODES)
def test_every_form_takes_the_prepared_call_and_survives_signature_changes(
    hetcomm_make_comm, hetcomm_shared_seed, mode
):
    """Blocking collectives of device arrays, every form (in place and out of place, rooted
    at every rank), repeated with fresh data in fresh allocations as the signature changes
    between calls (count, dtype, reduce op, CuPy and torch): each is right, writes nothing
    beside its output, leaves its input as it was, and ran as the prepared call (counted)."""
    comm = hetcomm_make_comm(transport="direct")
    t = _direct(comm, mode)
    rng = np.random.default_rng(hetcomm_shared_seed)
    problems: list[str] = []
    ran0, led0 = _prepared(t)
    calls = general = 0
    for rep in range(2):
        for kind, dtype, count in (
            ("cupy", "float32", 1),
            ("torch", "bfloat16", 1000),
            ("cupy", "int64", 70_001),
            ("torch", "float32", 4099),
            ("cupy", "bool", 3),
        ):
            forms = Forms(comm, rng, kind, dtype, count, problems, mode)
            for op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX)[: 1 + rep * 2]:
                forms.run(op)
            calls += forms.calls
            general += forms.general
    ran, made = (now - then for now, then in zip(_prepared(t), (ran0, led0)))
    if ran != calls - general or made != (calls if mode == "leader" else 0):
        problems.append(
            f"of {calls} calls {ran} took the prepared call ({general} could not), {made} the "
            "leader"
        )
    assert_all_ranks(comm, not problems, "; ".join(problems[:6]))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["cupy", "torch"])
def test_ordered_after_the_callers_stream(hetcomm_make_comm, hetcomm_shared_seed, kind, mode):
    """The input written by work still queued on the caller's (non-default) stream when the
    call is made: every rank's prepared call reads it only once that work has run, and the
    result is on that stream's side when the call returns."""
    comm = hetcomm_make_comm(transport="direct")
    _direct(comm, mode)
    n, r = comm.size, comm.rank
    rng = np.random.default_rng(hetcomm_shared_seed)
    problems: list[str] = []
    data = rng.integers(-50, 50, (6, n, 5000)).astype(np.float64)
    if kind == "torch":
        stream = torch.cuda.Stream()
        ctx = torch.cuda.stream(stream)
    else:
        stream = cupy.cuda.Stream(non_blocking=True)
        ctx = stream
    with ctx:
        x = _make(kind, np.zeros(5000), "float32")
        for k in range(6):
            if kind == "torch":
                torch.cuda._sleep(2_000_000)
            else:
                busy = cupy.ones(1 << 22, cupy.float32)
                for _ in range(10):
                    busy *= 1.0001
            x[...] = _make(kind, data[k, r], "float32")
            comm.all_reduce(x, ReduceOp.SUM)
            x *= 2  # queued after the call on the same stream: sees the result
            if not np.array_equal(_host(x), 2 * data[k].sum(0)):
                problems.append(f"round {k}: wrong result")
    assert_all_ranks(comm, not problems, "; ".join(problems[:6]))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode", MODES)
def test_ranks_on_either_path_meet(hetcomm_make_comm, hetcomm_shared_seed, mode):
    """The prepared call and the proxy's path exchange the same messages: in each round one
    rank (in turn, the leader too) makes its call asynchronously (the proxy's path) while the
    others block (the prepared call), and a blocking call made while an asynchronous one is in
    flight takes the proxy's path behind it. Every result is right."""
    comm = hetcomm_make_comm(transport="direct")
    t = _direct(comm, mode)
    n, r = comm.size, comm.rank
    rng = np.random.default_rng(hetcomm_shared_seed)
    problems: list[str] = []
    ran0, led0 = _prepared(t)
    prepared = 0
    for k in range(3 * n):
        data = rng.integers(-50, 50, (n, 3000)).astype(np.float64)
        x = cupy.asarray(data[r].astype(np.float32))
        if r == k % n:
            comm.all_reduce(x, ReduceOp.SUM, async_op=True).wait()
        else:
            comm.all_reduce(x, ReduceOp.SUM)
            prepared += 1
        if not np.array_equal(cupy.asnumpy(x), data.sum(0)):
            problems.append(f"round {k}: wrong all_reduce")
        y = cupy.asarray(data[r].astype(np.float32))
        root = (k + 1) % n
        work = comm.broadcast(y, root, async_op=True)
        z = cupy.asarray(data[r].astype(np.float32))
        comm.all_reduce(z, ReduceOp.MAX)  # the proxy holds the broadcast: this queues behind it
        work.wait()
        if not np.array_equal(cupy.asnumpy(y), data[root]):
            problems.append(f"round {k}: wrong broadcast")
        if not np.array_equal(cupy.asnumpy(z), data.max(0)):
            problems.append(f"round {k}: wrong all_reduce behind an asynchronous call")
    # a blocking call takes the proxy's path whenever the proxy still holds an earlier
    # operation (on its way out, too): how many did is timing's, only the bounds are sure
    ran, made = (now - then for now, then in zip(_prepared(t), (ran0, led0)))
    if not 0 < ran <= prepared + 3 * n or made != (3 * 3 * n if mode == "leader" else 0):
        problems.append(
            f"{ran} prepared calls of {prepared + 3 * n} blocking ones, {made} of {3 * 3 * n} "
            "through the leader"
        )
    assert_all_ranks(comm, not problems, "; ".join(problems[:6]))
