"""torch backend "hetcomm": receive from any source, errors as torch's backends raise them,
profiler events, and no message crossing from a destroyed group to the next one."""

from __future__ import annotations

import contextlib
import re
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from _torch_world import ADDRESS_VARS
from mpi4py import MPI

import hetcomm
from hetcomm import introspect
from hetcomm.torch import profile
from hetcomm.torch.errors import ArgumentError, DistBackendError

pytestmark = pytest.mark.mpi(min_size=2)
# what torch's own suite matches in a timeout's message (distributed_test.py)
TORCH_TIMEOUT_WORDS = re.compile(" (Timed out|closed|timeout) ")


def recv_transport(group: dist.ProcessGroup, t: torch.Tensor) -> str:
    # the transport the plan gives this receive (the same on every rank)
    return introspect.transport_of(group.comm, "recv", t.numpy(), "t").name


class TestAnySource:
    def test_recv_and_irecv_without_src_return_the_sender(self, errors, pg, rng) -> None:
        """Each rank in turn receives two messages from every other, with dist.recv(t) and
        dist.irecv(t) in turn, in whatever order they come; each holds its sender's rank, its
        number and random data drawn on every rank, so the returned rank and the data are both
        checked against what that rank sent."""
        n, me = dist.get_world_size(), dist.get_rank()
        data = torch.from_numpy(rng.standard_normal((n, n, 2, 6)))  # [receiver, sender, number]
        if recv_transport(pg, torch.empty(8, dtype=torch.float64)) != "mpi":
            with pytest.raises(ArgumentError, match="ANY_SOURCE") as info:
                dist.recv(torch.empty(8, dtype=torch.float64))
            errors.expect(isinstance(info.value, RuntimeError), "not a RuntimeError")
            errors.expect(
                isinstance(info.value.__cause__, hetcomm.InvalidArgument), "cause not kept"
            )
            errors.verify()
            return
        for receiver in range(n):
            if me == receiver:
                seen: dict[int, list[int]] = {}
                for i in range(2 * (n - 1)):
                    got = torch.full((8,), float("nan"), dtype=torch.float64)
                    if i % 2 == 0:
                        sender = dist.recv(got)
                    else:
                        work = dist.irecv(got)
                        work.wait()
                        sender = work._source_rank()
                    errors.expect(sender == int(got[0]), f"{sender} sent {got[0]}")
                    number = int(got[1])
                    seen.setdefault(sender, []).append(number)
                    if 0 <= sender < n and sender != me and number in (0, 1):
                        errors.expect(
                            torch.equal(got[2:], data[me, sender, number]),
                            f"data from {sender} differs",
                        )
                want = {r: [0, 1] for r in range(n) if r != me}
                errors.expect(seen == want, f"messages seen: {seen}")
            else:
                for number in range(2):
                    head = torch.tensor([float(me), float(number)], dtype=torch.float64)
                    dist.send(torch.cat([head, data[receiver, me, number]]), receiver)
            dist.barrier()
        errors.verify()


class TestErrors:
    def test_timeout_is_a_torch_backend_error(self, errors, pg) -> None:
        """Rank 0 alone enters a barrier of a group with a 1 s timeout: it raises torch's
        DistBackendError (a RuntimeError and a TimeoutError) in torch's words, within the
        time, with hetcomm's CommTimeout as cause; the next call says the group is closed.
        Then the other ranks enter the barrier, which lets MPI end rank 0's."""
        group = dist.new_group(timeout=timedelta(seconds=1))
        if dist.get_rank() == 0:
            t0 = MPI.Wtime()
            try:
                dist.barrier(group=group)
                errors.append("barrier of one rank: no timeout")
            except DistBackendError as exc:
                waited = MPI.Wtime() - t0
                errors.expect(waited < 15, f"timed out after {waited:.1f} s")
                text = str(exc)
                errors.expect(bool(TORCH_TIMEOUT_WORDS.search(text)), f"torch's words: {text}")
                errors.expect("timed out" in text, f"'timed out' not in: {text}")
                errors.expect(isinstance(exc, TimeoutError), "not a TimeoutError")
                errors.expect(isinstance(exc.__cause__, hetcomm.CommTimeout), "cause lost")
            try:
                dist.all_reduce(torch.ones(2), group=group)
                errors.append("call after the timeout: no error")
            except DistBackendError as exc:
                errors.expect(" closed " in str(exc), f"after the timeout: {exc}")
                errors.expect(isinstance(exc.__cause__, hetcomm.CommAborted), "cause lost")
        MPI.COMM_WORLD.Barrier()
        if dist.get_rank() != 0:
            dist.barrier(group=group)
        dist.destroy_process_group(group)
        errors.verify()

    def test_mismatched_receive_is_a_torch_backend_error(self, errors, pg) -> None:
        """Rank 0 sends 5 elements, rank 1 receives 4: rank 1 gets DistBackendError with
        torch's "Detected mismatch" and hetcomm's MismatchError as cause."""
        group = dist.new_group()
        me = dist.get_rank()
        if me == 0:
            with contextlib.suppress(DistBackendError):  # the sender may fail too
                dist.send(torch.arange(5.0), 1, group=group)
        elif me == 1:
            try:
                dist.recv(torch.empty(4), 0, group=group)
                errors.append("receive of another size: no error")
            except DistBackendError as exc:
                errors.expect("Detected mismatch" in str(exc), f"words: {exc}")
                errors.expect(isinstance(exc.__cause__, hetcomm.MismatchError), "cause lost")
        dist.destroy_process_group(group)
        errors.verify()

    def test_bad_arguments_are_value_and_runtime_errors(self, errors, pg) -> None:
        n = dist.get_world_size()
        for call in (
            lambda: pg.allreduce([torch.ones(2), torch.ones(2)], dist.AllreduceOptions()),
            lambda: dist.all_gather([torch.empty(4)] * (n - 1) + [torch.empty(5)], torch.ones(4)),
            lambda: dist.all_reduce(torch.ones(2, dtype=torch.int32), op=dist.ReduceOp.BAND),
        ):
            try:
                call()
                errors.append("bad argument: no error")
            except Exception as exc:
                errors.expect(
                    isinstance(exc, ValueError) and isinstance(exc, RuntimeError),
                    f"{type(exc).__mro__} is not both ValueError and RuntimeError",
                )
        errors.verify()

    def test_a_destroyed_group_is_closed(self, errors, pg) -> None:
        group = dist.new_group()
        dist.destroy_process_group(group)
        with pytest.raises(DistBackendError, match=" closed "):
            group.allreduce([torch.ones(2)], dist.AllreduceOptions()).wait()
        errors.verify()

    def test_hetcomm_errors_are_runtime_errors(self) -> None:
        for cls in (hetcomm.CommTimeout, hetcomm.CommAborted, hetcomm.MismatchError):
            assert issubclass(cls, RuntimeError), cls
        assert issubclass(hetcomm.CommTimeout, TimeoutError)
        assert issubclass(hetcomm.InvalidArgument, ValueError)


class TestProfiler:
    def test_collectives_show_as_hetcomm_events_with_shapes(self, errors, pg) -> None:
        n, me = dist.get_world_size(), dist.get_rank()
        right, left = (me + 1) % n, (me - 1) % n
        a, b = torch.ones(3, 4), torch.zeros(6)
        # the autograd profiler, as torch's suite uses (its torch.profiler tests cover that
        # API; its first start here takes seconds)
        with torch.autograd.profiler.profile(record_shapes=True) as prof:
            dist.all_reduce(a)
            dist.all_reduce(b, async_op=True).wait()
            dist.broadcast(torch.zeros(5), 0)
            dist.all_gather([torch.empty(2) for _ in range(n)], torch.ones(2))
            got = torch.empty(7)
            works = [dist.irecv(got, left), dist.isend(torch.ones(7), right)]
            for w in works:
                w.wait()
        events = [e for e in prof.function_events if e.name.startswith("hetcomm:")]
        shapes = sorted((e.name, str(e.input_shapes)) for e in events)
        want = sorted(
            [
                ("hetcomm:all_reduce", "[[3, 4]]"),
                ("hetcomm:all_reduce", "[[6]]"),
                ("hetcomm:broadcast", "[[5]]"),
                ("hetcomm:all_gather", "[[2]]"),
                ("hetcomm:recv", "[[7]]"),
                ("hetcomm:send", "[[7]]"),
            ]
        )
        errors.expect(shapes == want, f"events {shapes}, expected {want}")
        errors.expect(all(e.is_async for e in events), "events not asynchronous")
        errors.verify()

    def test_no_event_without_a_profiler(self, errors, pg, monkeypatch) -> None:
        made = []

        class Counting(profile.Record):
            def __init__(self, *args) -> None:
                made.append(args)
                super().__init__(*args)

        monkeypatch.setattr(profile, "Record", Counting)
        errors.expect(not profile.active(), "a profiler is active")
        dist.all_reduce(torch.ones(3))
        errors.expect(not made, f"events made without a profiler: {made}")
        errors.verify()

    def test_the_hetcomm_trace_keeps_recording_beside_the_profiler(self, errors, pg) -> None:
        """hetcomm's trace is an observer of every completed Work: it still sees the operation
        that the torch profiler records."""
        import hetcomm.work as hw

        traced: list = []
        hw.add_observer(traced.append)
        try:
            with torch.autograd.profiler.profile() as prof:
                dist.all_reduce(torch.ones(4))
        finally:
            hw.remove_observer(traced.append)
        names = [e.name for e in prof.function_events]
        errors.expect("hetcomm:all_reduce" in names, f"profiler events: {names}")
        errors.expect("all_reduce" in [w.op for w in traced], f"traced: {traced}")
        errors.verify()


@contextlib.contextmanager
def default_group(timeout_s: float):
    with pytest.MonkeyPatch.context() as mp:
        for var in ADDRESS_VARS:
            mp.delenv(var, raising=False)
        dist.init_process_group("hetcomm", timeout=timedelta(seconds=timeout_s))
    try:
        yield dist.group.WORLD
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_message_on_a_destroyed_group_never_reaches_the_next(errors, rng) -> None:
    """Rank 0 destroys its default group; rank 1 then sends A on it (the send completes or
    fails within its timeout); both make a new default group and rank 1 sends B: rank 0
    receives B (with Open MPI's reuse of freed communicator ids it received A)."""
    world = MPI.COMM_WORLD
    a, b = (torch.from_numpy(rng.standard_normal(16)).float() for _ in range(2))
    with default_group(timeout_s=3):
        me = dist.get_rank()
        # no message on the group before: Open MPI then hands A to the next communicator that
        # takes the freed id (after a first exchange between the two it does not)
        if me == 0:
            dist.destroy_process_group()
        world.Barrier()
        if me == 1:
            with contextlib.suppress(RuntimeError):
                dist.send(a, 0)
    with default_group(timeout_s=30):
        if me == 1:
            dist.send(b, 0)
        elif me == 0:
            got = torch.full((16,), float("nan"))
            dist.recv(got, 1)
            errors.expect(not torch.equal(got, a), "rank 0 received A, sent on the old group")
            errors.expect(torch.equal(got, b), f"rank 0 received {got[:4]}..., not B")
    errors.verify()
