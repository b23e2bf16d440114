"""The general path of each operation: what a call takes where its route has no prepared call
for it (asynchronous calls, strided or device arrays without one, a prepared call that
declined). Per call: the arrays' Buffers and the checks that depend on the arrays themselves
(writability, overlaps), packed copies of strided arrays (unpacked into the caller's array once
the operation completes), then the transport's method and its Work, entered and waited for by
the Communicator (`_collective`, `_finish`). Each function is a route's `general`, bound to its
communicator (hetcomm.routes.Route)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import work as _work
from .argcheck import check_timeout, contiguous_in, contiguous_out, then, writable
from .arrays import as_buffer, overlap, own_block
from .errors import InvalidArgument

if TYPE_CHECKING:
    from .arrays import Buffer
    from .comm import Communicator
    from .pointtopoint import PointToPoint
    from .routes import Route
    from .transports.base import Transport
    from .work import Work


def all_reduce(
    comm: Communicator,
    route: Route,
    x: Any,
    out: Any,
    inplace: bool,
    async_op: bool,
    timeout: float | None,
    seq: int | None,
) -> Work | None:
    """all_reduce: x into x (in place) or into out (`inplace` says which); an out that is x's
    memory under another name is in place, one that partly overlaps x is refused."""
    xb = as_buffer(x, "all_reduce: x")
    rop = route.rop
    assert rop is not None
    if inplace:
        writable(xb, "all_reduce: x (in place)")
        ob = xb
    else:
        ob = as_buffer(out, "all_reduce: out")
        writable(ob, "all_reduce: out")
        kind = overlap(xb, ob)
        if kind == "partial":
            raise InvalidArgument(
                "all_reduce: out partly overlaps x; use x itself or a separate array"
            )
        if kind == "same":
            ob = xb
    transport = route.transport
    if xb.contiguous and ob.contiguous:
        return comm._collective(
            route,
            async_op,
            timeout,
            seq,
            lambda s: transport.all_reduce(xb, ob, rop, s),
            (xb, ob),
        )
    steps: list[Callable[[], None]] = []
    same = ob is xb
    xc = contiguous_out(xb, steps) if same else contiguous_in(xb)
    oc = xc if same else contiguous_out(ob, steps)
    return comm._collective(
        route,
        async_op,
        timeout,
        seq,
        lambda s: then(transport.all_reduce(xc, oc, rop, s), steps),
        (xb, ob, xc, oc),
    )


def reduce(
    comm: Communicator, route: Route, x: Any, async_op: bool, timeout: float | None, seq: int | None
) -> Work | None:
    """reduce into the root's x (the root's x must be writable)."""
    xb = as_buffer(x, "reduce: x")
    rop, root = route.rop, route.root
    assert rop is not None
    at_root = comm.rank == root
    if at_root:
        writable(xb, "reduce: x at the root")
    steps: list[Callable[[], None]] = []
    xc = contiguous_out(xb, steps) if at_root else contiguous_in(xb)
    transport = route.transport
    return comm._collective(
        route,
        async_op,
        timeout,
        seq,
        lambda s: then(transport.reduce(xc, rop, root, s), steps),
        (xb, xc),
    )


def broadcast(
    comm: Communicator, route: Route, x: Any, async_op: bool, timeout: float | None, seq: int | None
) -> Work | None:
    """broadcast of the root's x into every other rank's x."""
    xb = as_buffer(x, "broadcast: x")
    root = route.root
    if comm.rank != root:
        writable(xb, "broadcast: x")
    steps: list[Callable[[], None]] = []
    xc = contiguous_in(xb) if comm.rank == root else contiguous_out(xb, steps)
    transport = route.transport
    return comm._collective(
        route,
        async_op,
        timeout,
        seq,
        lambda s: then(transport.broadcast(xc, root, s), steps),
        (xb, xc),
    )


def send(
    comm: PointToPoint,
    route: Route,
    x: Any,
    dst: int,
    tag: int,
    async_op: bool,
    timeout: float | None,
    seq: int | None,
) -> Work | None:
    """send of x to `dst` (`seq`: the number a declined prepared call took, else None)."""
    xb = as_buffer(x, "send: x")
    xc = contiguous_in(xb)
    work = _p2p(comm, route, xc, dst, tag, async_op, timeout, seq)
    return comm._finish(work, async_op, timeout, (xb, xc))


def recv(
    comm: PointToPoint,
    route: Route,
    x: Any,
    src: int,
    tag: int,
    async_op: bool,
    timeout: float | None,
    seq: int | None,
) -> Work | int:
    """recv into x from `src`: the sender's rank, or with `async_op` the Work."""
    xb = as_buffer(x, "recv: x")
    writable(xb, "recv: x")
    steps: list[Callable[[], None]] = []
    xc = contiguous_out(xb, steps)
    work = then(_p2p(comm, route, xc, src, tag, async_op, timeout, seq), steps)
    comm._finish(work, async_op, timeout, (xb, xc))
    if async_op:
        return work
    return work.source if work.source is not None else src


def _p2p(
    comm: PointToPoint,
    route: Route,
    xc: Buffer,
    peer: int,
    tag: int,
    async_op: bool,
    timeout: float | None,
    seq: int | None,
) -> Work:
    """The transport's send or receive (route.op) of the contiguous `xc`, numbered (`seq`, or
    the next number), told whether the call blocks with no timeout of its own (a transport
    may then run it to its end on this thread)."""
    if timeout is not None:
        check_timeout(timeout, route.op)
    route.uses += 1
    if seq is None:
        comm._p2p_seq = seq = comm._p2p_seq + 1
    transport = route.transport
    method = transport.send if route.op == "send" else transport.recv
    _work.set_blocking(not async_op and timeout is None)
    try:
        return method(xc, peer, tag, seq)
    finally:
        _work.set_blocking(False)


def blocks(
    comm: Communicator,
    method: Callable[[Transport], Callable[..., Work]],
    route: Route,
    out: Any,
    x: Any,
    async_op: bool,
    timeout: float | None,
    seq: int | None,
) -> Work | None:
    """The general path of all_gather, reduce_scatter and all_to_all."""
    op = route.op
    xb = as_buffer(x, f"{op}: x")
    ob = as_buffer(out, f"{op}: out")
    writable(ob, f"{op}: out")
    steps: list[Callable[[], None]] = []
    # an input the output overlaps is copied first, except in the in-place forms that every
    # transport serves as they are (NCCL's rules: all_gather's x is this rank's block of
    # out, reduce_scatter's out is this rank's block of x) and where the transport reads all
    # of x before it writes out (staged through its shared segment)
    aliased = (
        overlap(xb, ob) != "none"
        and not (
            own_block(xb, ob, comm.rank)
            if op == "all_gather"
            else op == "reduce_scatter" and own_block(ob, xb, comm.rank)
        )
        and not route.transport.stages_input(op, xb.nbytes)
    )
    xc = contiguous_in(xb, copy=aliased)
    oc = contiguous_out(ob, steps)
    call = method(route.transport)
    rop = route.rop
    if rop is None:

        def start(s: int) -> Work:
            return then(call(oc, xc, s), steps)
    else:

        def start(s: int) -> Work:
            return then(call(oc, xc, rop, s), steps)

    return comm._collective(route, async_op, timeout, seq, start, (xb, ob, xc, oc))
