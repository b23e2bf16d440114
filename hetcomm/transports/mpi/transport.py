"""MPI transport: host buffers (and device buffers where the MPI is GPU-aware) through mpi4py."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from mpi4py import MPI

from ...arrays import may_share_memory
from ...errors import TransportUnavailable
from ...ops import ReduceOp
from ...work import BusyPoll, Work, wait_for
from ..base import Context, Transport
from ..worker import InOrderWorker
from . import node, persistent, recipes, schedule
from .datatypes import DATATYPES, mpi_op
from .receive import OneReceive, Receive

if TYPE_CHECKING:
    from ...arrays import Buffer
    from ...topology import Topology

_IN_PLACE = MPI.IN_PLACE
_AVG = ReduceOp.AVG


# The collectives that run as blocking MPI calls on the communicator's lane thread: those of an
# op in LANE_MIN of more bytes than its entry. Every other collective is one non-blocking MPI
# call: made and polled by the calling thread where the caller waits for it (no thread
# hand-off, about 40 us a call on a 2-core VM), else as _start says. MPI never matches
# a blocking collective with a non-blocking one (Open MPI 5 waits forever), so which kind a call
# is depends on its op and size, which every rank agrees on, and never on the state of this
# rank's lane. Measured blocking against non-blocking, 64 KiB-16 MiB on 2 and 4 ranks, Open MPI
# 5.0 (2-core VM) and 4.1.6 (16-core host): the non-blocking forms of all_gather and all_to_all
# took 0.65-1.05x the time of the blocking ones (one all_gather outlier of 5x did not repeat);
# reduce_scatter too up to 4 MiB of input, but about 2x at 16 MiB on both libraries (3 runs);
# broadcast up to 1 MiB, and 1.27-1.38x from 4 MiB on 4 ranks of 4.1.6 in one run (not in
# another); all_reduce 1.2-1.8x on 5.0 from 64 KiB (about 1.0 on 4.1.6) and reduce 2.6-4.5x on
# 5.0 from 64 KiB, where a hand-off costs less than the difference from 256 KiB. `hetcomm tune`
# measures both forms of each op on the machine at hand and its values replace these
# (Tuning.lane_min). Reduces past 128 KiB: on 2 ranks, Open MPI 5.0 (VM) and 4.1.6 (H200
# host), the non-blocking reduce took 3.2-4.9x the blocking one from 128 KiB, the blocking one
# on a bare thread 1.7-2.2x (`hetcomm bench --study lane`, docs/BENCHMARKS.md), and `hetcomm
# tune` put the lane past 128 KiB on both.
LANE_BYTES = 256 * 1024
LANE_MIN: dict[str, int | None] = {
    "all_reduce": LANE_BYTES,
    "reduce": 128 * 1024,
    "broadcast": 2 * 1024 * 1024,
    "reduce_scatter": 4 * 1024 * 1024,
}


def laned(lane_min: dict[str, int | None], op: str, nbytes: int) -> bool:
    """Whether a collective `op` of `nbytes` (the byte count _start is given) runs as a
    blocking MPI call on the lane, by `lane_min` (LANE_MIN and what `hetcomm tune` measured)."""
    least = lane_min.get(op)
    return least is not None and nbytes > least


# polls of a small in-place all-reduce before it is handed to a Work and its bounded wait
_QUICK_TESTS = 32


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
        work = Work(self.comm, op, seq, job.is_set, [job.check, *finish], waiter=job.wait)
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
        work = Work(self.comm, op, seq, job.is_set, [job.check, *finish], waiter=job.wait)
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
        spans = _spans(out)
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
                _device_copy(_address(slot.scratch), src.ptr, src.nbytes)
            else:
                slot.scratch[...] = src.host
        number = slot.begin(None if dst is None else partial(_copy_out, slot.out, dst), seq)
        poll = partial(slot.poll, number)
        op, lane = recipe.op, self._lane
        with lane.lock:
            if lane.idle():
                slot.make().Start()
                busy = BusyPoll(poll)
                work = Work(self.comm, op, seq, busy, finish, waiter=busy.wait)
            else:
                job = slot.job = lane.submit(slot.run)
                work = Work(self.comm, op, seq, poll, finish, waiter=job.wait)
        # the bytes the general path sizes each collective by (see _start): an all_gather's
        # output, the others' input
        sized = dst if op == "all_gather" or src is None else src
        nbytes = sized.nbytes if sized is not None else 0
        work.info = {"transport": "mpi", "bytes": nbytes, "stages": 1, "persistent": True}
        return work

    def _run_persistent(
        self,
        recipe: persistent.Recipe,
        takes: bool,
        gives: bool,
        div: Callable[[np.ndarray], None] | None,
        *arrays_and_seq: Any,
    ) -> bool:
        """The prepared blocking call of a small collective through its cached persistent
        request, inline: the input (the first array, where `takes`) copied into the request's
        scratch, started, polled, the result copied out (into the last array, where `gives`).
        The general path goes through the same request, so declining (the lane is busy)
        changes nothing the other ranks can see. Any shapes will do: the copies take the
        callers' shapes as they are. Every input is copied in before anything is written out,
        so in-place forms need nothing of their own."""
        # lane.idle(), inline and without the lock: only the issuing thread queues jobs, so a
        # lane seen idle stays idle until it queues one, and a lane seen busy sends the call to
        # the general path, which looks again under the lock
        if self._lane.pending:
            return False
        slot = self.requests.take(recipe)
        if takes:
            view = slot.view
            try:
                view[...] = arrays_and_seq[0]
            except ValueError:  # another shape than the latest call's
                slot.copy_in(arrays_and_seq[0])
        request = slot.request
        if request is None:
            request = slot.make()
        slot.active = True
        request.Start()
        # most small collectives end within a few polls (a `while` calling the method directly
        # costs half of a `for` over a bound method)
        polls = _QUICK_TESTS
        while not request.Test():
            polls -= 1
            if not polls:
                busy = BusyPoll(slot.test)
                seq = arrays_and_seq[-1]
                wait_for(self.comm, recipe.op, seq, busy, self.comm.call_timeout, busy.wait)
                break
        slot.active = False
        if gives:
            o = arrays_and_seq[-2]
            oview = slot.oview
            try:
                o[...] = oview
            except ValueError:
                slot.copy_out(o)
            if div is not None:
                div(o)
        return True

    # ---- prepared blocking calls (hetcomm.comm.Route) -----------------------------------

    def prepare(
        self,
        op: str,
        x: Buffer | None,
        out: Buffer | None,
        rop: ReduceOp | None,
        root: int,
    ) -> Callable[..., bool] | None:
        """The blocking call of one signature on host arrays, made and waited for on the
        calling thread, with no Work: the same MPI calls the general path makes for that
        signature (which calls those are depends on the signature alone, so every rank's calls
        match whichever path each rank takes). A prepared call returns False, having moved
        nothing, when the lane has jobs queued (the general path then queues behind them).
        A collective that runs blocking on the lane (see LANE_MIN) is queued there and waited
        for here, bounded, behind whatever the lane has queued (see _prepare_laned). None where
        the general path must run: device memory, counts cut into several calls."""
        if x is not None and (x.host is None or len(_spans(x)) > 1):
            return None
        if out is not None and (out.host is None or len(_spans(out)) > 1):
            return None
        if op == "send":
            return partial(self._run_send, DATATYPES[x.dtype]) if x is not None else None
        if op == "recv":
            return partial(self._run_recv, DATATYPES[x.dtype]) if x is not None else None
        if op == "barrier":
            recipe = self._recipe("barrier", None, 0, None, -1)
            if recipe is None:
                return self._run_barrier
            return partial(self._run_persistent, recipe, False, False, None)
        assert x is not None
        if op in ("all_reduce", "reduce_scatter"):
            self._reducible(x)
        recipe = self._recipe(op, x.dtype, x.count, rop, root)
        if recipe is not None:
            at_root = self._mpi.Get_rank() == root
            takes = op != "broadcast" or at_root
            gives = {"broadcast": not at_root, "reduce": at_root}.get(op, True)
            div = self._divisor(x, rop) if rop is not None and gives else None
            cached = partial(self._run_persistent, recipe, takes, gives, div)
            cached.in_place = True  # type: ignore[attr-defined]
            return cached
        # the byte counts the general path sizes each collective by (see _start)
        nbytes = {"all_gather": out.nbytes if out is not None else 0}.get(op, x.nbytes)
        if laned(self.lane_min, op, nbytes):
            return self._prepare_laned(op, x, rop, root)
        dt = DATATYPES[x.dtype]
        mpi = self._mpi
        if op == "all_reduce":
            assert rop is not None
            mop, div = mpi_op(x.dtype, rop), self._divisor(x, rop)

            def run(xh: np.ndarray, oh: np.ndarray, seq: int) -> bool:
                if self._lane.pending:
                    return False
                send = _IN_PLACE if xh is oh else (xh, dt)
                self._drive(mpi.Iallreduce(send, (oh, dt), mop), "all_reduce", seq)
                if div is not None:
                    div(oh)
                return True

            return run
        if op == "reduce":
            assert rop is not None
            mop, div = mpi_op(x.dtype, rop), self._divisor(x, rop)
            at_root = mpi.Get_rank() == root

            def run_reduce(xh: np.ndarray, seq: int) -> bool:
                if self._lane.pending:
                    return False
                if at_root:
                    self._drive(mpi.Ireduce(_IN_PLACE, (xh, dt), mop, root), "reduce", seq)
                    if div is not None:
                        div(xh)
                else:
                    self._drive(mpi.Ireduce((xh, dt), None, mop, root), "reduce", seq)
                return True

            return run_reduce
        if op == "broadcast":

            def run_broadcast(xh: np.ndarray, seq: int) -> bool:
                if self._lane.pending:
                    return False
                self._drive(mpi.Ibcast((xh, dt), root), "broadcast", seq)
                return True

            return run_broadcast
        if op == "reduce_scatter":
            assert rop is not None
            self._reducible(x)
            mop, div = mpi_op(x.dtype, rop), self._divisor(x, rop)

            def run_scatter(xh: np.ndarray, oh: np.ndarray, seq: int) -> bool:
                if self._lane.pending:
                    return False
                if may_share_memory(xh, oh):
                    # out inside x (this rank's block, say): MPI's in-place form leaves the
                    # result in the first block, so reduce a copy of x into out instead
                    xh = xh.copy()
                request = mpi.Ireduce_scatter_block((xh, dt), (oh, dt), mop)
                self._drive(request, "reduce_scatter", seq)
                if div is not None:
                    div(oh)
                return True

            run_scatter.in_place = True  # type: ignore[attr-defined]
            return run_scatter
        start = {"all_gather": mpi.Iallgather, "all_to_all": mpi.Ialltoall}.get(op)
        if start is None:
            return None
        # where x lies in place (all_gather: x is this rank's block of out; all_to_all: x is
        # out), MPI_IN_PLACE; any other overlap the general path takes (it packs)
        offset = mpi.Get_rank() * x.nbytes if op == "all_gather" else 0

        def run_blocks(xh: np.ndarray, oh: np.ndarray, seq: int) -> bool:
            if self._lane.pending:
                return False
            if not may_share_memory(xh, oh):
                send: Any = (xh, dt)
            elif _address(xh) == _address(oh) + offset:
                send = _IN_PLACE
            else:
                return False
            self._drive(start(send, (oh, dt)), op, seq)
            return True

        run_blocks.in_place = True  # type: ignore[attr-defined]
        return run_blocks

    def _prepare_laned(
        self, op: str, x: Buffer, rop: ReduceOp | None, root: int
    ) -> Callable[..., bool] | None:
        """The prepared call of a collective that runs blocking on the lane: the general path's
        blocking MPI call, queued on the lane (in issue order, behind its jobs) and waited for
        by the calling thread within the call's timeout, without the general path's Buffers
        and Work. None for the all_gather and all_to_all (their in-place forms are the general
        path's; `hetcomm tune` lanes them rarely, neither machine measured so)."""
        dt, mpi, lane = DATATYPES[x.dtype], self._mpi, self._lane
        after: Callable[[np.ndarray], None] | None = None
        call: Callable[..., None]  # the blocking MPI call on the route's arrays
        if op == "all_reduce":
            assert rop is not None
            mop, after = mpi_op(x.dtype, rop), self._divisor(x, rop)

            def all_reduce(xh: np.ndarray, oh: np.ndarray) -> None:
                mpi.Allreduce(_IN_PLACE if xh is oh else (xh, dt), (oh, dt), mop)

            call = all_reduce

        elif op == "reduce":
            assert rop is not None
            mop = mpi_op(x.dtype, rop)
            if mpi.Get_rank() == root:
                after = self._divisor(x, rop)

                def reduce_root(xh: np.ndarray) -> None:
                    mpi.Reduce(_IN_PLACE, (xh, dt), mop, root)

                call = reduce_root
            else:

                def reduce(xh: np.ndarray) -> None:
                    mpi.Reduce((xh, dt), None, mop, root)

                call = reduce

        elif op == "broadcast":

            def broadcast(xh: np.ndarray) -> None:
                mpi.Bcast((xh, dt), root)

            call = broadcast

        elif op == "reduce_scatter":
            assert rop is not None
            self._reducible(x)
            mop, after = mpi_op(x.dtype, rop), self._divisor(x, rop)

            def reduce_scatter(xh: np.ndarray, oh: np.ndarray) -> None:
                mpi.Reduce_scatter_block((xh, dt), (oh, dt), mop)

            call = reduce_scatter

        else:
            return None

        def run_laned(*arrays_and_seq: Any) -> bool:
            *arrays, seq = arrays_and_seq
            if len(arrays) == 2 and arrays[0] is not arrays[1] and may_share_memory(*arrays):
                # reduce_scatter's out inside x: reduce a copy of x (as the non-blocking form
                # does), made here: made on the lane, a 16 MiB in-place call took twice as
                # long (17-18 against 8.5-9.3 ms, 2 ranks, CPU VM)
                arrays[0] = arrays[0].copy()
            with lane.lock:
                job = lane.submit(partial(call, *arrays))
            wait_for(self.comm, op, seq, job.is_set, self.comm.call_timeout, job.wait)
            job.check()
            if after is not None:
                after(arrays[-1])  # the result: out, or x at a reduce's root
            return True

        run_laned.in_place = op == "reduce_scatter"  # type: ignore[attr-defined]
        return run_laned

    def _divisor(self, x: Buffer, rop: ReduceOp) -> Callable[[np.ndarray], None] | None:
        """AVG's division of a result on the host (None for the other ops)."""
        if rop is not _AVG:
            return None
        from ...kernels import reduce

        storage, dtype, n = reduce.storage_dtype(x.dtype), x.dtype, self._mpi.Get_size()
        return lambda a: reduce.divide(a.reshape(-1).view(storage), n, dtype)

    def _drive(self, request: MPI.Request, op: str, seq: int) -> None:
        """Wait here for a request started here: a few quick Tests, then the bounded wait."""
        test = request.Test
        for _ in range(_QUICK_TESTS):
            if test():
                return
        busy = BusyPoll(test)
        wait_for(self.comm, op, seq, busy, self.comm.call_timeout, busy.wait)

    def _run_barrier(self, seq: int) -> bool:
        if self._lane.pending:
            return False
        self._drive(self._mpi.Ibarrier(), "barrier", seq)
        return True

    def prepare_async(
        self, op: str, x: Buffer | None, out: Buffer | None, rop: ReduceOp | None, root: int
    ) -> Callable[..., Work] | None:
        """The asynchronous start of a send or receive of one signature on host arrays: the
        general path's MPI call on the array itself, and its Work (None: the general path)."""
        if op not in ("send", "recv") or x is None or x.host is None or len(_spans(x)) > 1:
            return None
        start = self._start_send if op == "send" else self._start_recv
        return partial(start, DATATYPES[x.dtype])

    def _start_send(self, dt: MPI.Datatype, xh: np.ndarray, dst: int, tag: int, seq: int) -> Work:
        busy = BusyPoll(self._mpi.Isend((xh, dt), dst, tag).Test)
        work = Work(self.comm, "send", seq, busy, waiter=busy.wait)
        work.info = {"transport": "mpi", "bytes": xh.nbytes, "stages": 1}
        return work

    def _start_recv(self, dt: MPI.Datatype, xh: np.ndarray, src: int, tag: int, seq: int) -> Work:
        receive = OneReceive(self._mpi.Irecv((xh, dt), src, tag), src, xh.nbytes)
        busy = BusyPoll(receive.poll)
        work = receive.work = Work(self.comm, "recv", seq, busy, waiter=busy.wait)
        work.info = {"transport": "mpi", "bytes": xh.nbytes, "stages": 1}
        return work

    def _run_send(self, dt: MPI.Datatype, xh: np.ndarray, dst: int, tag: int, seq: int) -> bool:
        self._drive(self._mpi.Isend((xh, dt), dst, tag), "send", seq)
        return True

    def _run_recv(self, dt: MPI.Datatype, xh: np.ndarray, src: int, tag: int, seq: int) -> bool:
        test = OneReceive(self._mpi.Irecv((xh, dt), src, tag), src, xh.nbytes).poll
        for _ in range(_QUICK_TESTS):
            if test():
                return True
        busy = BusyPoll(test)
        wait_for(self.comm, "recv", seq, busy, self.comm.call_timeout, busy.wait)
        return True

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
        spans = _spans(x)
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
        spans = _spans(x)
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
        spans = _spans(x, mpi.Get_size())
        if len(spans) > 1:
            # share [s, s+n) of every rank's x lands at s of its block of out: one derived
            # datatype per share, its extent one block, so that rank i's share goes to block i
            xs, o = _flat(x), _flat(out)

            def gather(t: MPI.Datatype, s: int, n: int) -> None:
                mpi.Allgather((xs[s : s + n], dt), (o, 1, t))

            calls = [
                partial(_with_block_type, dt, s, n, x.nbytes, partial(gather, s=s, n=n))
                for s, n in spans
            ]
            return self._start_calls("all_gather", seq, out.nbytes, calls)
        send, recv = (self._mem(x), dt), (self._mem(out), dt)
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
        spans = _spans(out, size)
        if len(spans) > 1:
            # a built-in MPI operation cannot reduce a derived datatype: each share of block i
            # is reduced into rank i's out by a reduce rooted there (x and out never overlap:
            # the communicator copies an x that overlaps out)
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
        spans = _spans(out, size, size)
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
        dt, spans = DATATYPES[x.dtype], _spans(x)
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
        spans = _spans(x)
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


def _spans(buf: Buffer, blocks: int = 1, parts: int = 1) -> list[tuple[int, int]]:
    """The calls `buf` (of `parts` equal parts, moved `blocks` at a time) is cut into: one,
    unless an MPI count would pass 2^31 (see mpi_chunks). Device buffers are not cut."""
    if buf.nbytes * blocks // parts <= schedule.MAX_CALL_BYTES or buf.host is None:
        return [(0, buf.count // parts)]
    return schedule.element_spans(buf.count // parts, buf.itemsize, blocks)


def _to_the_end(start: Callable[[], MPI.Request]) -> None:
    """Start a non-blocking call and wait for it (on the lane, as its blocking calls do)."""
    start().Wait()


def _copy_out(scratch: np.ndarray, out: Buffer) -> None:
    if out.host is None:
        _device_copy(out.ptr, _address(scratch), out.nbytes)
    else:
        out.host[...] = scratch


def _device_copy(dst: int, src: int, nbytes: int) -> None:
    """Copy between host and device memory (either way; the runtime tells them apart), done
    when this returns: a persistent request's scratch lives on the host."""
    import cupy

    rt = cupy.cuda.runtime
    rt.memcpy(dst, src, nbytes, rt.memcpyDefault)


def _address(arr: np.ndarray) -> int:
    # MPI_Get_address: a C call, where numpy's __array_interface__ builds a dict (1.2 us)
    return int(MPI.Get_address(arr))


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
