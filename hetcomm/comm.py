"""Communicator: each call resolved once to a route (validated, planned, checked across the
group), then the transport; blocking calls are driven to completion on the calling thread."""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Mapping, Sequence
from functools import partial
from typing import Any

import numpy as np
from mpi4py import MPI

from . import agree, carried, coalesced, general
from . import plan as planning
from . import trace as _trace
from . import work as _work
from .argcheck import (
    check_timeout,
    same,
)
from .arrays import Buffer, as_buffer, may_share_memory
from .config import Config
from .deferred import DeferredStarts
from .entry import POINT_TO_POINT, QUICK_POLLS
from .errors import CommAborted, InvalidArgument, MismatchError
from .grouping import Queued
from .ops import ReduceOp, as_reduce_op, check_op_for_dtype
from .pointtopoint import PointToPoint
from .routes import MAX_ROUTES, OP_TYPES, Route, device_view, host_view, key_of, no_general
from .topology import Topology
from .transport_set import TransportSet
from .transports.base import Transport
from .transports.direct import mailbox
from .work import Work, completed

log = logging.getLogger("hetcomm")

# the MPI communicators of closed Communicators, never freed (see Communicator.close)
_CLOSED_MPI_COMMS: list[MPI.Intracomm] = []


class Communicator(PointToPoint):
    """A group of ranks and the operations among them; every rank of the group calls each op.

    Made by `hetcomm.init()`, `ParallelGroups` or `split()`; owns its MPI communicator (a Dup or
    a Split) and frees it on `close()`. Collectives follow NCCL's layouts; see the README.
    """

    def __init__(
        self,
        mpi_comm: MPI.Intracomm,
        config: Config,
        topology: Topology,
        name: str = "world",
        *,
        exclude: Mapping[str, str] | None = None,
    ) -> None:
        self.mpi = mpi_comm
        self._tag_ub = int(mpi_comm.Get_attr(MPI.TAG_UB) or 32767)  # read once, not per call
        # a second communicator for transports' own messages (control, rails), so that they
        # can never match the caller's point-to-point traffic
        self.service: MPI.Intracomm = mpi_comm.Dup()
        self.config = config
        # the timeout of its own of the blocking call being issued, while its prepared call
        # runs (its waits read it; _timed), else None: each wait's own default then
        self.call_timeout: float | None = None
        _trace.decide(config)
        self.topology = topology
        self.name = name
        self.rank: int = mpi_comm.Get_rank()
        self.size: int = mpi_comm.Get_size()
        self._seq = 0  # collectives (and barriers) so far: the same on every rank
        self._p2p_seq = 0
        self._debug = config.debug
        self._closed = False
        self._aborted: BaseException | None = None
        # the transports, each made on first use, and which serves each operation
        self._transports = TransportSet(self, exclude)
        self._transport = self._transports.for_op
        self._routes: dict[Hashable, Route] = {}
        # the signature check and the table of where each rank has got to (hetcomm.agree)
        self._agree = agree.Agreement(
            mpi_comm,
            config.check or config.debug,
            config.debug,
            len(topology.hosts()) == 1,
            mailbox.lanes_bytes(
                [r.device for r in topology.ranks], [r.host for r in topology.ranks]
            ),
        )
        self.lanes = self._agree.arrivals.lanes
        self._checking = self._agree.enabled
        # a blocking check's polls before it waits yielding the core between looks; none
        # where the ranks of this host outnumber its cores (4 ranks on the 2-core VM, 8 B
        # checked all_reduce: 29 -> 20 us, barrier 22 -> 13 us)
        self._quick_polls = 0 if self._agree.crowded else QUICK_POLLS
        self._arrived = self._agree.arrivals.table
        self._last_entered = 0  # the sequence number _blocking_run entered
        # the point-to-point calls queued by an open `with comm.group():` block, else None
        self._group: list[Queued] | None = None
        # asynchronous collectives whose check has not completed, in issue order: each starts
        # once its check has, and none before the ones ahead of it
        self._deferred = DeferredStarts(
            lambda seq, mine: self._mismatch("check", seq, mine),
            lambda seq, exc: self._mpi_error("check", seq, exc),
        )
        # the ordering guard: the transport of the latest collective, and the asynchronous
        # collectives not yet seen complete (see _order)
        self._last: Transport | None = None
        self._inflight: list[Work] = []

    # ---- life cycle -------------------------------------------------------------------------

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the transports and the MPI communicator; later calls raise. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._transports.close()
        self._routes.clear()
        # The MPI communicators are kept, not freed, until MPI_Finalize (about 10 KB each).
        # MPI gives a freed communicator's context id to the next one made, and Open MPI hands
        # that one the messages still addressed to the old: a message another rank sends on
        # this group after it closed here would reach a later group. Kept, such a message is
        # never matched: it is dropped, or its sender fails within its timeout (as gloo's and
        # NCCL's do). An aborted communicator may also have MPI operations in flight, which a
        # free would let write into released memory.
        # this rank's entry of the arrivals table moves off it first: a view of the shared
        # table would keep it mapped as long as this object lives
        self._arrived = np.zeros(self.size, np.int64)
        self.lanes = None
        self._agree.close(False)  # the check's communicator is kept too
        if self.mpi != MPI.COMM_NULL:
            _CLOSED_MPI_COMMS.extend((self.service, self.mpi))

    @property
    def closed(self) -> bool:
        return self._closed

    def _abort(self, exc: BaseException) -> None:
        if self._aborted is None:
            self._aborted = exc
            log.error("communicator '%s' aborted: %s", self.name, exc)

    def _check_open(self) -> None:
        if self._aborted is None and not self._closed:
            return
        if self._aborted is not None:
            raise CommAborted(f"communicator '{self.name}' was aborted by: {self._aborted}")
        if self._closed:
            raise CommAborted(f"communicator '{self.name}' is closed")

    def late(self, op: str, seq: int) -> tuple[list[int] | None, str]:
        """For a wait that expired: the ranks not yet at collective `seq`, and what else there
        is to say (ranks that could not be read, or that a point-to-point wait has one peer)."""
        if op in POINT_TO_POINT:
            return None, "a point-to-point operation waits for its peer to post the matching call"
        late, unknown = self._agree.arrivals.late(seq)
        dead = [r for r in self._agree.arrivals.dead() if r != self.rank]  # arrived, then died
        late = sorted({r for r in late if r != self.rank} | set(dead))
        notes = [f"ranks {dead} have died (their processes are gone)"] if dead else []
        if unknown:
            notes.append(f"ranks {unknown} are on other hosts: their progress cannot be read here")
        return late, "; ".join(notes)

    def __repr__(self) -> str:
        return f"<hetcomm.Communicator '{self.name}' rank {self.rank} of {self.size}>"

    def routes(self) -> list[dict[str, Any]]:
        """The routes resolved so far, one dict each: op, transport, whether it has a
        prepared blocking call or asynchronous start, and how many calls each path served
        (`carried`: those whose data rode in the check, counted in `runs` too; for tests and
        tuning)."""
        return [
            {
                "op": r.op,
                "transport": r.transport.name,
                "prepared": r.run is not None,
                "prepared_async": r.start is not None,
                "carried": r.carried,
                "runs": r.runs,
                "uses": r.uses,
                "key": key,
            }
            for key, r in self._routes.items()
        ]

    # ---- sub-communicators ------------------------------------------------------------------

    def split(
        self,
        color: int | None,
        key: int | None = None,
        name: str | None = None,
        *,
        config: Config | None = None,
    ) -> Communicator | None:
        """Ranks with the same `color` form a new communicator, ordered by `key` (default rank).

        `color=None` (or negative) leaves this rank out: it gets None. `config`: the new
        communicator's (default: this one's). Collective.
        """
        self._check_open()
        if config is not None and not isinstance(config, Config):
            raise InvalidArgument(f"split: config must be a hetcomm.Config, got {config!r}")
        if color is not None and (isinstance(color, bool) or not isinstance(color, int)):
            raise InvalidArgument(f"split: color must be an int or None, got {color!r}")
        if key is not None and (isinstance(key, bool) or not isinstance(key, int)):
            raise InvalidArgument(f"split: key must be an int or None, got {key!r}")
        mpi_color = MPI.UNDEFINED if color is None or color < 0 else color
        self._drain("split")
        new: Any = self.mpi.Split(mpi_color, self.rank if key is None else key)
        if new == MPI.COMM_NULL:
            return None
        parents = new.allgather(self.rank)
        label = name if name is not None else f"{self.name}.{color}"
        chosen = self.config if config is None else config
        return Communicator(new, chosen, self.topology.subset(parents), label)

    def dup(self, name: str | None = None) -> Communicator:
        """A new communicator with the same members and its own message space. Collective."""
        self._check_open()
        self._drain("dup")
        return Communicator(self.mpi.Dup(), self.config, self.topology, name or self.name)

    # ---- the plan ---------------------------------------------------------------------------

    @property
    def plan(self) -> planning.PlanTable:
        """The transport chosen for each operation, memory kind and size class, with reasons."""
        return self._transports.plan_table()

    # ---- routes -----------------------------------------------------------------------------

    def _route(
        self,
        key: Hashable | None,
        op: str,
        xb: Buffer | None,
        general: Callable[..., Work | None],
        rop: ReduceOp | None = None,
        root: int = -1,
        out: Buffer | None = None,
    ) -> Route:
        """A new route for a call whose signature was just validated (kept under `key` when
        the arrays' types allow one: see _key)."""
        transport = self._transport(op, xb)
        dtype = xb.dtype if xb is not None else None
        count = xb.count if xb is not None else 0
        vec = agree.signature(op, dtype, count, rop, root)
        run = None
        prepare = getattr(transport, "prepare", None)
        if prepare is not None and key is not None:
            run = prepare(op, xb, out, rop, root)
        route = Route(op, transport, vec, general, rop, root, run)
        route.dtype = dtype
        if xb is not None and xb.on_device:
            route.view = device_view
        if self._agree.records is not None and carried.applies(op, xb):
            assert dtype is not None
            route.land = carried.lander(op, rop, dtype, self.rank, self.size, root)
        prepare_async = getattr(transport, "prepare_async", None)
        if prepare_async is not None and key is not None:
            route.start = prepare_async(op, xb, out, rop, root)
        if key is not None:
            self._keep_route(key, route)
        return route

    def _keep_route(self, key: Hashable, route: Route) -> None:
        if len(self._routes) >= MAX_ROUTES:
            self._routes.clear()
        self._routes[key] = route

    def _root(self, root: Any, what: str) -> int:
        if isinstance(root, bool) or not isinstance(root, (int, np.integer)):
            raise InvalidArgument(f"{what}: expected an int rank, got {root!r}")
        if not 0 <= root < self.size:
            raise InvalidArgument(
                f"{what}: expected a rank in [0, {self.size}) of group '{self.name}', got {root}"
            )
        return int(root)

    # ---- operations ---------------------------------------------------------------------------

    def all_reduce(
        self,
        x: Any,
        op: ReduceOp | str = ReduceOp.SUM,
        *,
        out: Any = None,
        async_op: bool = False,
        timeout: float | None = None,
    ) -> Work | None:
        """Reduce `x` over the group; the result lands in `x` (in place) or in `out`."""
        before = self._seq
        try:
            if self._aborted is not None or self._closed:
                self._check_open()
            inplace = out is None or out is x
            kx = key_of(x)
            key = (
                None
                if kx is None or op.__class__ not in OP_TYPES
                else ("all_reduce", kx, op, None if inplace else key_of(out))
            )
            route = self._routes.get(key) if key is not None else None
            if route is None:
                route = self._route_all_reduce(key, x, op, out, inplace)
            if (route.run or route.land) is not None and not async_op and not _work.observing:
                xh = route.view(x, inplace)
                if xh is not None:
                    oh = xh if inplace else route.view(out, True)
                    # a device view is an address (int): the prepared call tells overlaps apart
                    if oh is not None and (
                        inplace or xh.__class__ is int or not may_share_memory(xh, oh)
                    ):
                        if (
                            carried.run(self, route, xh, timeout, oh)
                            if route.land is not None
                            else self._blocking_run(route, timeout, xh, oh)
                        ):
                            return None
                        return general.all_reduce(
                            self, route, x, out, inplace, False, timeout, self._last_entered
                        )
            elif async_op and (route.start or route.land) is not None:
                xh = host_view(x, inplace)
                oh = xh if inplace or xh is None else host_view(out, True)
                if oh is not None and (inplace or not may_share_memory(xh, oh)):
                    return self._start_prepared(route, timeout, (x, out, inplace), xh, oh)
            return general.all_reduce(self, route, x, out, inplace, async_op, timeout, None)
        except InvalidArgument:
            self._refused("all_reduce", before)
            raise

    def _route_all_reduce(
        self, key: Hashable | None, x: Any, op: Any, out: Any, inplace: bool
    ) -> Route:
        xb = as_buffer(x, "all_reduce: x")
        rop = op if op.__class__ is ReduceOp else as_reduce_op(op, "all_reduce: op")
        check_op_for_dtype(rop, xb.dtype, "all_reduce")
        ob = None
        if not inplace:
            ob = as_buffer(out, "all_reduce: out")
            same(ob, xb, "all_reduce: out", ob.count == xb.count, f"{xb.count} elements")
        return self._route(key, "all_reduce", xb, partial(general.all_reduce, self), rop, -1, ob)

    def all_reduce_coalesced(
        self,
        arrays: Sequence[Any],
        op: ReduceOp | str = ReduceOp.SUM,
        *,
        async_op: bool = False,
        timeout: float | None = None,
    ) -> Work | None:
        """Reduce every array of `arrays` in place, as separate all_reduce calls would, with one
        collective per (dtype, memory) over a fused buffer.

        Arrays of one dtype and memory (host, or the one device of the call) are packed in list
        order into one buffer, reduced, and unpacked; the groups run in order of first
        appearance, so every rank must pass the same dtypes, shapes and memories in the same
        order. Host and device arrays may be mixed; device arrays on two devices may not. An
        empty list does nothing (None, or a completed Work). An array given twice, arrays that
        overlap, read-only arrays, unsupported dtypes and ops are refused before anything moves.
        Where the ranks share one GPU (direct: its leader reduces them; staged: each copied to
        and from the host), device arrays are moved where they are, with no pack or unpack
        kernel on each rank (strided ones still packed), and the check compares how many
        arrays each rank gives.
        """
        before = self._seq
        try:
            return coalesced.all_reduce_coalesced(self, arrays, op, async_op, timeout)
        except InvalidArgument:
            self._refused("all_reduce_coalesced", before)
            raise

    def reduce(
        self,
        x: Any,
        root: int,
        op: ReduceOp | str = ReduceOp.SUM,
        *,
        async_op: bool = False,
        timeout: float | None = None,
    ) -> Work | None:
        """Reduce `x` over the group into `x` of `root`; the others' `x` is left as it was."""
        before = self._seq
        try:
            if self._aborted is not None or self._closed:
                self._check_open()
            kx = key_of(x)
            key = (
                None
                if kx is None or root.__class__ is not int or op.__class__ not in OP_TYPES
                else ("reduce", kx, root, op)
            )
            route = self._routes.get(key) if key is not None else None
            if route is None:
                xb = as_buffer(x, "reduce: x")
                r = self._root(root, "reduce: root")
                rop = as_reduce_op(op, "reduce: op")
                check_op_for_dtype(rop, xb.dtype, "reduce")
                route = self._route(key, "reduce", xb, partial(general.reduce, self), rop, r)
            return self._one_array(route, x, self.rank == route.root, async_op, timeout)
        except InvalidArgument:
            self._refused("reduce", before)
            raise

    def broadcast(
        self, x: Any, root: int, *, async_op: bool = False, timeout: float | None = None
    ) -> Work | None:
        """Copy `x` of `root` into `x` of every rank."""
        before = self._seq
        try:
            if self._aborted is not None or self._closed:
                self._check_open()
            kx = key_of(x)
            key = None if kx is None or root.__class__ is not int else ("broadcast", kx, root)
            route = self._routes.get(key) if key is not None else None
            if route is None:
                xb = as_buffer(x, "broadcast: x")
                r = self._root(root, "broadcast: root")
                route = self._route(key, "broadcast", xb, partial(general.broadcast, self), None, r)
            return self._one_array(route, x, self.rank != route.root, async_op, timeout)
        except InvalidArgument:
            self._refused("broadcast", before)
            raise

    def _one_array(
        self, route: Route, x: Any, write: bool, async_op: bool, timeout: float | None
    ) -> Work | None:
        """A rooted collective of one array (reduce, broadcast) on its route: the prepared
        call (or the carried one) of a blocking call on a host array (`write`: this rank's
        array receives), else the route's general path, with the sequence number the
        prepared call took where it declined."""
        if (route.run or route.land) is not None and not async_op and not _work.observing:
            xh = route.view(x, write)
            if xh is not None:
                if (
                    carried.run(self, route, xh, timeout)
                    if route.land is not None
                    else self._blocking_run(route, timeout, xh)
                ):
                    return None
                return route.general(route, x, False, timeout, self._last_entered)
        elif async_op and (route.start or route.land) is not None:
            xh = host_view(x, write)
            if xh is not None:
                return self._start_prepared(route, timeout, (x,), xh)
        return route.general(route, x, async_op, timeout, None)

    def all_gather(
        self, out: Any, x: Any, *, async_op: bool = False, timeout: float | None = None
    ) -> Work | None:
        """Block i of `out` (size blocks the size of `x`) receives `x` of rank i. In place
        where `x` is this rank's block of `out` (NCCL's layout): x is read where it lies."""
        return self._blocks(
            "all_gather", out, x, None, async_op, timeout, lambda t: t.all_gather, self.size, 1
        )

    def reduce_scatter(
        self,
        out: Any,
        x: Any,
        op: ReduceOp | str = ReduceOp.SUM,
        *,
        async_op: bool = False,
        timeout: float | None = None,
    ) -> Work | None:
        """Rank i's `out` receives the reduction of block i (of size blocks) of every `x`. In
        place where `out` is this rank's block of `x` (NCCL's layout); x's other blocks are
        left as they are."""
        return self._blocks(
            "reduce_scatter", out, x, op, async_op, timeout, _reduce_scatter, 1, self.size
        )

    def all_to_all(
        self, out: Any, x: Any, *, async_op: bool = False, timeout: float | None = None
    ) -> Work | None:
        """Block j of `x` goes to rank j; block i of `out` comes from rank i. `out` may be `x`
        (in place: x is copied first, except where the transport reads all of it before it
        writes: staged through its shared segment)."""
        return self._blocks(
            "all_to_all", out, x, None, async_op, timeout, lambda t: t.all_to_all, 1, 1
        )

    def _blocks(
        self,
        op: str,
        out: Any,
        x: Any,
        rop: Any,
        async_op: bool,
        timeout: float | None,
        method: Callable[[Transport], Callable[..., Work]],
        out_blocks: int,
        x_blocks: int,
    ) -> Work | None:
        """all_gather, reduce_scatter and all_to_all: an input and a separate output whose
        element counts relate as out_blocks to x_blocks."""
        before = self._seq
        try:
            if self._aborted is not None or self._closed:
                self._check_open()
            kx, ko = key_of(x), key_of(out)
            key = (
                None
                if kx is None or ko is None or rop.__class__ not in OP_TYPES
                else (op, kx, ko, rop)
            )
            route = self._routes.get(key) if key is not None else None
            if route is None:
                route = self._route_blocks(key, op, out, x, rop, out_blocks, x_blocks, method)
            if (route.run or route.land) is not None and not async_op and not _work.observing:
                xh = route.view(x, False)
                oh = route.view(out, True)
                # the carried path takes any overlap (every input is in the records before an
                # output is written); a prepared call that serves in-place forms tells overlaps
                # apart itself
                carry = route.land is not None
                if (
                    xh is not None
                    and oh is not None
                    and (
                        carry
                        or getattr(route.run, "in_place", False)
                        or not may_share_memory(xh, oh)
                    )
                ):
                    if (
                        carried.run(self, route, xh, timeout, oh)
                        if carry
                        else self._blocking_run(route, timeout, xh, oh)
                    ):
                        return None
                    return route.general(route, out, x, False, timeout, self._last_entered)
            elif async_op and (route.start or route.land) is not None:
                # a prepared start copies every input in before it writes an output, and a carried
                # call reads every input before it writes: any overlap
                xh, oh = host_view(x, False), host_view(out, True)
                if xh is not None and oh is not None:
                    return self._start_prepared(route, timeout, (out, x), xh, oh)
            return route.general(route, out, x, async_op, timeout, None)
        except InvalidArgument:
            self._refused(op, before)
            raise

    def _route_blocks(
        self,
        key: Hashable | None,
        op: str,
        out: Any,
        x: Any,
        rop: Any,
        out_blocks: int,
        x_blocks: int,
        method: Callable[[Transport], Callable[..., Work]],
    ) -> Route:
        xb = as_buffer(x, f"{op}: x")
        ob = as_buffer(out, f"{op}: out")
        r = None
        if op == "reduce_scatter":
            r = as_reduce_op(rop, f"{op}: op")
            check_op_for_dtype(r, xb.dtype, op)
        if op == "all_to_all" and xb.count % self.size:
            raise InvalidArgument(
                f"all_to_all: x must hold {self.size} equal blocks (one per rank), got "
                f"{xb.count} elements"
            )
        if op == "all_gather":
            expected = f"{self.size} x {xb.count} = {self.size * xb.count} elements"
        elif op == "reduce_scatter":
            expected = f"x's {xb.count} elements / {self.size} ranks" + (
                "" if xb.count % self.size == 0 else " (x does not split evenly)"
            )
        else:
            expected = f"{xb.count} elements"
        same(ob, xb, f"{op}: out", ob.count * x_blocks == xb.count * out_blocks, expected)
        return self._route(key, op, xb, partial(general.blocks, self, method), r, -1, ob)

    def barrier(self, *, async_op: bool = False, timeout: float | None = None) -> Work | None:
        """Complete once every rank of the group has called barrier."""
        before = self._seq
        try:
            if self._aborted is not None or self._closed:
                self._check_open()
            route = self._routes.get("barrier")
            if route is None:
                route = self._route("barrier", "barrier", None, no_general)
            if self._checking and not _work.observing:
                # the check compares the barrier's signature across the group, so it completes
                # once every rank has entered the barrier: it is the barrier
                route.runs += 1
                if not async_op:
                    if timeout is not None:
                        check_timeout(timeout, "barrier")
                    self._enter(route, timeout)
                    return None
                work = self._admit(route, partial(completed, self, "barrier"))
                return self._finish(work, True, timeout)
            if route.run is not None and not async_op and not _work.observing:
                if self._blocking_run(route, timeout):
                    return None
                seq: int | None = self._last_entered
            else:
                seq = None
            transport = route.transport
            return self._collective(route, async_op, timeout, seq, transport.barrier, ())
        except InvalidArgument:
            self._refused("barrier", before)
            raise


def _reduce_scatter(t: Transport) -> Callable[..., Work]:
    return t.reduce_scatter


__all__ = ["Communicator", "MismatchError", "Route"]
