"""all_reduce_coalesced: arrays grouped by (dtype, memory), packed into one buffer per group,
reduced by one collective each, and unpacked (hetcomm.fusion packs)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from functools import partial
from operator import attrgetter
from typing import TYPE_CHECKING, Any

import numpy as np

from . import agree, fusion
from . import work as _work
from .argcheck import check_timeout, then
from .arrays import Buffer, storage_dtype
from .errors import TransportUnavailable
from .fusion import _DTYPE, _FLAGS, _PLAIN  # what fusion's own fast check reads
from .ops import ReduceOp, as_reduce_op
from .routes import MAX_ROUTES, Route, no_general
from .transports.base import Transport
from .transports.mpi.transport import MpiTransport
from .work import Work, all_of, completed

if TYPE_CHECKING:
    from .comm import Communicator

log = logging.getLogger("hetcomm")

# Blocking fused all-reduces of host arrays among one node's ranks go through the node's shared
# segments (_on_node) once a group holds this many bytes; smaller ones through the transport's
# prepared all_reduce of the fused buffer. 4 float32 arrays per call, 2-core VM, 2026-12-03,
# prepared / segments: 0.39-0.54x from 16 B to 16 KiB, 0.87x at 64 KiB, 1.03x at 128 KiB and
# 1.30-1.49x from 256 KiB (2 ranks); 0.29-0.46x to 64 KiB, 0.62x at 128 KiB and 256 KiB,
# 1.33-1.54x from 1 MiB (4 ranks).
NODE_MIN = 128 << 10


def all_reduce_coalesced(
    comm: Communicator,
    arrays: Sequence[Any],
    op: ReduceOp | str,
    async_op: bool,
    timeout: float | None,
) -> Work | None:
    """Communicator.all_reduce_coalesced (see its docstring)."""

    comm._check_open()
    what = "all_reduce_coalesced"
    rop = op if op.__class__ is ReduceOp else as_reduce_op(op, f"{what}: op")
    if timeout is not None:
        check_timeout(timeout, what)
    entered: int | None = None  # the sequence number a declined prepared call entered
    key, views = (None, None) if async_op or _work.observing else _arrays_key(arrays, rop)
    if key is not None:
        resolved = comm._routes.get(key)
        if resolved is not None:
            if comm._blocking_run(resolved, timeout, _host_views(arrays, views)):
                return None
            entered = comm._last_entered
    bufs, groups = fusion.prepare(arrays, rop, what)
    if not groups:
        return completed(comm, "all_reduce", comm._seq) if async_op else None
    # every group's transport is chosen (and may refuse) before any array is read; a repeated
    # signature finds it on the group's route
    routes = [comm._routes.get(_route_key(g, rop)) for g in groups]
    chosen = []
    for g, route in zip(groups, routes):
        if g.on_device:
            fusion.check_device(what)
        chosen.append(
            route.transport if route is not None else comm._transport("all_reduce", g.fused())
        )
    if (
        entered is None
        and not async_op
        and all(isinstance(t, MpiTransport) and not g.on_device for g, t in zip(groups, chosen))
    ):
        sizes = [g.total * storage_dtype(g.dtype).itemsize for g in groups]
        mpi = chosen[0]  # the communicator's one mpi transport
        assert isinstance(mpi, MpiTransport)
        if (
            max(sizes) >= NODE_MIN
            and all(map(mpi.fits_node, sizes))
            and _on_node(comm, groups, sizes, mpi, rop, timeout)
        ):
            return None
    packed: list[tuple[Buffer, list[Callable[[], None]], Any]] = []
    for g, transport in zip(groups, chosen):
        if g.on_device and transport.reduces_arrays:
            packed.append(_in_place(g, transport))
        elif g.on_device:
            dev = fusion.pack_device(g)
            packed.append((g.fused(ptr=dev.ptr), [dev.unpack], dev))
        else:
            pool = fusion.host_buffers(comm)
            flat = pool.take(g.dtype, g.total)
            fusion.pack_host(g, flat)
            packed.append(
                (g.fused(flat[: g.total]), [_unpacker(g, flat), _giver(pool, flat)], flat)
            )
    works: list[Work] = []
    for g, found, (fb, steps, holder) in zip(groups, routes, packed):
        # a group on another transport than the one before starts once the groups before it
        # are done (the ordering guard waits for the collectives in flight)
        route = found or comm._route(_route_key(g, rop), "all_reduce", fb, no_general, rop)
        if isinstance(holder, _Arrays) and found is None:
            # direct's leader reads as many records of every rank as this rank has arrays:
            # the check compares that number too (on every transport that takes them so)
            route.vec = agree.signature("all_reduce_coalesced", g.dtype, g.total, rop, len(g.bufs))
        seq, entered = entered, None
        if (
            seq is None
            and route.run is not None
            and not async_op
            and fb.host is not None
            and not _work.observing
        ):
            # blocking, on host memory: the transport's prepared all_reduce of the fused
            # buffer, on this thread, as a plain all_reduce of that size runs
            if comm._blocking_run(route, timeout, fb.host, fb.host):
                for step in steps:
                    step()
                if key is not None and len(groups) == 1:
                    _resolve(comm, key, route, g, arrays, views)
                continue
            seq = comm._last_entered  # declined: the general path, with the number entered
        transport = route.transport

        def start(
            s: int,
            fb: Buffer = fb,
            steps: list[Callable[[], None]] = steps,
            transport: Transport = transport,
            holder: Any = holder,
        ) -> Work:
            if isinstance(holder, _Arrays):
                work = transport.all_reduce_arrays(holder.spans, holder.dtype, rop, s, holder.ready)
                return then(work, steps)
            return then(transport.all_reduce(fb, fb, rop, s), steps)

        if fb.on_device and transport.name == "mpi":
            holder.synchronize()  # MPI reads device memory without regard to streams
        if async_op:
            work = comm._admit(route, start, fb if fb.on_device else None)
        else:
            work = start(comm._enter(route, timeout) if seq is None else seq)
        if timeout is not None:
            work._timeout = float(timeout)
        comm._inflight.append(work)
        works.append(work)
    if async_op:
        work = works[0] if len(works) == 1 else all_of(comm, works)
        return comm._finish(work, True, timeout, (bufs, packed))
    if works:
        for work in works:
            comm._finish(work, False, timeout)
        # seen complete here: out of the ordering guard's list, which would otherwise keep
        # every blocking call's arrays alive
        comm._inflight = [w for w in comm._inflight if not w._done]
    return None


class _Arrays:
    """A device group that the transport reduces where its arrays are: each array's
    (address, bytes) and the events after which the transport may read them (one per stream
    they are used on, recorded at the call). A packed buffer standing in for strided arrays
    lives as long as its unpack step."""

    __slots__ = ("dtype", "ready", "spans")

    def __init__(self, dtype: str, spans: list[tuple[int, int]], ready: list[Any]):
        self.dtype, self.spans, self.ready = dtype, spans, ready


def _in_place(
    g: fusion.Group, transport: Transport
) -> tuple[Buffer, list[Callable[[], None]], Any]:
    """What all_reduce_coalesced starts a device group with where the transport reduces the
    arrays where they are (`reduces_arrays`: direct's and staged's, where the ranks share one
    GPU; `all_reduce_arrays` then takes them): the group's arrays themselves
    where each is contiguous; else their places in one packed buffer (packed after the work
    queued on every array's stream, unpacked after). As packed's entries: the fused buffer
    (which only describes the group to the plan here), the steps after, the _Arrays."""
    if g.contiguous:
        spans = [(b.ptr, b.nbytes) for b in g.bufs]
        steps: list[Callable[[], None]] = []
    else:
        packed = fusion.pack_device(g)
        item = storage_dtype(g.dtype).itemsize
        spans = [(packed.ptr + off * item, n * item) for off, n in zip(g.offsets, g.counts)]
        steps = [packed.unpack]
    held = _Arrays(g.dtype, spans, transport.ready_events(g.bufs))
    return g.fused(), steps, held


def _arrays_key(arrays: Any, rop: ReduceOp) -> tuple[tuple[Any, ...] | None, Any]:
    """The key of a resolved call (see _resolve) and the numpy arrays it packs: for plain numpy
    arrays of one dtype, each C-contiguous, writable and owning its memory, given once each
    (arrays that own their memory cannot overlap), the arrays themselves; for CPU torch tensors
    of one dtype, contiguous, needing no grad, each on a storage of its own, None (their numpy
    views are made where a route uses them: _host_views). (None, None) for any other call.
    Read at every call: a few C-level maps."""
    if arrays.__class__ not in _SEQUENCES or not arrays:
        return None, None
    types = set(map(type, arrays))
    if types == _NDARRAY:
        dtypes = set(map(_DTYPE, arrays))
        if len(dtypes) != 1 or any(bits & _PLAIN != _PLAIN for bits in set(map(_FLAGS, arrays))):
            return None, None
        if len(set(map(id, arrays))) != len(arrays):
            return None, None  # an array given twice: the general path says which
        key = ("all_reduce_coalesced(arrays)", rop, dtypes.pop(), tuple(map(_SHAPE, arrays)))
        return key, arrays
    if len(types) == 1:
        (cls,) = types
        if cls.__name__ == "Tensor" and cls.__module__ == "torch":
            return _tensors_key(arrays, rop)
    return None, None


def _tensors_key(ts: Sequence[Any], rop: ReduceOp) -> tuple[tuple[Any, ...] | None, Any]:
    """_arrays_key for torch tensors."""
    dtypes = set(map(_DTYPE, ts))
    if len(dtypes) != 1:
        return None, None
    for t in ts:
        if not t.is_cpu or t.requires_grad or not t.is_contiguous():
            return None, None
    if len({t.untyped_storage().data_ptr() for t in ts}) != len(ts):
        return None, None  # views of one storage (or a tensor given twice): the general path
    return ("all_reduce_coalesced(tensors)", rop, dtypes.pop(), tuple(map(_SHAPE, ts))), None


def _host_views(arrays: Sequence[Any], views: Any) -> Sequence[np.ndarray]:
    """The numpy arrays a resolved call packs: `views` where _arrays_key gave them, else the
    numpy views of CPU tensors (their dtype converted when the route was made, so it does)."""
    return views if views is not None else [t.numpy() for t in arrays]


_SEQUENCES = (list, tuple)
_NDARRAY = {np.ndarray}
_SHAPE = attrgetter("shape")


def _resolve(
    comm: Communicator,
    key: tuple[Any, ...],
    fused: Route,
    g: fusion.Group,
    arrays: Sequence[Any],
    views: Any,
) -> None:
    """Keep, under `key`, the route of a blocking call of plain numpy arrays of one dtype whose
    fused all_reduce just ran as the prepared call `fused`: a repeated call packs its arrays
    into a buffer of the route's own, runs that prepared call on it and unpacks, without a
    grouping or a Buffer per array. Its signature vector is the fused all_reduce's (the same
    object): ranks that take either path agree, as they make the same MPI calls."""
    assert fused.run is not None
    try:
        hosts = _host_views(arrays, views)
    except (TypeError, RuntimeError):  # bfloat16 and the like: the general path packs those
        return
    flat = np.empty(g.total, storage_dtype(g.dtype))
    pieces = [flat[off : off + a.size].reshape(a.shape) for off, a in zip(g.offsets, hosts)]
    inner = fused.run
    busy = False

    def run(xs: Sequence[np.ndarray], seq: int) -> bool:
        nonlocal busy
        if busy:  # another thread's call in this buffer: the general path
            return False
        busy = True
        try:
            np.concatenate(xs, axis=None, out=flat)
            if not inner(flat, flat, seq):
                return False
            fused.runs += 1
            for x, piece in zip(xs, pieces):
                x[...] = piece
        finally:
            busy = False
        return True

    route = Route("all_reduce", fused.transport, fused.vec, no_general, fused.rop, -1, run)
    route.dtype = fused.dtype
    if len(comm._routes) >= MAX_ROUTES:
        comm._routes.clear()
    comm._routes[key] = route


def _route_key(g: fusion.Group, rop: ReduceOp) -> tuple[Any, ...]:
    """What of a group decides its fused all_reduce's route (kept in the communicator's routes
    as an all_reduce's is): a repeated call takes the transport's prepared call for that
    size. A device group's number of arrays too: where the leader reduces them one by one,
    the route's signature holds it."""
    arrays = len(g.bufs) if g.on_device else 0
    return ("all_reduce_coalesced", g.dtype, g.total, g.device, g.device_index, arrays, rop)


def _on_node(
    comm: Communicator,
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
        Work(comm, f"all_reduce_coalesced ({what})", seq, request.Test, timeout=timeout).wait()

    if comm._deferred:
        # the segments' first use duplicates the transport's communicator: a collective, which
        # must come after the asynchronous collectives issued before it on every rank
        comm._flush_deferred("all_reduce_coalesced", comm._seq + 1, timeout)
    node = transport.node_reduce("all_reduce_coalesced", comm._seq + 1)
    try:
        node.segment(max(sizes), partial(wait, seq=comm._seq + 1))
    except TransportUnavailable as exc:
        log.warning("group '%s': %s; fused all-reduces go through MPI", comm.name, exc)
        transport.node_off()
        return False
    for g, nbytes in zip(groups, sizes):
        route = comm._route(None, "all_reduce", g.fused(), no_general, rop)
        seq = comm._enter(route, timeout)
        fused = node.segment(nbytes, partial(wait, seq=seq)).view(storage_dtype(g.dtype))
        fusion.pack_host(g, fused)
        node.all_reduce(nbytes, g.dtype, rop, partial(wait, seq=seq))
        fusion.unpack_host(g, fused)
    return True


def _unpacker(g: fusion.Group, flat: np.ndarray) -> Callable[[], None]:
    return lambda: fusion.unpack_host(g, flat)


def _giver(pool: fusion.HostBuffers, flat: np.ndarray) -> Callable[[], None]:
    return lambda: pool.give(flat)
