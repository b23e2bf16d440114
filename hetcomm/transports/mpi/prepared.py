"""The mpi transport's prepared blocking calls: one per signature, made at a route's first call
(hetcomm.routes.Route.run) and run on the calling thread with no Work.

Each makes the same MPI calls as the transport's general path for that signature (which calls
those are depends on the signature alone, so every rank's calls match whichever path each rank
takes): a small collective through its cached persistent request (mpi/persistent.py), a larger
one as one non-blocking call polled here, or, where `schedule.laned` says so, the blocking call
queued on the transport's lane and waited for here within the call's timeout. A prepared call
declines (returns False, having moved nothing) while the lane has jobs queued, so that the
general path queues behind them. Sends and receives have prepared asynchronous starts too, and
a sendrecv of two host arrays a prepared call of its own (an MPI_Sendrecv, polled).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
from mpi4py import MPI

from ...arrays import may_share_memory
from ...ops import ReduceOp
from ...work import BusyPoll, Work, wait_for
from . import persistent
from .datatypes import DATATYPES, mpi_op
from .receive import OneReceive
from .schedule import laned, spans

if TYPE_CHECKING:
    from ...arrays import Buffer
    from .transport import MpiTransport

_IN_PLACE = MPI.IN_PLACE
_AVG = ReduceOp.AVG

# polls of a request started here before it is handed to the bounded wait
QUICK_TESTS = 32


def address(arr: np.ndarray) -> int:
    """The address of `arr`'s data: MPI_Get_address, a C call, where numpy's
    __array_interface__ builds a dict (1.2 us)."""
    return int(MPI.Get_address(arr))


class Prepared:
    """The prepared calls of one MpiTransport (`prepare`, `prepare_async`), and what they run
    on: its communicator, lane and persistent requests."""

    def __init__(self, t: MpiTransport) -> None:
        self._t = t
        self.comm = t.comm
        self._mpi: MPI.Intracomm = t.comm.mpi
        self._lane = t._lane
        self._requests = t.requests

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
        if x is not None and (x.host is None or len(spans(x)) > 1):
            return None
        if out is not None and (out.host is None or len(spans(out)) > 1):
            return None
        if op == "send":
            return partial(self._run_send, DATATYPES[x.dtype]) if x is not None else None
        if op == "recv":
            return partial(self._run_recv, DATATYPES[x.dtype]) if x is not None else None
        if op == "sendrecv":
            if x is None or out is None:
                return None
            return partial(self._run_exchange, DATATYPES[x.dtype], DATATYPES[out.dtype])
        if op == "barrier":
            recipe = self._t._recipe("barrier", None, 0, None, -1)
            if recipe is None:
                return self._run_barrier
            return partial(self._run_persistent, recipe, False, False, None)
        assert x is not None
        if op in ("all_reduce", "reduce_scatter"):
            self._t._reducible(x)
        recipe = self._t._recipe(op, x.dtype, x.count, rop, root)
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
        if laned(self._t.lane_min, op, nbytes):
            return self._laned(op, x, rop, root)
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
            self._t._reducible(x)
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
            elif address(xh) == address(oh) + offset:
                send = _IN_PLACE
            else:
                return False
            self._drive(start(send, (oh, dt)), op, seq)
            return True

        run_blocks.in_place = True  # type: ignore[attr-defined]
        return run_blocks

    def _laned(
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
            self._t._reducible(x)
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
        slot = self._requests.take(recipe)
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
        polls = QUICK_TESTS
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

    def _run_barrier(self, seq: int) -> bool:
        if self._lane.pending:
            return False
        self._drive(self._mpi.Ibarrier(), "barrier", seq)
        return True

    def _drive(self, request: MPI.Request, op: str, seq: int) -> None:
        """Wait here for a request started here: a few quick Tests, then the bounded wait."""
        test = request.Test
        for _ in range(QUICK_TESTS):
            if test():
                return
        busy = BusyPoll(test)
        wait_for(self.comm, op, seq, busy, self.comm.call_timeout, busy.wait)

    def _divisor(self, x: Buffer, rop: ReduceOp) -> Callable[[np.ndarray], None] | None:
        """AVG's division of a result on the host (None for the other ops)."""
        if rop is not _AVG:
            return None
        from ...kernels import reduce

        storage, dtype, n = reduce.storage_dtype(x.dtype), x.dtype, self._mpi.Get_size()
        return lambda a: reduce.divide(a.reshape(-1).view(storage), n, dtype)

    def prepare_async(
        self, op: str, x: Buffer | None, out: Buffer | None, rop: ReduceOp | None, root: int
    ) -> Callable[..., Work] | None:
        """The asynchronous start of one signature on host arrays, and its Work (None: the
        general path): a send's or receive's MPI call on the array itself; a collective's
        persistent request (the general path's, so that ranks taking either path meet),
        its input copied in here, its result out when complete, with no Buffer per call.
        Called with the prepared blocking call's arguments (`prepare`)."""
        if x is None or x.host is None or len(spans(x)) > 1:
            return None
        if op in ("send", "recv"):
            start = self._start_send if op == "send" else self._start_recv
            return partial(start, DATATYPES[x.dtype])
        if out is not None and (out.host is None or len(spans(out)) > 1):
            return None
        if op == "barrier" or op not in persistent.INITS:
            return None
        if op in ("all_reduce", "reduce_scatter"):
            self._t._reducible(x)
        recipe = self._t._recipe(op, x.dtype, x.count, rop, root)
        if recipe is None:
            return None
        at_root = self._mpi.Get_rank() == root
        takes = op != "broadcast" or at_root
        gives = {"broadcast": not at_root, "reduce": at_root}.get(op, True)
        div = self._divisor(x, rop) if rop is not None and gives else None
        nbytes = out.nbytes if op == "all_gather" and out is not None else x.nbytes
        return partial(self._start_persistent, recipe, takes, gives, div, nbytes)

    def _start_persistent(
        self,
        recipe: persistent.Recipe,
        takes: bool,
        gives: bool,
        div: Callable[[np.ndarray], None] | None,
        nbytes: int,
        *arrays_and_seq: Any,
    ) -> Work:
        """The asynchronous start of a small collective through its persistent request: the
        input (the first array, where `takes`) copied into its scratch here, the result out
        (into the last array, where `gives`) once complete."""
        slot = self._requests.take(recipe)
        if takes:
            slot.copy_in(arrays_and_seq[0])
        deliver = finish = None
        if gives:
            o = arrays_and_seq[-2]
            deliver = partial(slot.copy_out, o)
            if div is not None:
                finish = (partial(div, o),)
        return self._t.start_slot(slot, arrays_and_seq[-1], deliver, finish or (), nbytes)

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

    def _run_exchange(
        self,
        dx: MPI.Datatype,
        do: MPI.Datatype,
        xh: np.ndarray,
        dst: int,
        tag: int,
        oh: np.ndarray,
        src: int,
        recv_tag: int,
        seq: int,
    ) -> bool:
        """A blocking sendrecv: the receive posted, then the send, both polled here (MPI moves
        either in a Test of the other) until both have completed, as MPI_Sendrecv."""
        got = BusyPoll(OneReceive(self._mpi.Irecv((oh, do), src, recv_tag), src, oh.nbytes).poll)
        sent = BusyPoll(self._mpi.Isend((xh, dx), dst, tag).Test)
        for _ in range(QUICK_TESTS):
            if got() and sent():
                return True
        busy = BusyPoll(lambda: got() and sent())
        wait_for(self.comm, "sendrecv", seq, busy, self.comm.call_timeout, busy.wait)
        return True

    def _run_recv(self, dt: MPI.Datatype, xh: np.ndarray, src: int, tag: int, seq: int) -> bool:
        test = OneReceive(self._mpi.Irecv((xh, dt), src, tag), src, xh.nbytes).poll
        for _ in range(QUICK_TESTS):
            if test():
                return True
        busy = BusyPoll(test)
        wait_for(self.comm, "recv", seq, busy, self.comm.call_timeout, busy.wait)
        return True
