"""Communicator: validate each call, let the plan pick a transport, start it, hand back a Work."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, Literal, overload

import numpy as np
from mpi4py import MPI

from . import ANY_SOURCE, fusion
from . import plan as planning
from . import work as _work
from .arrays import Buffer, as_buffer, overlap, storage_dtype
from .config import Config
from .dtypes import CODES as DTYPE_CODES
from .errors import CommAborted, InvalidArgument, MismatchError, TransportUnavailable
from .ops import ReduceOp, as_reduce_op, check_op_for_dtype
from .topology import Topology
from .transports import registry
from .transports.base import Transport
from .transports.mpi.transport import MpiTransport
from .work import Work, completed

log = logging.getLogger("hetcomm")

_OP_CODES = {name: i for i, name in enumerate(planning.OPS)}


# the MPI communicators of closed Communicators, never freed (see Communicator.close)
_CLOSED_MPI_COMMS: list[MPI.Intracomm] = []

_AVG = ReduceOp.AVG
_SMALL_BYTES = planning.SMALL_BYTES
_POINT_TO_POINT = frozenset(("send", "recv"))


class Communicator:
    """A group of ranks and the operations among them; every rank of the group calls each op.

    Made by `hetcomm.init()`, `ParallelGroups` or `split()`; owns its MPI communicator (a Dup or
    a Split), which `close()` retires (kept unused until MPI_Finalize, so that no message of this
    group reaches another). Collectives follow NCCL's layouts; see the README.
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
        self.topology = topology
        self.name = name
        self.rank: int = mpi_comm.Get_rank()
        self.size: int = mpi_comm.Get_size()
        self._seq = 0  # collectives (and barriers) so far: the same on every rank
        self._p2p_seq = 0
        self._debug = config.debug
        self._closed = False
        self._aborted: BaseException | None = None
        self._transports: dict[str, Transport] = {}
        self._choices: dict[tuple[str, str, str], planning.Choice] = {}
        self._routes: dict[tuple[str, bool, bool], Transport] = {}
        # the short path of small in-place host all-reduces: (transport, its in-place method)
        # for small and for large messages, once their routes are known
        self._short: dict[bool, tuple[Transport, Callable[..., bool]]] = {}
        # the ordering guard: the transport of the latest collective, and the asynchronous
        # collectives not yet seen complete (see _order)
        self._last: Transport | None = None
        self._inflight: list[Work] = []
        self._available: dict[str, type[Transport]] = registry()
        self._unavailable = {n: cls.unavailable(topology) for n, cls in self._available.items()}
        # transports this communicator must not use, with the reason the plan shows (the parts
        # of a hier transport exclude hier itself)
        self._unavailable.update(exclude or {})

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
        for transport in self._transports.values():
            transport.close()
        self._transports.clear()
        # The MPI communicators are kept, not freed, until MPI_Finalize (about 10 KB each).
        # MPI gives a freed communicator's context id to the next one made, and Open MPI hands
        # that one the messages still addressed to the old: a message another rank sends on
        # this group after it closed here would reach a later group. Kept, such a message is
        # never matched: it is dropped, or its sender fails within its timeout (as gloo's and
        # NCCL's do). An aborted communicator may also have MPI operations in flight, which a
        # free would let write into released memory.
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

    def __repr__(self) -> str:
        return f"<hetcomm.Communicator '{self.name}' rank {self.rank} of {self.size}>"

    # ---- sub-communicators ------------------------------------------------------------------

    def split(
        self, color: int | None, key: int | None = None, name: str | None = None
    ) -> Communicator | None:
        """Ranks with the same `color` form a new communicator, ordered by `key` (default rank).

        `color=None` (or negative) leaves this rank out: it gets None. Collective.
        """
        self._check_open()
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
        return Communicator(new, self.config, self.topology.subset(parents), label)

    def dup(self, name: str | None = None) -> Communicator:
        """A new communicator with the same members and its own message space. Collective."""
        self._check_open()
        self._drain("dup")
        return Communicator(self.mpi.Dup(), self.config, self.topology, name or self.name)

    # ---- the plan ---------------------------------------------------------------------------

    @property
    def plan(self) -> planning.PlanTable:
        """The transport chosen for each operation, memory kind and size class, with reasons."""
        return planning.plan_table(
            self.topology.members(),
            requested=self.config.transport_for(self.name),
            unavailable=self._unavailable,
            group=self.name,
            direct_min=self.config.direct_min,
        )

    def _transport(self, op: str, buf: Buffer | None) -> Transport:
        # on the path of every call: one dict lookup once the route is known
        if buf is None:
            route = (op, False, True)
        else:
            route = (op, buf.device != "cpu", buf.count * buf.itemsize <= planning.SMALL_BYTES)
        found = self._routes.get(route)
        if found is not None:
            return found
        found = self._routes[route] = self._resolve(op, buf)
        fast = getattr(found, "all_reduce_in_place", None)
        if op == "all_reduce" and not route[1] and fast is not None:
            self._short[route[2]] = (found, fast)
        return found

    def _resolve(self, op: str, buf: Buffer | None) -> Transport:
        memory = "device" if buf is not None and buf.on_device else "host"
        nbytes = buf.nbytes if buf is not None else 0
        key = (op, memory, planning.size_class(nbytes))
        choice = self._choices.get(key)
        if choice is None:
            choice = planning.choose(
                self.topology.members(),
                op=op,
                memory=memory,
                nbytes=nbytes,
                requested=self.config.transport_for(self.name),
                unavailable=self._unavailable,
                group=self.name,
                direct_min=self.config.direct_min,
            )
            self._choices[key] = choice
            log.info(
                "group '%s': %s on %s %s buffers -> %s (%s)",
                self.name,
                op,
                key[2],
                memory,
                choice.transport,
                choice.reason,
            )
        transport = self._transports.get(choice.transport)
        if transport is None:
            transport = self._transports[choice.transport] = self._available[choice.transport](self)
        return transport

    # ---- helpers shared by the operations ---------------------------------------------------

    def _start(
        self,
        op: str,
        buf: Buffer | None,
        root: int = -1,
        timeout: float | None = None,
        blocking: bool = False,
    ) -> tuple[Transport, int]:
        if timeout is not None:
            _check_timeout(timeout, op)
        transport = self._transport(op, buf)
        _work.set_blocking(blocking)
        if op in _POINT_TO_POINT:
            # only two ranks take part: a count of their own keeps collective numbers in step
            self._p2p_seq += 1
            return transport, self._p2p_seq
        if transport is not self._last:
            self._order(transport)
        self._seq += 1
        if self._debug:
            self._compare_fingerprints(op, buf, root)
        return transport, self._seq

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
        _work.set_blocking(False)
        if timeout is not None:
            work._timeout = float(timeout)
        if async_op:
            # the transport may read or write these until completion: packed copies included
            work._keep = keep
            if work.op not in _POINT_TO_POINT:
                inflight = self._inflight
                if len(inflight) >= 64:
                    inflight[:] = [w for w in inflight if not w._done]
                if not inflight or inflight[-1] is not work:
                    inflight.append(work)
            return work
        if not work.test():
            work.wait()
        return None

    def _root(self, root: Any, what: str) -> int:
        if isinstance(root, bool) or not isinstance(root, (int, np.integer)):
            raise InvalidArgument(f"{what}: expected an int rank, got {root!r}")
        if not 0 <= root < self.size:
            raise InvalidArgument(
                f"{what}: expected a rank in [0, {self.size}) of group '{self.name}', got {root}"
            )
        return int(root)

    def _drain(self, op: str) -> None:
        """Before `op`, a call on this MPI communicator outside the transports: let each
        transport make the calls it still has queued there, so that `op` comes after them on
        every rank (MPI matches collectives by the order they are called in)."""
        for transport in self._transports.values():
            transport.drain(op, self._seq)

    def _compare_fingerprints(self, op: str, buf: Buffer | None, root: int) -> None:
        self._drain(f"{op} fingerprint")
        mine = np.array(
            [
                self._seq,
                _OP_CODES[op],
                DTYPE_CODES[buf.dtype] if buf else -1,
                buf.count if buf else 0,
                root,
            ],
            dtype=np.int64,
        )
        every = np.empty((self.size, 5), dtype=np.int64)
        Work(self, f"{op} fingerprint", self._seq, self.mpi.Iallgather(mine, every).Test).wait()
        if (every == mine).all():
            return
        fields = ("sequence", "operation", "dtype", "count", "root")
        names = {"operation": planning.OPS, "dtype": tuple(DTYPE_CODES)}
        diffs = []
        for col, field in enumerate(fields):
            values = every[:, col]
            if (values != values[0]).any():
                show = [names[field][v] if field in names and v >= 0 else int(v) for v in values]
                diffs.append(
                    f"{field} differs: " + ", ".join(f"rank {r}: {v}" for r, v in enumerate(show))
                )
        raise MismatchError(f"group '{self.name}' op #{self._seq}: " + "; ".join(diffs))

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
        if self._aborted is not None or self._closed:
            self._check_open()
        if (
            out is None
            and not async_op
            and timeout is None
            and op.__class__ is ReduceOp
            and not self._debug
            and _work._recorder is None
        ):
            # small in-place reductions (optimizer scalars, loss values) of numpy arrays and CPU
            # tensors: every check below still holds, read straight off the array. Not while
            # tracing is on (or not yet decided): the general path makes the Work it records
            arr = x if type(x) is np.ndarray else _cpu_tensor_array(x)
            if arr is not None:
                short = self._short.get(arr.nbytes <= _SMALL_BYTES)
                if (
                    short is not None
                    and short[0] is self._last
                    and short[1](arr, op, self._seq + 1)
                ):
                    self._seq += 1
                    return None
        xb = as_buffer(x, "all_reduce: x")
        rop = op if op.__class__ is ReduceOp else as_reduce_op(op, "all_reduce: op")
        if rop is _AVG:
            check_op_for_dtype(rop, xb.dtype, "all_reduce")
        if out is None or out is x:
            if xb.readonly:
                _writable(xb, "all_reduce: x (in place)")
            ob = xb
        else:
            ob = as_buffer(out, "all_reduce: out")
            _same(ob, xb, "all_reduce: out", ob.count == xb.count, f"{xb.count} elements")
            _writable(ob, "all_reduce: out")
            kind = overlap(xb, ob)
            if kind == "partial":
                raise InvalidArgument(
                    "all_reduce: out partly overlaps x; use x itself or a separate array"
                )
            if kind == "same":
                ob = xb
        transport, seq = self._start("all_reduce", xb, timeout=timeout, blocking=not async_op)
        if xb.contiguous and ob.contiguous:
            work = transport.all_reduce(xb, ob, rop, seq)
        else:
            steps: list[Callable[[], None]] = []
            inplace = ob is xb
            xc = _contiguous_out(xb, steps) if inplace else _contiguous_in(xb)
            oc = xc if inplace else _contiguous_out(ob, steps)
            work = _then(transport.all_reduce(xc, oc, rop, seq), steps)
            return self._finish(work, async_op, timeout, (xb, ob, xc, oc))
        return self._finish(work, async_op, timeout, (xb, ob))

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
        overlap in memory and read-only arrays raise InvalidArgument before anything moves.
        """
        self._check_open()
        what = "all_reduce_coalesced"
        rop = op if op.__class__ is ReduceOp else as_reduce_op(op, f"{what}: op")
        if timeout is not None:
            _check_timeout(timeout, what)
        bufs, groups = fusion.prepare(arrays, rop, what)
        if not groups:
            return completed(self, "all_reduce", self._seq) if async_op else None
        # every group's transport is chosen (and may refuse) before any array is read
        chosen = []
        for g in groups:
            if g.on_device:
                fusion.check_device(what)
            chosen.append(self._transport("all_reduce", g.fused()))
        if not async_op and all(
            isinstance(t, MpiTransport) and not g.on_device for g, t in zip(groups, chosen)
        ):
            sizes = [g.total * storage_dtype(g.dtype).itemsize for g in groups]
            mpi = chosen[0]  # the communicator's one mpi transport
            assert isinstance(mpi, MpiTransport)
            if all(map(mpi.fits_node, sizes)) and self._coalesced_on_node(
                groups, sizes, mpi, rop, timeout
            ):
                return None
        packed: list[tuple[Buffer, list[Callable[[], None]], Any]] = []
        for g in groups:
            if g.on_device:
                dev = fusion.pack_device(g)
                packed.append((g.fused(ptr=dev.ptr), [dev.unpack], dev))
            else:
                pool = fusion.host_buffers(self)
                flat = pool.take(g.dtype, g.total)
                fusion.pack_host(g, flat)
                packed.append(
                    (g.fused(flat[: g.total]), [_unpacker(g, flat), _giver(pool, flat)], flat)
                )
        works: list[Work] = []
        for fb, steps, holder in packed:
            # a group on another transport than the one before starts once the groups before it
            # are done (the ordering guard of _start waits for the collectives in flight)
            transport, seq = self._start("all_reduce", fb, timeout=timeout)
            if fb.on_device and transport.name == "mpi":
                holder.synchronize()  # MPI reads device memory without regard to streams
            work = _then(transport.all_reduce(fb, fb, rop, seq), steps)
            if timeout is not None:
                work._timeout = float(timeout)
            self._inflight.append(work)
            works.append(work)
        if async_op:
            work = works[0] if len(works) == 1 else _all_of(self, works)
            return self._finish(work, True, timeout, (bufs, packed))
        for work in works:
            self._finish(work, False, timeout)
        # seen complete here: out of the ordering guard's list, which would otherwise keep
        # every blocking call's arrays alive
        self._inflight = [w for w in self._inflight if not w._done]
        return None

    def _coalesced_on_node(
        self,
        groups: list[fusion.Group],
        sizes: list[int],
        transport: MpiTransport,
        rop: ReduceOp,
        timeout: float | None,
    ) -> bool:
        """A blocking all_reduce_coalesced of host arrays among one node's ranks: each group
        (of `sizes` bytes) packed into this rank's shared segment, reduced there, and unpacked,
        on this thread (hetcomm.transports.mpi.node). False, with nothing moved, where the
        segments cannot be had (every rank finds out alike): the call then takes the fused MPI
        all-reduce."""

        def wait(request: Any, what: str, seq: int) -> None:
            Work(self, f"all_reduce_coalesced ({what})", seq, request.Test, timeout=timeout).wait()

        node = transport.node_reduce("all_reduce_coalesced", self._seq + 1)
        try:
            node.segment(max(sizes), partial(wait, seq=self._seq + 1))
        except TransportUnavailable as exc:
            log.warning("group '%s': %s; fused all-reduces go through MPI", self.name, exc)
            transport.node_off()
            return False
        for g, nbytes in zip(groups, sizes):
            _, seq = self._start("all_reduce", g.fused(), timeout=timeout)
            fused = node.segment(nbytes, partial(wait, seq=seq)).view(storage_dtype(g.dtype))
            fusion.pack_host(g, fused)
            node.all_reduce(nbytes, g.dtype, rop, partial(wait, seq=seq))
            fusion.unpack_host(g, fused)
        return True

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
        self._check_open()
        xb = as_buffer(x, "reduce: x")
        root = self._root(root, "reduce: root")
        rop = as_reduce_op(op, "reduce: op")
        check_op_for_dtype(rop, xb.dtype, "reduce")
        if self.rank == root:
            _writable(xb, "reduce: x at the root")
        transport, seq = self._start("reduce", xb, root, timeout, not async_op)
        steps: list[Callable[[], None]] = []
        xc = _contiguous_out(xb, steps) if self.rank == root else _contiguous_in(xb)
        work = transport.reduce(xc, rop, root, seq)
        return self._finish(_then(work, steps), async_op, timeout, (xb, xc))

    def broadcast(
        self, x: Any, root: int, *, async_op: bool = False, timeout: float | None = None
    ) -> Work | None:
        """Copy `x` of `root` into `x` of every rank."""
        self._check_open()
        xb = as_buffer(x, "broadcast: x")
        root = self._root(root, "broadcast: root")
        if self.rank != root:
            _writable(xb, "broadcast: x")
        transport, seq = self._start("broadcast", xb, root, timeout, not async_op)
        steps: list[Callable[[], None]] = []
        xc = _contiguous_in(xb) if self.rank == root else _contiguous_out(xb, steps)
        work = transport.broadcast(xc, root, seq)
        return self._finish(_then(work, steps), async_op, timeout, (xb, xc))

    def all_gather(
        self, out: Any, x: Any, *, async_op: bool = False, timeout: float | None = None
    ) -> Work | None:
        """Block i of `out` (size blocks the size of `x`) receives `x` of rank i."""
        self._check_open()
        xb = as_buffer(x, "all_gather: x")
        ob = as_buffer(out, "all_gather: out")
        _same(
            ob,
            xb,
            "all_gather: out",
            ob.count == xb.count * self.size,
            f"{self.size} x {xb.count} = {self.size * xb.count} elements",
        )
        _writable(ob, "all_gather: out")
        transport, seq = self._start("all_gather", xb, timeout=timeout, blocking=not async_op)
        steps: list[Callable[[], None]] = []
        xc = _contiguous_in(xb, copy=overlap(xb, ob) != "none")
        oc = _contiguous_out(ob, steps)
        work = transport.all_gather(oc, xc, seq)
        return self._finish(_then(work, steps), async_op, timeout, (xb, ob, xc, oc))

    def reduce_scatter(
        self,
        out: Any,
        x: Any,
        op: ReduceOp | str = ReduceOp.SUM,
        *,
        async_op: bool = False,
        timeout: float | None = None,
    ) -> Work | None:
        """Rank i's `out` receives the reduction of block i (of size blocks) of every `x`."""
        self._check_open()
        xb = as_buffer(x, "reduce_scatter: x")
        ob = as_buffer(out, "reduce_scatter: out")
        rop = as_reduce_op(op, "reduce_scatter: op")
        check_op_for_dtype(rop, xb.dtype, "reduce_scatter")
        _same(
            ob,
            xb,
            "reduce_scatter: out",
            ob.count * self.size == xb.count,
            f"x's {xb.count} elements / {self.size} ranks"
            + ("" if xb.count % self.size == 0 else " (x does not split evenly)"),
        )
        _writable(ob, "reduce_scatter: out")
        transport, seq = self._start("reduce_scatter", xb, timeout=timeout, blocking=not async_op)
        steps: list[Callable[[], None]] = []
        xc = _contiguous_in(xb, copy=overlap(xb, ob) != "none")
        oc = _contiguous_out(ob, steps)
        work = transport.reduce_scatter(oc, xc, rop, seq)
        return self._finish(_then(work, steps), async_op, timeout, (xb, ob, xc, oc))

    def all_to_all(
        self, out: Any, x: Any, *, async_op: bool = False, timeout: float | None = None
    ) -> Work | None:
        """Block j of `x` goes to rank j; block i of `out` comes from rank i."""
        self._check_open()
        xb = as_buffer(x, "all_to_all: x")
        ob = as_buffer(out, "all_to_all: out")
        if xb.count % self.size:
            raise InvalidArgument(
                f"all_to_all: x must hold {self.size} equal blocks (one per rank), got "
                f"{xb.count} elements"
            )
        _same(ob, xb, "all_to_all: out", ob.count == xb.count, f"{xb.count} elements")
        _writable(ob, "all_to_all: out")
        transport, seq = self._start("all_to_all", xb, timeout=timeout, blocking=not async_op)
        steps: list[Callable[[], None]] = []
        xc = _contiguous_in(xb, copy=overlap(xb, ob) != "none")
        oc = _contiguous_out(ob, steps)
        work = transport.all_to_all(oc, xc, seq)
        return self._finish(_then(work, steps), async_op, timeout, (xb, ob, xc, oc))

    def send(
        self,
        x: Any,
        dst: int,
        tag: int = 0,
        *,
        async_op: bool = False,
        timeout: float | None = None,
    ) -> Work | None:
        """Send `x` to rank `dst`; pairs with the `recv` of the same tag there."""
        self._check_open()
        xb = as_buffer(x, "send: x")
        dst = self._root(dst, "send: dst")
        tag = self._tag(tag, "send")
        transport, seq = self._start("send", xb, timeout=timeout, blocking=not async_op)
        xc = _contiguous_in(xb)
        work = transport.send(xc, dst, tag, seq)
        return self._finish(work, async_op, timeout, (xb, xc))

    @overload
    def recv(
        self,
        x: Any,
        src: int,
        tag: int = 0,
        *,
        async_op: Literal[False] = False,
        timeout: float | None = None,
    ) -> int: ...
    @overload
    def recv(
        self,
        x: Any,
        src: int,
        tag: int = 0,
        *,
        async_op: Literal[True],
        timeout: float | None = None,
    ) -> Work: ...
    @overload
    def recv(
        self, x: Any, src: int, tag: int = 0, *, async_op: bool, timeout: float | None = None
    ) -> Work | int: ...
    def recv(
        self,
        x: Any,
        src: int,
        tag: int = 0,
        *,
        async_op: bool = False,
        timeout: float | None = None,
    ) -> Work | int:
        """Receive into `x` from rank `src` (a message of exactly x's size and dtype); returns
        the sender's rank, or with `async_op` a Work whose `source` is it once complete.

        `src=hetcomm.ANY_SOURCE` takes the next message with `tag` from any rank (on the mpi
        transport; the others refuse it with InvalidArgument)."""
        self._check_open()
        xb = as_buffer(x, "recv: x")
        anywhere = src == ANY_SOURCE and isinstance(src, (int, np.integer))
        src = ANY_SOURCE if anywhere else self._root(src, "recv: src")
        tag = self._tag(tag, "recv")
        _writable(xb, "recv: x")
        if anywhere:
            chosen = self._transport("recv", xb)
            if not chosen.any_source:
                memory = "device" if xb.on_device else "host"
                raise InvalidArgument(
                    f"recv from ANY_SOURCE: group '{self.name}' receives {memory} buffers of "
                    f"{xb.nbytes} bytes over the '{chosen.name}' transport, which needs the "
                    "sender's rank; name it (src=rank), or run the group on the mpi transport "
                    "(HETCOMM_TRANSPORT=mpi), which receives from any source"
                )
        transport, seq = self._start("recv", xb, timeout=timeout, blocking=not async_op)
        steps: list[Callable[[], None]] = []
        xc = _contiguous_out(xb, steps)
        work = _then(transport.recv(xc, src, tag, seq), steps)
        self._finish(work, async_op, timeout, (xb, xc))
        if async_op:
            return work
        return work.source if work.source is not None else src

    def barrier(self, *, async_op: bool = False, timeout: float | None = None) -> Work | None:
        """Complete once every rank of the group has called barrier."""
        self._check_open()
        transport, seq = self._start("barrier", None, timeout=timeout, blocking=not async_op)
        return self._finish(transport.barrier(seq), async_op, timeout)

    def _tag(self, tag: Any, what: str) -> int:
        top = self._tag_ub
        if isinstance(tag, bool) or not isinstance(tag, (int, np.integer)) or not 0 <= tag <= top:
            raise InvalidArgument(f"{what}: expected a tag in [0, {top}], got {tag!r}")
        return int(tag)


def _cpu_tensor_array(x: Any) -> np.ndarray | None:
    """The numpy view of a contiguous CPU torch tensor that needs no grad, else None."""
    cls = type(x)
    if cls.__name__ != "Tensor" or cls.__module__ != "torch":
        return None
    if not x.is_cpu or x.requires_grad or not x.is_contiguous():
        return None
    try:
        arr: np.ndarray = x.numpy()  # bfloat16 and friends raise: the general path takes them
    except (TypeError, RuntimeError):
        return None
    return arr


def _check_timeout(timeout: Any, op: str) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise InvalidArgument(
            f"{op}: timeout must be a positive number of seconds, got {timeout!r}"
        )
    return float(timeout)


def _same(b: Buffer, ref: Buffer, what: str, count_ok: bool, expected: str) -> None:
    if b.dtype != ref.dtype:
        raise InvalidArgument(f"{what}: expected dtype {ref.dtype} like x, got {b.dtype}")
    if b.on_device != ref.on_device or b.device_index != ref.device_index:
        raise InvalidArgument(
            f"{what}: expected memory where x lives ({ref.describe()}), got {b.describe()}"
        )
    if not count_ok:
        raise InvalidArgument(f"{what}: expected {expected}, got {b.count} (shape {list(b.shape)})")


def _writable(b: Buffer, what: str) -> None:
    if b.readonly:
        raise InvalidArgument(f"{what}: the array is read-only but this operation writes it")


def _contiguous_in(b: Buffer, copy: bool = False) -> Buffer:
    """`b` itself when contiguous, else (or when `copy`) a packed copy: inputs only."""
    if b.contiguous and not copy:
        return b
    if b.host is None:
        raise InvalidArgument(
            f"{b.describe()}: non-contiguous device arrays are not packed yet; pass a "
            "contiguous array (.contiguous() / cupy.ascontiguousarray)"
        )
    packed = np.array(b.host, order="C", copy=True).reshape(-1)
    return _host_buffer(b, packed)


def _contiguous_out(b: Buffer, steps: list[Callable[[], None]]) -> Buffer:
    """`b` itself when contiguous; else a packed copy whose result is written back when done."""
    if b.contiguous:
        return b
    if b.host is None:
        raise InvalidArgument(
            f"{b.describe()}: non-contiguous device arrays are not packed yet; pass a "
            "contiguous array (.contiguous() / cupy.ascontiguousarray)"
        )
    target = b.host
    packed = np.array(target, order="C", copy=True).reshape(-1)
    steps.append(lambda: np.copyto(target, packed.reshape(target.shape)))
    return _host_buffer(b, packed)


def _host_buffer(like: Buffer, flat: np.ndarray) -> Buffer:
    return Buffer(
        obj=like.obj,
        kind=like.kind,
        dtype=like.dtype,
        shape=like.shape,
        device="cpu",
        device_index=None,
        ptr=flat.__array_interface__["data"][0],
        contiguous=True,
        readonly=False,
        host=flat,
    )


def _then(work: Work, steps: list[Callable[[], None]]) -> Work:
    if steps:
        work._finish = [*work._finish, *steps]
    return work


def _unpacker(g: fusion.Group, flat: np.ndarray) -> Callable[[], None]:
    return lambda: fusion.unpack_host(g, flat)


def _giver(pool: fusion.HostBuffers, flat: np.ndarray) -> Callable[[], None]:
    return lambda: pool.give(flat)


def _all_of(comm: Communicator, works: list[Work]) -> Work:
    """One Work over several, complete once each is (in order; the first failure is its own)."""
    left = list(works)

    def poll() -> bool:
        while left:
            if not left[0].test():
                return False
            left.pop(0)
        return True

    return Work(comm, "all_reduce", works[-1].seq, poll)
