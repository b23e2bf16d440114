"""hetcomm.torch without MPI: the compatibility table against this torch, reduce ops, helpers.

Nothing here starts MPI: importing hetcomm.torch registers the backend and the rendezvous
handlers only; MPI is first touched when torch creates a group.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("this torch has no torch.distributed", allow_module_level=True)

import hetcomm.torch as ht  # noqa: E402
from hetcomm import ReduceOp  # noqa: E402

# every collective a torch ProcessGroup has had, under any name, since 2.4
COLLECTIVES = {
    "allreduce",
    "allreduce_coalesced",
    "broadcast",
    "reduce",
    "allgather",
    "allgather_coalesced",
    "gather",
    "scatter",
    "reduce_scatter",
    "alltoall",
    "barrier",
    "send",
    "recv",
    "recv_anysource",
    *(name for names in ht.METHOD_NAMES.values() for name in names),
}
# names in torch's ProcessGroup binding that are not collectives hetcomm must provide
NOT_OURS = {"monitored_barrier", "merge_remote_group", "split_group", "new_group"}
WORDS = (
    "gather",
    "reduce",
    "scatter",
    "alltoall",
    "all_to_all",
    "broadcast",
    "barrier",
    "send",
    "recv",
    "coalesc",
)


def test_every_name_in_the_table_is_implemented_once() -> None:
    cls = ht.ProcessGroupHetcomm
    for canonical, names in ht.METHOD_NAMES.items():
        assert names[0] == canonical, "the canonical (newest) name comes first"
        impl = cls.__dict__[canonical]
        for name in names:
            assert cls.__dict__.get(name) is impl, f"{name} should be {canonical}"


def test_every_collective_of_this_torch_is_overridden() -> None:
    """A collective the binding has but the class does not would fall through to C++, which
    raises for a group without C++ backends: so each one must be ours."""
    binding = {n for n in dir(dist.ProcessGroup) if not n.startswith("__")}
    ours = ht.ProcessGroupHetcomm.__dict__
    missing = sorted(n for n in binding & COLLECTIVES if n not in ours)
    assert not missing, f"torch {torch.__version__} has collectives hetcomm lacks: {missing}"
    unknown = sorted(
        n for n in binding - COLLECTIVES - NOT_OURS if any(w in n for w in WORDS) and n not in ours
    )
    assert not unknown, (
        f"torch {torch.__version__} has collective-like methods the "
        f"compatibility table does not know: {unknown}"
    )


def test_the_public_functions_resolve() -> None:
    for canonical, names in ht.API_NAMES.items():
        fn = ht.dist_function(canonical)
        assert fn in [getattr(dist, n, None) for n in names]
    assert ht.dist_function("all_reduce") is dist.all_reduce
    with pytest.raises(AttributeError, match=r"no torch\.distributed\.no_such_thing"):
        ht.dist_function("no_such_thing")


def test_backend_and_rendezvous_are_registered() -> None:
    assert ht.BACKEND in dist.Backend.backend_list
    assert dist.Backend("hetcomm") == "hetcomm"
    assert set(dist.Backend.backend_capability["hetcomm"]) == {"cpu", "cuda"}
    handlers = ht.rendezvous_handlers()
    assert "mpi" in handlers
    assert hasattr(handlers["env"], "hetcomm_wraps"), "env:// falls back to MPI under mpirun"
    assert not hasattr(handlers["env"].hetcomm_wraps, "hetcomm_wraps"), "wrapped once only"


def test_env_rendezvous_is_torchs_own_outside_mpirun(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (*ht._LAUNCHER_VARS, "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="environment variable"):
        next(ht.rendezvous_handlers()["env"]("env://?world_size=-1"))


def test_fully_shard_is_found() -> None:
    module = nn_module()
    if not any(
        hasattr(__import__(m, fromlist=["x"]), "fully_shard") for m in ht._FULLY_SHARD_MODULES
    ):
        pytest.skip("this torch has no FSDP2")
    with pytest.raises(Exception, match=r"(?i)process group|init|distributed"):
        ht.fully_shard(module)  # found; fails only because no process group exists


def nn_module() -> torch.nn.Module:
    return torch.nn.Linear(2, 2)


# ---- reduce ops ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "ours"),
    [
        ("SUM", ReduceOp.SUM),
        ("AVG", ReduceOp.AVG),
        ("PRODUCT", ReduceOp.PROD),
        ("MIN", ReduceOp.MIN),
        ("MAX", ReduceOp.MAX),
    ],
)
def test_reduce_ops_that_map(name: str, ours: ReduceOp) -> None:
    assert ht.reduce_op(getattr(dist.ReduceOp, name)) is ours
    assert ht.reduce_op(dist.ReduceOp(getattr(dist.ReduceOp, name))) is ours


@pytest.mark.parametrize("name", ["BAND", "BOR", "BXOR"])
def test_bitwise_ops_are_refused_by_name(name: str) -> None:
    with pytest.raises(ValueError, match=f"ReduceOp.{name} is not supported"):
        ht.reduce_op(getattr(dist.ReduceOp, name), "allreduce")


def test_premul_sum_is_refused_by_name() -> None:
    make = getattr(dist, "_make_nccl_premul_sum", None)
    op = make(2.0) if make is not None else dist.ReduceOp.PREMUL_SUM
    with pytest.raises(ValueError, match="PREMUL_SUM"):
        ht.reduce_op(op)


# ---- helpers ------------------------------------------------------------------------------------


def test_options_and_convenience_forms() -> None:
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX
    assert ht._opt(opts, "reduceOp") == dist.ReduceOp.MAX
    assert ht._opt(None, "reduceOp") == dist.ReduceOp.SUM
    assert ht._opt(dist.ReduceOp.MIN, "reduceOp") == dist.ReduceOp.MIN  # allreduce(t, op)
    assert ht._opt(3, "rootRank", 0) == 3  # broadcast(t, root)
    assert ht._opt(3, "reduceOp") == dist.ReduceOp.SUM
    assert ht._opt(timedelta(seconds=1), "rootRank", 0) == 0
    b = dist.BroadcastOptions()
    b.rootRank = 2
    assert ht._opt(b, "rootRank", 0) == 2


def test_split_rows() -> None:
    t = torch.arange(12).reshape(6, 2)
    parts = ht.split_rows(t, [1, 0, 5], 3, "x")
    assert [p.shape[0] for p in parts] == [1, 0, 5]
    assert [p.shape[0] for p in ht.split_rows(t, None, 3, "x")] == [2, 2, 2]
    with pytest.raises(ValueError, match="adding up to 6 rows"):
        ht.split_rows(t, [1, 2, 2], 3, "x")
    with pytest.raises(ValueError, match="do not split evenly"):
        ht.split_rows(t, [], 4, "x")


@pytest.mark.parametrize("dtype", ["complex64", "float8_e4m3fn", "uint32", "float32"])
def test_moved_tensors_come_back(dtype: str) -> None:
    dt = getattr(torch, dtype, None)
    if dt is None:
        pytest.skip(f"this torch has no {dtype}")
    src = torch.randn(3, 4, dtype=torch.float64)
    t = (
        src.to(torch.complex64)
        if dt.is_complex
        else src.to(dt)
        if dt.is_floating_point
        else src.abs().mul(10).to(dt)
    )
    for view in (t, t.t()):  # contiguous and not
        moved, after = ht._movable(view, write=True)
        assert ht._dtype_name(moved) in ht._NATIVE, "hetcomm can move what _movable hands it"
        back = ht._restore(moved.clone(), view)
        assert back.dtype == view.dtype and back.shape == view.shape
        assert torch.equal(back.contiguous().view(torch.uint8), view.contiguous().view(torch.uint8))
        for step in after:
            step()


def test_reducible_refuses_what_cannot_be_reduced() -> None:
    with pytest.raises(ValueError, match="complex tensors reduce with SUM or AVG"):
        ht._reducible(torch.zeros(2, dtype=torch.complex64), ReduceOp.MAX, "allreduce")
    if hasattr(torch, "uint32"):
        with pytest.raises(TypeError, match=r"cannot reduce torch\.uint32"):
            ht._reducible(torch.zeros(2, dtype=torch.uint32), ReduceOp.SUM, "allreduce")
    assert ht._reducible(torch.zeros(2, dtype=torch.complex128), ReduceOp.AVG, "x").shape == (2, 2)


# ---- operations in flight, with stand-in works --------------------------------------------------


class FakeWork:
    """Completes once `event` is set; counts the calls of test()."""

    def __init__(self, event: threading.Event, error: BaseException | None = None) -> None:
        self.event, self.error, self.tests = event, error, 0

    def test(self) -> bool:
        self.tests += 1
        if self.event.is_set() and self.error is not None:
            raise self.error
        return self.event.is_set()

    def wait(self, timeout: float | None = None) -> None:
        if not self.event.wait(timeout):
            raise TimeoutError("fake work timed out")
        self.test()


def test_the_future_completes_without_a_wait() -> None:
    done = threading.Event()
    out = torch.ones(3)
    steps: list[str] = []
    pending = ht._Pending("t", [FakeWork(done)], [lambda: steps.append("after")], [out], 30.0)
    work = ht._Work(pending)
    ht._PROGRESS.add(-1, pending)
    fut = work.get_future()
    assert not fut.done() and not work.is_completed()
    done.set()
    deadline = time.monotonic() + 10
    while not fut.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fut.done(), "the progress thread completes futures nobody waits on"
    assert fut.value()[0] is out and steps == ["after"] and work.is_success()
    assert work.wait() is True and work.result() == [out]


def test_a_failure_reaches_wait_and_future() -> None:
    done = threading.Event()
    done.set()
    boom = RuntimeError("boom")
    pending = ht._Pending("t", [FakeWork(done, boom)], [], [], 30.0)
    work = ht._Work(pending)
    with pytest.raises(RuntimeError, match="boom"):
        work.wait()
    assert work.exception() is boom and not work.is_success()
    with pytest.raises(RuntimeError, match="boom"):
        work.get_future().wait()


class BlockingWork(FakeWork):
    """A FakeWork whose transport gave a waiter: `block` waits on the event (as a yielding
    poll or a signal would) and counts its calls."""

    def __init__(self, event: threading.Event) -> None:
        super().__init__(event)
        self.blocks = 0

    def block(self, seconds: float) -> bool:
        self.blocks += 1
        self.event.wait(seconds)
        return True


def test_wait_blocks_in_the_works_waiter_not_in_sleeps(monkeypatch) -> None:
    """Past its first spin a torch wait hands the time to the hetcomm Work's waiter, and
    completes as soon as it does (no sleep between polls)."""
    done = threading.Event()
    part = BlockingWork(done)
    pending = ht._Pending("t", [part], [], [], 30.0)
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", lambda s: slept.append(s))
    threading.Timer(0.05, done.set).start()
    ht._Work(pending).wait()
    assert pending.done and part.blocks >= 1 and not slept


class ThreadWork(FakeWork):
    """A FakeWork that notes which threads called test()."""

    def __init__(self, event: threading.Event) -> None:
        super().__init__(event)
        self.callers: set[int] = set()

    def test(self) -> bool:
        self.callers.add(threading.get_ident())
        return super().test()


class PolledPending(ht._Pending):
    """A _Pending that notes which threads polled it (a poll that finds it locked by its
    waiter returns at once, so its Work does not see that one)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.pollers: set[int] = set()

    def poll(self) -> bool:
        self.pollers.add(threading.get_ident())
        return super().poll()


def test_the_progress_thread_leaves_a_waited_operation_alone() -> None:
    """While a thread waits on a group's oldest operation the progress thread does not poll it
    (it sleeps instead); once the wait ends it completes the group's next operation, which
    nobody waits on, so that its future completes."""
    key = -7
    first_done, second_done = threading.Event(), threading.Event()
    first, second = ThreadWork(first_done), ThreadWork(second_done)
    waited = PolledPending("first", [first], [], [torch.zeros(1)], 30.0)
    behind = ht._Pending("second", [second], [], [torch.ones(1)], 30.0)
    waiter = threading.Thread(target=waited.wait)
    waiter.start()
    deadline = time.monotonic() + 10
    while not waited.waited and time.monotonic() < deadline:
        time.sleep(0.001)
    assert waited.waited
    ht._PROGRESS.add(key, waited)
    ht._PROGRESS.add(key, behind)
    future = behind.future
    time.sleep(0.05)  # the progress thread has had time to look at the group
    daemon = ht._PROGRESS._thread
    assert daemon is not None
    first_done.set()
    second_done.set()
    waiter.join(10)
    assert waited.done and not waiter.is_alive()
    assert daemon.ident not in waited.pollers, "the progress thread polled a waited operation"
    while not future.done() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert future.done(), "the operation behind the waited one was left undone"
    assert daemon.ident in second.callers
    # the thread takes an ended operation off the queue just after completing its future
    while ht._PROGRESS._queues.get(key) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert not ht._PROGRESS._queues.get(key), "ended operations stay queued"


def test_wait_with_timeout() -> None:
    pending = ht._Pending("t", [FakeWork(threading.Event())], [], [], 30.0)
    with pytest.raises(TimeoutError):
        ht._Work(pending).wait(timedelta(milliseconds=50))


def test_parts_join() -> None:
    events = [threading.Event(), threading.Event()]
    parts = [
        ht._Pending(f"p{i}", [FakeWork(e)], [], [torch.zeros(1)], 30.0)
        for i, e in enumerate(events)
    ]
    whole = ht._Pending("whole", list(parts), [], [t for p in parts for t in p.result], 30.0)
    assert not whole.poll()
    events[0].set()
    assert not whole.poll()
    events[1].set()
    assert whole.poll() and whole.future.done() and len(whole.future.value()) == 2
