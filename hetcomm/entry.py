"""How a call enters its communicator: what every operation goes through between its route and
its transport, the same whichever op it is (a mixin of hetcomm.comm.Communicator).

A collective is refused inside a group block, passes the ordering guard where its transport
differs from the previous collective's, takes the next sequence number (the same on every
rank) and writes it in the arrivals table; a blocking one then starts the asynchronous
collectives deferred before it and makes the check on this thread (`_enter`); an asynchronous
one starts its check and starts once the check has completed (`_admit`, hetcomm.deferred). A
prepared call runs from there on this thread (`_blocking_run`, a send's or receive's
`_run_p2p` and `_start_p2p`, with a timeout of its own `_timed`); the general path's Work is
waited for or handed back (`_collective`, `_finish`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
from mpi4py import MPI

from . import agree, carried
from . import work as _work
from .argcheck import check_timeout
from .arrays import Buffer
from .deferred import Deferred, DeferredStarts
from .errors import HetcommError, InvalidArgument, MismatchError, MpiError
from .routes import Route, no_general
from .transports import flags
from .work import Follow, Work

if TYPE_CHECKING:
    from .config import Config
    from .grouping import Queued
    from .topology import Topology
    from .transport_set import TransportSet
    from .transports.base import Transport

POINT_TO_POINT = frozenset(("send", "recv"))
# polls of a blocking check before it waits as a Work (bounded, with the stall warning)
QUICK_POLLS = 64
_RING = agree.Agreement.RING


class Entry:
    """The steps of entering an operation, on the Communicator's state (set in its __init__)."""

    name: str
    rank: int
    size: int
    mpi: Any
    service: Any
    config: Config
    topology: Topology
    call_timeout: float | None
    lanes: memoryview | None
    _closed: bool
    _seq: int
    _p2p_seq: int
    _debug: bool
    _checking: bool
    _quick_polls: int
    _agree: agree.Agreement
    _arrived: Any
    _last_entered: int
    _group: list[Queued] | None
    _deferred: DeferredStarts
    _last: Transport | None
    _inflight: list[Work]
    _transports: TransportSet
    _transport: Callable[[str, Buffer | None], Transport]
    _aborted: BaseException | None
    _abort: Callable[[BaseException], None]
    late: Callable[[str, int], tuple[list[int] | None, str]]

    def _arrive(self, route: Route) -> int:
        """A collective's first steps, blocking or not: refused inside a group block, the
        ordering guard, its sequence number, this rank's entry in the arrivals table."""
        if self._group is not None:
            raise InvalidArgument(
                f"{route.op}: only send and recv may be called inside comm.group()"
            )
        if route.transport is not self._last:
            self._order(route.transport)
        self._seq = seq = self._seq + 1
        self._arrived[self.rank] = seq
        return seq

    def _refused(self, op: str, before: int) -> None:
        """Collective `op`, called with invalid arguments, is refused on this rank before it
        entered (its sequence number is still `before`): where the check is on, it takes the
        collective's turn in the check all the same, with a signature that says so, so that
        the ranks that called validly raise MismatchError naming this rank at once rather
        than wait for it until their timeout. Waits for the others as any collective does;
        whatever that ends in, the caller raises its InvalidArgument."""
        if self._seq != before or not self._checking or self._group is not None:
            return
        if self._aborted is not None or self._closed:
            return
        self._seq = seq = before + 1
        self._arrived[self.rank] = seq
        refusal = _Refusal(op)
        try:
            if self._deferred.queue:
                self._flush_deferred(op, seq)
            self._check_blocking(refusal, seq, None)
        except HetcommError:
            pass  # the others' calls differ, or they never came: this rank's error says why

    def _enter(self, route: Route, timeout: float | None = None) -> int:
        """A blocking collective enters: the ordering guard, its sequence number, the arrivals
        table, then the check, all on this thread. Returns the sequence number."""
        seq = self._arrive(route)
        if self._deferred.queue:
            # the asynchronous collectives before this one start first: their checks complete
            # once every rank has entered them, and a rank waiting in this one's check may be
            # waiting for them
            self._flush_deferred(route.op, seq, timeout or self.call_timeout)
        if self._checking:
            self._check_blocking(route, seq, timeout or self.call_timeout)
        return seq

    def _check_slot(
        self, route: Route | _Refusal, seq: int, timeout: float | None
    ) -> agree.Check | agree.SharedCheck:
        """Collective `seq`'s check slot, free (an earlier asynchronous check on it read
        first) and loaded with the route's signature; not started."""
        check = self._agree.slot(seq)
        if check.busy:
            # the asynchronous collective RING places back has not been seen checked yet
            self._flush_deferred(route.op, seq, timeout)
        if self._debug:
            vec = route.vec.copy()
            vec[5], vec[11] = seq, -seq
            check.load(vec)
        else:
            check.load(route.vec)
        return check

    def _check_blocking(
        self, route: Route | _Refusal, seq: int, timeout: float | None, carry: Any = None
    ) -> agree.Check | agree.SharedCheck:
        """Collective `seq`'s check, on this thread; raises MismatchError where the ranks
        differ. `carry`: what this rank's record carries (see hetcomm.carried), else None. Returns
        the completed check."""
        # the slot's state read inline where it is free and holds this route's signature (a
        # collective repeated), else through _check_slot
        check = self._agree.ring[seq % _RING]
        if check is None or check.busy or check.held is not route.vec or self._debug:
            check = self._check_slot(route, seq, timeout)
        try:
            if not check.quick(seq, carry):
                test = check.request.Test
                for _ in range(self._quick_polls):
                    if test():
                        break
                else:
                    # polled with a yield between, never a sleep (as the mpi transport's own
                    # waits and MPI's): a wait that slept in steps growing to 1 ms made the
                    # rank that came 5 ms late to an all_reduce wait 0.6 ms more for the
                    # others to see it (2026-12-02, 2 ranks of the CPU VM)
                    busy = _work.BusyPoll(test)
                    _work.wait_for(self, route.op, seq, busy, timeout, waiter=busy.wait)
        except MPI.Exception as exc:
            raise self._mpi_error(route.op, seq, exc) from exc
        if not check.agreed():
            raise self._mismatch(route.op, seq, check.mismatched())
        return check

    def _admit(
        self,
        route: Route,
        start: Callable[[int], Work],
        device: Buffer | None = None,
        host: tuple[np.ndarray, np.ndarray | None] | None = None,
    ) -> Work:
        """An asynchronous collective: its sequence number and arrival at once, its check
        started, and the operation itself started once the check has completed (and every
        earlier deferred one has started). `host`: the input and output host arrays of a call
        that may ride in the check's records (hetcomm.carried), landed from there where every
        rank's does. Returns the Work the caller gets."""
        seq = self._arrive(route)
        if not self._checking:
            if self._deferred:
                self._flush_deferred(route.op, seq)
            return start(seq)
        if self._deferred:
            self._deferred.advance()  # start what can start now, without waiting
        check = self._check_slot(route, seq, None)
        begin: Callable[[], Work] = partial(start, seq)
        try:
            if host is None:
                test = check.start(seq).Test
            else:
                assert isinstance(check, agree.SharedCheck)
                begin = partial(carried.begin, self, route, check, start, *host, seq)
                test = check.start(seq, carried.carry(self.rank, route, host[0])).Test
            if not self._deferred:
                # ranks in step: the check completes within a few polls, and the operation
                # starts (or lands) here at once; else it is deferred, and this call does not
                # wait
                for _ in range(QUICK_POLLS):
                    if test():
                        if not check.agreed():
                            raise self._mismatch(route.op, seq, check.mismatched())
                        return begin()
        except MPI.Exception as exc:
            raise self._mpi_error(route.op, seq, exc) from exc
        if device is not None:
            # it may start on another thread: with the caller's stream and device there
            from .kernels.device import on_behalf_of

            begin = on_behalf_of(device, begin)
        item = Deferred(check, seq, begin)

        def poll() -> bool:
            inner = item.inner
            if inner is None:
                self._deferred.advance()
                if item.error is not None:
                    raise item.error
                inner = item.inner
                if inner is None:
                    return False
            return inner.test()

        def started() -> bool:
            self._deferred.advance()
            return item.inner is not None or item.error is not None

        follow = Follow(lambda: item.inner)

        def waiter(seconds: float) -> bool:
            # the caller waits: for the check as a blocking call's wait would (flags.wait:
            # yielding the core between looks, then naps), then as Follow waits
            until = time.monotonic() + seconds
            if item.inner is None and not flags.wait(started, until):
                return False
            if item.inner is None:  # it failed: the next poll raises
                return False
            return follow.wait(max(0.0, until - time.monotonic()))

        item.outer = Work(self, route.op, seq, poll, drive=follow.drive, waiter=waiter)
        self._deferred.add(item)
        return item.outer

    def _flush_deferred(self, op: str, seq: int, timeout: float | None = None) -> None:
        """Start every deferred collective before the one now entering (bounded wait)."""

        def started() -> bool:
            self._deferred.advance()
            return not self._deferred

        if not started():
            what = f"{op} after the asynchronous collectives before it"
            _work.wait_for(self, what, seq, started, timeout)

    def _mismatch(self, op: str, seq: int, mine: np.ndarray) -> MismatchError:
        def wait(request: MPI.Request) -> None:
            what = f"{op} (gathering the mismatched signatures)"
            _work.wait_for(self, what, seq, request.Test)

        return self._agree.mismatch(self.name, seq, mine, wait)

    def _mpi_error(self, op: str, seq: int, exc: BaseException) -> MpiError:
        error = MpiError(self.name, op, seq, exc)
        self._abort(error)
        return error

    # ---- helpers shared by the operations ---------------------------------------------------

    def _start(
        self,
        op: str,
        buf: Buffer | None,
        root: int = -1,
        timeout: float | None = None,
        blocking: bool = False,
    ) -> tuple[Transport, int]:
        """Enter `op` on `buf` outside the routes (fused groups, hier's parts): the transport
        and the sequence number. Blocking: the check is made here."""
        if timeout is not None:
            check_timeout(timeout, op)
        transport = self._transport(op, buf)
        if op in POINT_TO_POINT:
            self._p2p_seq += 1
            return transport, self._p2p_seq
        count = buf.count if buf is not None else 0
        route = Route(
            op,
            transport,
            agree.signature(op, buf.dtype if buf else None, count, None, root),
            no_general,
        )
        return transport, self._enter(route)

    def _order(self, transport: Transport) -> None:
        """The ordering guard: a collective that goes through a different transport than the
        one before starts only once the earlier collectives have completed here.

        Each transport keeps its own operations in issue order, but two transports progress
        independently: a stream-ordered one (nccl) and a host-blocking one (mpi, staged) could
        otherwise meet the same pair of collectives in different orders on different ranks and
        wait for each other forever. Since every rank issues the collectives of a communicator
        in the same order, finishing the earlier ones first makes every rank run them in one
        order. Costs a wait only where the transport changes.
        """
        inflight, self._inflight = self._inflight, []
        for work in inflight:
            work.wait()
        self._last = transport

    def _finish(
        self, work: Work, async_op: bool, timeout: float | None, keep: tuple[Any, ...] = ()
    ) -> Work | None:
        if timeout is not None:
            work._timeout = float(timeout)
        if async_op:
            # the transport may read or write these until completion: packed copies included;
            # added to what the transport keeps itself (its own copies, a region a peer reads)
            work._keep = (*work._keep, *keep)
            if work.op not in POINT_TO_POINT:
                inflight = self._inflight
                if len(inflight) >= 64:
                    inflight[:] = [w for w in inflight if not w._done]
                if not inflight or inflight[-1] is not work:
                    inflight.append(work)
            return work
        if not work.test():
            work.wait()
        return None

    def _collective(
        self,
        route: Route,
        async_op: bool,
        timeout: float | None,
        seq: int | None,
        start: Callable[[int], Work],
        keep: tuple[Any, ...],
    ) -> Work | None:
        """Enter (unless the caller already did) and start a collective of the general path."""
        route.uses += 1
        if timeout is not None:
            check_timeout(timeout, route.op)
        if async_op and seq is not None:
            # admitted already (a carried call that some rank did not carry): started on the
            # thread that saw its check complete; the caller's own Work follows this one and
            # is the one finished (held, traced, guarded for ordering)
            work = start(seq)
            work._keep = (*work._keep, *keep)
            return work
        if async_op:
            device = next((b for b in keep if isinstance(b, Buffer) and b.on_device), None)
            work = self._admit(route, start, device)
        else:
            # a call with a timeout of its own is waited for by its Work, which keeps it; a
            # transport told it is blocking may run it to its end on this thread instead
            _work.set_blocking(timeout is None)
            try:
                work = start(self._enter(route, timeout) if seq is None else seq)
            finally:
                _work.set_blocking(False)
        return self._finish(work, async_op, timeout, keep)

    def _drain(self, op: str) -> None:
        """Before `op`, a call on this MPI communicator outside the transports: start the
        deferred collectives and let each transport make the calls it still has queued there,
        so that `op` comes after them on every rank (MPI matches collectives by the order they
        are called in)."""
        if self._deferred:
            self._flush_deferred(op, self._seq)
        for transport in self._transports:
            transport.drain(op, self._seq)

    def _blocking_run(self, route: Route, timeout: float | None, *arrays: Any) -> bool:
        """The transport's prepared call of `route`, driven here (within `timeout`, None: the
        configured one); False where it declined (the general path then runs the call with
        the sequence number entered here)."""
        if timeout is not None:
            return self._timed(timeout, route.op, self._blocking_run, route, None, *arrays)
        self._last_entered = seq = self._enter(route)
        assert route.run is not None
        route.runs += 1
        try:
            return route.run(*arrays, seq)
        except MPI.Exception as exc:
            raise self._mpi_error(route.op, seq, exc) from exc

    def _timed(self, timeout: float, op: str, run: Callable[..., Any], *args: Any) -> Any:
        """`run(*args)`, a prepared call with a timeout of its own: every wait of the call
        (the check's, the transport's) reads it as call_timeout meanwhile."""
        check_timeout(timeout, op)
        self.call_timeout = float(timeout)
        try:
            return run(*args)
        finally:
            self.call_timeout = None

    def _run_p2p(
        self, route: Route, xh: Any, peer: int, tag: int, timeout: float | None
    ) -> int | None:
        """A send's or receive's prepared blocking call on `xh` (route.view's: a host array, or
        a device address) within `timeout` (None: the configured one): None once it ran, else
        (it declined) the sequence number it took, which the general path then uses."""
        if timeout is not None:
            return self._timed(timeout, route.op, self._run_p2p, route, xh, peer, tag, None)
        assert route.run is not None
        self._p2p_seq = seq = self._p2p_seq + 1
        route.runs += 1
        try:
            if route.run(xh, peer, tag, seq):
                return None
        except MPI.Exception as exc:
            raise self._mpi_error(route.op, seq, exc) from exc
        return seq

    def _run_pair(
        self,
        route: Route,
        xh: Any,
        dst: int,
        tag: int,
        oh: Any,
        src: int,
        recv_tag: int,
        timeout: float | None,
    ) -> bool:
        """A sendrecv's prepared exchange (grouping.exchange) within `timeout` (None: the
        configured one), taking one point-to-point sequence number: whether it ran (False: it
        declined, having moved nothing)."""
        if timeout is not None:
            args = (route, xh, dst, tag, oh, src, recv_tag, None)
            ran: bool = self._timed(timeout, "sendrecv", self._run_pair, *args)
            return ran
        assert route.run is not None
        self._p2p_seq = seq = self._p2p_seq + 1
        route.runs += 1
        try:
            return route.run(xh, dst, tag, oh, src, recv_tag, seq)
        except MPI.Exception as exc:
            raise self._mpi_error("sendrecv", seq, exc) from exc

    def _start_prepared(
        self, route: Route, timeout: float | None, args: tuple[Any, ...], *arrays: Any
    ) -> Work | None:
        """An asynchronous collective through the transport's prepared start (route.start,
        given `arrays` as the prepared blocking call is), entered as the general path's are
        (arrival, check, deferred start). `args`: the general path's leading arguments (the
        caller's arrays, held by the Work; all_reduce's in-place flag). A call that may ride
        in the check's records (route.land) tries that first; where the route has no prepared
        start, its general path starts it where some rank does not take the records' path."""
        host = None
        if route.land is not None and not _work.observing:
            host = (arrays[0], arrays[1] if len(arrays) > 1 else None)
        if route.start is not None:
            start: Callable[[int], Work] = partial(route.start, *arrays)
        elif host is not None:
            start = partial(_started, partial(route.general, route, *args, True, timeout))
        else:  # traced: the general path, as it would have been
            return route.general(route, *args, True, timeout, None)
        route.runs += 1
        if timeout is not None:
            check_timeout(timeout, route.op)
        try:
            work = self._admit(route, start, host=host)
        except MPI.Exception as exc:
            raise self._mpi_error(route.op, self._seq, exc) from exc
        return self._finish(work, True, timeout, args)

    def _start_p2p(
        self, route: Route, x: Any, xh: np.ndarray, peer: int, tag: int, timeout: float | None
    ) -> Work:
        """An asynchronous send or receive through the transport's prepared start."""
        assert route.start is not None
        if timeout is not None:
            check_timeout(timeout, route.op)
        self._p2p_seq = seq = self._p2p_seq + 1
        route.runs += 1
        try:
            work = route.start(xh, peer, tag, seq)
        except MPI.Exception as exc:
            raise self._mpi_error(route.op, seq, exc) from exc
        if timeout is not None:
            work._timeout = float(timeout)
        work._keep = (x,)  # the transport reads or writes it until completion
        return work


def _started(general_start: Callable[[int], Work | None], seq: int) -> Work:
    """The general path's start of an asynchronous call admitted already as `seq`."""
    work = general_start(seq)
    assert work is not None  # an asynchronous call's
    return work


class _Refusal:
    """What the check reads of a route, for a collective refused before it entered."""

    __slots__ = ("op", "vec")

    def __init__(self, op: str) -> None:
        self.op, self.vec = op, agree.refused(op)
