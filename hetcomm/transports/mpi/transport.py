"""MPI transport: host buffers (and device buffers where the MPI is GPU-aware) through mpi4py."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from mpi4py import MPI

from ...argcheck import contiguous_in
from ...arrays import own_block
from ...errors import TransportUnavailable
from ...ops import ReduceOp
from ...work import BusyPoll, Work
from ..base import Context, Transport
from ..worker import InOrderWorker
from . import node, persistent, recipes, schedule
from .datatypes import DATATYPES, mpi_op
from .prepared import Prepared, address
from .receive import OneReceive, Receive
from .schedule import LANE_BYTES, LANE_MIN, laned

if TYPE_CHECKING:
    from ...arrays import Buffer
    from ...topology import Topology

_IN_PLACE = MPI.IN_PLACE
_AVG = ReduceOp.AVG


class MpiTransport(Transport):
    """Every operation as MPI calls on the communicator's own MPI communicator: non-blocking,
    made and polled by the calling thread for blocking calls and small asynchronous ones, by a
    lane thread for larger asynchronous ones (see _start); blocking on the lane for the large
    all-reduces, reduces, broadcasts and reduce-scatters (see LANE_MIN); small collectives
    through cached persistent requests where the MPI library has them (see _recipe)."""

    name: ClassVar[str] = "mpi"
    memory: ClassVar[tuple[str, ...]] = ("host", "device")
    any_source: ClassVar[bool] = True

    def __init__(self, comm: Context) -> None:
        super().__init__(comm)
        self._mpi: MPI.Intracomm = comm.mpi
        self._lane = InOrderWorker("hetcomm-mpi-lane")
        # which collectives run blocking on the lane: the built-in table, then what `hetcomm
        # tune` measured here (the tuning is the same on every rank, so is this)
        tuned = comm.config.tuned
        self.lane_min = {**LANE_MIN, **(tuned.lane_min if tuned is not None else {})}
        members = comm.topology.members()
        self._not_aware = [m.rank for m in members if not m.gpu_aware]
        # collectives up to this many bytes run as cached persistent requests (0: none), those
        # of `_persistent_ops`; the configuration and the MPI library are the same on every
        # rank, so are these. Larger ones run blocking on the lane (see LANE_MIN).
        self.persistent_off = persistent.unavailable()
        limit = min(comm.config.persistent_max, LANE_BYTES)
        self._persistent_max = 0 if self.persistent_off else limit
        self._persistent_ops = frozenset(persistent.INITS) - persistent.missing()
        self._recipes: dict[tuple, persistent.Recipe | None] = {}
        self.requests = persistent.Requests(comm, self._mpi)
        self._prepared = Prepared(self)
        # fused host all-reduces through shared memory, where the group is one node's ranks
        self._one_node: bool | None = None  # known at the first fused all-reduce
        self._node: node.NodeReduce | None = None

    def drain(self, op: str, seq: int) -> None:
        """Wait (within the timeout) until the lane has run every job queued on it. Open MPI
        numbers every non-blocking collective of a communicator, every persistent one at its
        init, and the collectives inside MPI_Comm_split and MPI_Comm_dup, from one counter, and
        a small collective queued on the lane takes its number when it runs there."""
        drained = self._lane.drained
        if not drained():
            Work(self.comm, f"{op} after the mpi lane", seq, drained).wait()

    def close(self) -> None:
        """Free the persistent requests and the node segments."""
        self.requests.close()
        if self._node is not None:
            self._node.close(free_comm=self.comm._aborted is None)
            self._node = None

    def fits_node(self, nbytes: int) -> bool:
        """Whether a blocking fused all-reduce of `nbytes` of host memory goes through shared
        segments (every rank of the group on one node, a size they hold)."""
        if self._one_node is None:
            # a simulated host of its own counts as another node
            ranks = list(self.comm.topology)
            self._one_node = len(ranks) > 1 and len({(r.host, r.node) for r in ranks}) == 1
        return self._one_node and 0 < nbytes <= node.MAX_BYTES

    def node_off(self) -> None:
        """No shared segments for this group any more (they could not be had on some rank):
        its fused all-reduces go through MPI. Local: every rank learnt it in the same call."""
        self._one_node = False

    def node_reduce(self, op: str, seq: int) -> node.NodeReduce:
        """The shared segments of fused all-reduces (hetcomm.transports.mpi.node). Its first use
        duplicates the communicator, a collective that waits until the lane has made the calls
        still queued on it (see drain)."""
        if self._node is None:
            self.drain(op, seq)
            self._node = node.NodeReduce(self._mpi)
        return self._node

    def _mem(self, buf: Buffer) -> Any:
        """What MPI gets for `buf`: the host view, or (a GPU-aware MPI only) the device memory,
        once the work queued on the array's stream is done. A device pointer never reaches an
        MPI library that is not GPU-aware: that would crash it."""
        if buf.host is not None:
            return buf.host
        if self._not_aware:
            raise TransportUnavailable(
                f"group '{self.comm.name}': the MPI library is not GPU-aware on ranks "
                f"{self._not_aware}; it cannot take {buf.describe()} (a device pointer would "
                "crash it)"
            )
        from ...kernels.device import caller_stream

        caller_stream(buf).synchronize()
        return MPI.buffer.fromaddress(buf.ptr, buf.nbytes)

    @classmethod
    def unavailable(cls, topology: Topology) -> str | None:
        """Always None: the communicator is itself MPI."""
        return None  # the communicator itself is MPI, so MPI is always there

    def _start(
        self,
        op: str,
        seq: int,
        nbytes: int,
        nonblocking: Callable[[], MPI.Request],
        blocking: Callable[[], Any],
        finish: Sequence[Callable[[], None]] = (),
    ) -> Work:
        """One MPI call: blocking on the lane where `laned` says so (see LANE_MIN); else
        non-blocking, started from this thread while the lane is idle and the call is at most
        LANE_BYTES, and else on the lane (behind its jobs), which waits it to its end. MPI
        moves a request only inside MPI calls, so a large one started here would move only
        while its Work is polled: on the lane it goes on beside the caller's computation (the
        calling thread's blocking calls of any size take the prepared route instead)."""
        lane = self._lane
        nonblocking_call = not laned(self.lane_min, op, nbytes)
        with lane.lock:
            if nonblocking_call and nbytes <= LANE_BYTES and lane.idle():
                busy = BusyPoll(nonblocking().Test)
                work = Work(self.comm, op, seq, busy, finish, waiter=busy.wait)
                work.info = {"transport": "mpi", "bytes": nbytes, "stages": 1}
                return work
            job = lane.submit(partial(_to_the_end, nonblocking) if nonblocking_call else blocking)
        work = Work(
            self.comm, op, seq, job.is_set, [job.check, *finish], waiter=job.wait, signal=job
        )
        work.info = {"transport": "mpi", "bytes": nbytes, "stages": 1}
        return work

    def _start_calls(
        self,
        op: str,
        seq: int,
        nbytes: int,
        calls: Sequence[Callable[[], Any]],
        finish: Sequence[Callable[[], None]] = (),
    ) -> Work:
        """An operation cut into several blocking MPI calls (large counts): all of them, in
        order, as one job of the lane."""

        def run() -> None:
            for call in calls:
                call()

        with self._lane.lock:
            job = self._lane.submit(run)
        work = Work(
            self.comm, op, seq, job.is_set, [job.check, *finish], waiter=job.wait, signal=job
        )
        work.info = {"transport": "mpi", "bytes": nbytes, "stages": len(calls)}
        return work

    def _reducible(self, buf: Buffer) -> None:
        if buf.host is None and buf.dtype in ("float16", "bfloat16"):
            raise TransportUnavailable(
                f"group '{self.comm.name}': MPI cannot reduce {buf.dtype} device arrays (its "
                "user-defined operations run on the host); use the staged or direct transport"
            )

    def _average(self, buf: Buffer) -> list[Callable[[], None]]:
        from ...kernels import reduce

        if buf.host is None:  # device memory of a GPU-aware MPI: divide on the GPU
            from ...kernels.device import caller_stream, divide_on

            stream = caller_stream(buf)
            n = self._mpi.Get_size()

            def divide() -> None:
                divide_on(stream, buf.ptr, buf.count, n, buf.dtype)
                stream.synchronize()

            return [divide]
        host, dtype, n = (
            buf.host.view(reduce.storage_dtype(buf.dtype)),
            buf.dtype,
            self._mpi.Get_size(),
        )
        return [lambda: reduce.divide(host, n, dtype)]

    def all_reduce(self, x: Buffer, out: Buffer, op: ReduceOp, seq: int) -> Work:
        """A cached persistent request when small, else MPI_Allreduce (AVG divides after)."""
        self._reducible(x)
        recipe = self._recipe("all_reduce", x.dtype, x.count, op, -1)
        if recipe is not None:
            finish = self._average(out) if op is _AVG else ()
            return self._start_persistent(recipe, seq, x, out, finish)
        dt = DATATYPES[x.dtype]
        mop, mpi = mpi_op(x.dtype, op), self._mpi
        finish = self._average(out) if op is _AVG else ()
        spans = schedule.spans(out)
        if len(spans) > 1:
            xs, os_ = _flat(x), _flat(out)
            calls = [
                partial(
                    mpi.Allreduce,
                    _IN_PLACE if out is x else (xs[s : s + n], dt),
                    (os_[s : s + n], dt),
                    mop,
                )
                for s, n in spans
            ]
            return self._start_calls("all_reduce", seq, out.nbytes, calls, finish)
        send = _IN_PLACE if out is x else (self._mem(x), dt)
        recv = (self._mem(out), dt)
        return self._start(
            "all_reduce",
            seq,
            out.nbytes,
            lambda: mpi.Iallreduce(send, recv, mop),
            lambda: mpi.Allreduce(send, recv, mop),
            finish,
        )

    # ---- persistent collectives (mpi/persistent.py) ----------------------------------------

    def _recipe(
        self, op: str, dtype: str | None, count: int, rop: ReduceOp | None, root: int
    ) -> persistent.Recipe | None:
        """The persistent collective that serves this signature (x's dtype and element count),
        or None: mpi/recipes.py, for the forms this MPI library has, up to the configured
        bytes. Recipes are kept per key (they are values, made alike again where dropped)."""
        if not self._persistent_max or op not in self._persistent_ops:
            return None
        key = recipes.key(op, dtype, count, rop, root)
        if key is None:
            return None
        try:
            return self._recipes[key]
        except KeyError:
            pass
        if len(self._recipes) >= 4096:
            self._recipes.clear()
        mpi = self._mpi
        recipe = recipes.make(key, mpi.Get_rank(), mpi.Get_size(), self._persistent_max)
        self._recipes[key] = recipe
        return recipe

    def _start_persistent(
        self,
        recipe: persistent.Recipe,
        seq: int,
        src: Buffer | None,
        dst: Buffer | None,
        finish: Sequence[Callable[[], None]] = (),
    ) -> Work:
        """The general path of a small collective: its cached persistent request, `src`
        copied into its scratch and the result out into `dst` once complete (None: nothing
        goes in or out on this rank); started from this thread while the lane is idle, else
        queued on the lane behind its jobs, so that it keeps its place in issue order either
        way. Device buffers (a GPU-aware MPI) go through the host scratch."""
        for buf in (src, dst):
            if buf is not None and buf.host is None:
                # refuses device memory where the MPI is not GPU-aware (the same answer as the
                # other operations), else waits for the work queued on the array's stream
                self._mem(buf)
        slot = self.requests.take(recipe)
        if src is not None:
            if src.host is None:
                _device_copy(address(slot.scratch), src.ptr, src.nbytes)
            else:
                slot.scratch[...] = src.host
        deliver = None if dst is None else partial(_copy_out, slot.out, dst)
        # the bytes the general path sizes each collective by (see _start): an all_gather's
        # output, the others' input
        sized = dst if recipe.op == "all_gather" or src is None else src
        return self.start_slot(slot, seq, deliver, finish, sized.nbytes if sized else 0)

    def start_slot(
        self,
        slot: persistent.Slot,
        seq: int,
        deliver: Callable[[], None] | None,
        finish: Sequence[Callable[[], None]],
        nbytes: int,
    ) -> Work:
        """Start persistent collective `slot`, its input in its scratch (`deliver` copies
        the result out once complete), and its Work: from this thread while the lane is idle,
        else queued on the lane behind its jobs, so that it keeps its place in issue order."""
        number = slot.begin(deliver, seq)
        poll = partial(slot.poll, number)
        op, lane = slot.op, self._lane
        with lane.lock:
            if lane.idle():
                slot.make().Start()
                busy = BusyPoll(poll)
                work = Work(self.comm, op, seq, busy, finish, waiter=busy.wait)
            else:
                job = slot.job = lane.submit(slot.run)
                work = Work(self.comm, op, seq, poll, finish, waiter=job.wait, signal=job)
        work.info = {"transport": "mpi", "bytes": nbytes, "stages": 1, "persistent": True}
        return work

    # ---- prepared calls (hetcomm.routes.Route, mpi/prepared.py) ---------------------------

    def prepare(
        self, op: str, x: Buffer | None, out: Buffer | None, rop: ReduceOp | None, root: int
    ) -> Callable[..., bool] | None:
        """The blocking call of one signature on host arrays, made and waited for on the
        calling thread with no Work (mpi/prepared.py); None where the general path runs."""
        return self._prepared.prepare(op, x, out, rop, root)

    def prepare_async(
        self, op: str, x: Buffer | None, out: Buffer | None, rop: ReduceOp | None, root: int
    ) -> Callable[..., Work] | None:
        """The asynchronous start of one signature on host arrays: sends, receives and the
        collectives of persistent requests (mpi/prepared.py); None where the general path
        runs."""
        return self._prepared.prepare_async(op, x, out, rop, root)

    def reduce(self, x: Buffer, op: ReduceOp, root: int, seq: int) -> Work:
        """MPI_Reduce into the root's `x` (AVG divides after)."""
        self._reducible(x)
        dt, mpi = DATATYPES[x.dtype], self._mpi
        at_root = mpi.Get_rank() == root
        finish = self._average(x) if at_root and op is _AVG else ()
        recipe = self._recipe("reduce", x.dtype, x.count, op, root)
        if recipe is not None:
            return self._start_persistent(recipe, seq, x, x if at_root else None, finish)
        mop = mpi_op(x.dtype, op)
        spans = schedule.spans(x)
        if len(spans) > 1:
            xs = _flat(x)
            calls = [
                partial(mpi.Reduce, _IN_PLACE, (xs[s : s + n], dt), mop, root)
                if at_root
                else partial(mpi.Reduce, (xs[s : s + n], dt), None, mop, root)
                for s, n in spans
            ]
            return self._start_calls("reduce", seq, x.nbytes, calls, finish)
        send: Any
        recv: Any
        if at_root:
            send, recv = _IN_PLACE, (self._mem(x), dt)
        else:
            send, recv = (self._mem(x), dt), None
        return self._start(
            "reduce",
            seq,
            x.nbytes,
            lambda: mpi.Ireduce(send, recv, mop, root),
            lambda: mpi.Reduce(send, recv, mop, root),
            finish,
        )

    def broadcast(self, x: Buffer, root: int, seq: int) -> Work:
        """MPI_Bcast, in spans past MPI's count limit."""
        dt, mpi = DATATYPES[x.dtype], self._mpi
        recipe = self._recipe("broadcast", x.dtype, x.count, None, root)
        if recipe is not None:
            at_root = mpi.Get_rank() == root
            return self._start_persistent(
                recipe, seq, x if at_root else None, None if at_root else x
            )
        spans = schedule.spans(x)
        if len(spans) > 1:
            xs = _flat(x)
            calls = [partial(mpi.Bcast, (xs[s : s + n], dt), root) for s, n in spans]
            return self._start_calls("broadcast", seq, x.nbytes, calls)
        buf = (self._mem(x), dt)
        return self._start(
            "broadcast", seq, x.nbytes, lambda: mpi.Ibcast(buf, root), lambda: mpi.Bcast(buf, root)
        )

    def all_gather(self, out: Buffer, x: Buffer, seq: int) -> Work:
        """MPI_Allgather, in spans past MPI's count limit."""
        dt, mpi = DATATYPES[x.dtype], self._mpi
        recipe = self._recipe("all_gather", x.dtype, x.count, None, -1)
        if recipe is not None:
            return self._start_persistent(recipe, seq, x, out)
        # x that is this rank's block of out (the in-place form) is MPI_IN_PLACE: MPI takes
        # this rank's share from where it lies in out, and forbids the two buffers to alias
        in_place = own_block(x, out, mpi.Get_rank())
        spans = schedule.spans(x, mpi.Get_size())
        if len(spans) > 1:
            # share [s, s+n) of every rank's x lands at s of its block of out: one derived
            # datatype per share, its extent one block, so that rank i's share goes to block i
            xs, o = _flat(x), _flat(out)

            def gather(t: MPI.Datatype, s: int, n: int) -> None:
                mpi.Allgather(_IN_PLACE if in_place else (xs[s : s + n], dt), (o, 1, t))

            calls = [
                partial(_with_block_type, dt, s, n, x.nbytes, partial(gather, s=s, n=n))
                for s, n in spans
            ]
            return self._start_calls("all_gather", seq, out.nbytes, calls)
        send = _IN_PLACE if in_place else (self._mem(x), dt)
        recv = (self._mem(out), dt)
        return self._start(
            "all_gather",
            seq,
            out.nbytes,
            lambda: mpi.Iallgather(send, recv),
            lambda: mpi.Allgather(send, recv),
        )

    def reduce_scatter(self, out: Buffer, x: Buffer, op: ReduceOp, seq: int) -> Work:
        """MPI_Reduce_scatter_block (AVG divides after)."""
        self._reducible(x)
        dt, mpi = DATATYPES[x.dtype], self._mpi
        finish = self._average(out) if op is _AVG else ()
        recipe = self._recipe("reduce_scatter", x.dtype, x.count, op, -1)
        if recipe is not None:
            return self._start_persistent(recipe, seq, x, out, finish)
        mop = mpi_op(x.dtype, op)
        size, me = mpi.Get_size(), mpi.Get_rank()
        if own_block(out, x, me):
            # out inside x (the in-place form): MPI forbids the two to alias, and its own
            # in-place form leaves the result in the first block, so reduce a copy of x, kept
            # by the Work until done (MPI holds only its address)
            copied = contiguous_in(x, copy=True)
            work = self.reduce_scatter(out, copied, op, seq)
            work._keep = (*work._keep, copied)
            return work
        spans = schedule.spans(out, size)
        if len(spans) > 1:
            # a built-in MPI operation cannot reduce a derived datatype: each share of block i
            # is reduced into rank i's out by a reduce rooted there
            xs, o, block = _flat(x), _flat(out), out.count
            calls = [
                partial(
                    mpi.Reduce,
                    (xs[i * block + s : i * block + s + n], dt),
                    (o[s : s + n], dt) if i == me else None,
                    mop,
                    i,
                )
                for s, n in spans
                for i in range(size)
            ]
            return self._start_calls("reduce_scatter", seq, x.nbytes, calls, finish)
        send, recv = (self._mem(x), dt), (self._mem(out), dt)
        return self._start(
            "reduce_scatter",
            seq,
            x.nbytes,
            lambda: mpi.Ireduce_scatter_block(send, recv, mop),
            lambda: mpi.Reduce_scatter_block(send, recv, mop),
            finish,
        )

    def all_to_all(self, out: Buffer, x: Buffer, seq: int) -> Work:
        """MPI_Alltoall, in spans past MPI's count limit."""
        dt, mpi = DATATYPES[x.dtype], self._mpi
        recipe = self._recipe("all_to_all", x.dtype, x.count, None, -1)
        if recipe is not None:
            return self._start_persistent(recipe, seq, x, out)
        size = mpi.Get_size()
        spans = schedule.spans(out, size, size)
        if len(spans) > 1:
            # share [s, s+n) of every block, on both sides: one derived datatype per share
            xs, o, block = _flat(x), _flat(out), x.count // size

            def exchange(t: MPI.Datatype) -> None:
                mpi.Alltoall((xs, 1, t), (o, 1, t))

            calls = [
                partial(_with_block_type, dt, s, n, block * x.itemsize, exchange) for s, n in spans
            ]
            return self._start_calls("all_to_all", seq, x.nbytes, calls)
        send, recv = (self._mem(x), dt), (self._mem(out), dt)
        return self._start(
            "all_to_all",
            seq,
            x.nbytes,
            lambda: mpi.Ialltoall(send, recv),
            lambda: mpi.Alltoall(send, recv),
        )

    def send(self, x: Buffer, dst: int, tag: int, seq: int) -> Work:
        """MPI_Isend on the group's own communicator, with the caller's tag."""
        dt, spans = DATATYPES[x.dtype], schedule.spans(x)
        if len(spans) == 1:
            busy = BusyPoll(self._mpi.Isend((self._mem(x), dt), dst, tag).Test)
            work = Work(self.comm, "send", seq, busy, waiter=busy.wait)
        else:
            # MPI keeps messages of one sender, tag and communicator in order: the receiver's
            # pieces match the sender's one by one
            xs = _flat(x)
            reqs = [self._mpi.Isend((xs[s : s + n], dt), dst, tag) for s, n in spans]
            busy = BusyPoll(partial(MPI.Request.Testall, reqs))
            work = Work(self.comm, "send", seq, busy, waiter=busy.wait)
        work.info = {"transport": "mpi", "bytes": x.nbytes, "stages": len(spans)}
        return work

    def recv(self, x: Buffer, src: int, tag: int, seq: int) -> Work:
        """MPI_Irecv on the group's own communicator, with the caller's tag."""
        spans = schedule.spans(x)
        dt, mpi = DATATYPES[x.dtype], self._mpi
        source = MPI.ANY_SOURCE if src < 0 else src  # src < 0: hetcomm.ANY_SOURCE
        receive: OneReceive | Receive
        if len(spans) == 1:
            receive = OneReceive(mpi.Irecv((self._mem(x), dt), source, tag), src, x.nbytes)
        else:
            # MPI keeps messages of one sender, tag and communicator in order: the receiver's
            # pieces match the sender's one by one. From any source, the first piece is posted
            # alone; the others follow from its sender once it has matched.
            xs = _flat(x)
            pieces = [xs[s : s + n] for s, n in spans]
            if src < 0:
                reqs, rest = [mpi.Irecv((pieces[0], dt), source, tag)], pieces[1:]
            else:
                reqs, rest = [mpi.Irecv((piece, dt), src, tag) for piece in pieces], []
            receive = Receive(src, x.nbytes, x.itemsize, reqs, spans)
            if rest:
                receive.then_from_sender(mpi, dt, tag, rest)
        busy = BusyPoll(receive.poll)
        work = receive.work = Work(self.comm, "recv", seq, busy, waiter=busy.wait)
        work.info = {"transport": "mpi", "bytes": x.nbytes, "stages": len(spans)}
        return work

    def barrier(self, seq: int) -> Work:
        """Its persistent request, else MPI_Ibarrier, or MPI_Barrier on the lane."""
        recipe = self._recipe("barrier", None, 0, None, -1)
        if recipe is not None:
            return self._start_persistent(recipe, seq, None, None)
        mpi = self._mpi
        return self._start("barrier", seq, 0, mpi.Ibarrier, mpi.Barrier)


def _to_the_end(start: Callable[[], MPI.Request]) -> None:
    """Start a non-blocking call and wait for it (on the lane, as its blocking calls do)."""
    start().Wait()


def _copy_out(scratch: np.ndarray, out: Buffer) -> None:
    if out.host is None:
        _device_copy(out.ptr, address(scratch), out.nbytes)
    else:
        out.host[...] = scratch


def _device_copy(dst: int, src: int, nbytes: int) -> None:
    """Copy between host and device memory (either way; the runtime tells them apart), done
    when this returns: a persistent request's scratch lives on the host."""
    import cupy

    rt = cupy.cuda.runtime
    rt.memcpy(dst, src, nbytes, rt.memcpyDefault)


def _flat(buf: Buffer) -> np.ndarray:
    assert buf.host is not None and buf.contiguous, "cut calls need contiguous host buffers"
    return buf.host.reshape(-1)


def _with_block_type(
    base: MPI.Datatype, start: int, count: int, extent: int, call: Callable[[MPI.Datatype], Any]
) -> None:
    """`call(t)` with a datatype of `count` elements `start` elements into a block of `extent`
    bytes, freed afterwards."""
    size = base.Get_size()
    t = base.Create_hindexed([count], [start * size]).Create_resized(0, extent)
    t.Commit()
    try:
        call(t)
    finally:
        t.Free()
