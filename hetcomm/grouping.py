"""`with comm.group():` blocks: point-to-point calls queued where they are made and started
together when the block ends (see Communicator.group); and sendrecv's exchange of host arrays
without one, through the transport's prepared calls (`exchange`, `start_exchange`), else a
block of two calls."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import work as _work
from .argcheck import check_timeout, writable
from .arrays import as_buffer
from .errors import InvalidArgument
from .routes import Route, host_view, no_general
from .work import Follow, Work, all_of

if TYPE_CHECKING:
    from .pointtopoint import PointToPoint


class Queued:
    """A point-to-point call queued by a group block, and its Work once started."""

    __slots__ = ("blocking", "dropped", "op", "peer", "tag", "timeout", "work", "x")

    def __init__(
        self, op: str, x: Any, peer: int, tag: int, timeout: float | None, blocking: bool
    ) -> None:
        self.op, self.x, self.peer, self.tag, self.timeout = op, x, peer, tag, timeout
        self.blocking = blocking
        self.work: Work | None = None
        self.dropped = False


class Group:
    """The context manager of Communicator.group()."""

    def __init__(self, comm: PointToPoint) -> None:
        self.comm = comm

    def __enter__(self) -> Group:
        comm = self.comm
        comm._check_open()
        if comm._group is not None:
            raise InvalidArgument("comm.group() blocks do not nest")
        comm._group = []
        return self

    def __exit__(self, kind: object, exc: object, tb: object) -> None:
        comm = self.comm
        items, comm._group = comm._group or [], None
        if kind is not None:
            for item in items:
                item.dropped = True
            return
        run(comm, items)


def queue(
    comm: PointToPoint,
    op: str,
    x: Any,
    peer: int,
    tag: int,
    async_op: bool,
    timeout: float | None,
) -> Work | None:
    """A send or recv inside `with comm.group():`, validated now and started at its end."""
    assert comm._group is not None
    if timeout is not None:
        check_timeout(timeout, op)
    xb = as_buffer(x, f"{op}: x")
    if op == "recv":
        writable(xb, "recv: x")
    item = Queued(op, x, peer, tag, timeout, not async_op)
    comm._group.append(item)
    if not async_op:
        return None

    def poll() -> bool:
        if item.work is None:
            if item.dropped:
                raise InvalidArgument(f"{op}: its comm.group() block ended by an exception")
            return False
        return item.work.test()

    follow = Follow(lambda: item.work)
    return Work(comm, op, comm._p2p_seq, poll, waiter=follow.wait, drive=follow.drive)


def run(comm: PointToPoint, items: list[Queued]) -> None:
    """Start the calls of a group block, receives first, then wait for the blocking ones,
    receives first too: a peer may land a send only once its own sends are done (staged
    messages past the eager ring), and meanwhile this thread lands what comes to it."""
    order = [i for i in items if i.op == "recv"] + [i for i in items if i.op == "send"]
    for item in order:
        call = comm.recv if item.op == "recv" else comm.send
        item.work = call(item.x, item.peer, item.tag, async_op=True, timeout=item.timeout)
    for item in order:
        if item.blocking:
            assert item.work is not None
            item.work.wait()


def exchange(
    comm: PointToPoint,
    x: Any,
    dst: int,
    out: Any,
    src: int,
    tag: int,
    recv_tag: int,
    timeout: float | None,
) -> bool:
    """A blocking sendrecv through the transport's prepared exchange of the pair
    (`prepare("sendrecv")`, kept as a route beside the send's and the receive's; host arrays,
    or device addresses where the routes read those), with no group block. False, having moved
    nothing, where the transport has none or either call would be refused (the group block then
    makes or refuses both)."""
    if _work.observing:
        return False
    views = _pair_views(comm, x, dst, out, src, tag, recv_tag, timeout)
    if views is None:
        return False
    send, receive, xh, oh = views
    pair = _pair(comm, send, receive, x, out)
    return pair.run is not None and comm._run_pair(pair, xh, dst, tag, oh, src, recv_tag, timeout)


def start_exchange(
    comm: PointToPoint,
    x: Any,
    dst: int,
    out: Any,
    src: int,
    tag: int,
    recv_tag: int,
    timeout: float | None,
) -> Work | None:
    """An asynchronous sendrecv of host arrays: the receive's prepared start, then the send's,
    with no group block, their Works joined (the receive's first). None, having moved nothing,
    where either has no prepared start or either call would be refused (the group block then
    makes or refuses both)."""
    views = _pair_views(comm, x, dst, out, src, tag, recv_tag, timeout)
    if views is None:
        return None
    send, receive, xh, oh = views
    if send.start is None or receive.start is None or send.view is not host_view:
        return None
    got = comm._start_p2p(receive, out, oh, src, recv_tag, timeout)
    sent = comm._start_p2p(send, x, xh, dst, tag, timeout)
    return all_of(comm, [got, sent], "sendrecv")


def _pair_views(
    comm: PointToPoint,
    x: Any,
    dst: int,
    out: Any,
    src: int,
    tag: int,
    recv_tag: int,
    timeout: float | None,
) -> tuple[Route, Route, Any, Any] | None:
    """The send's and the receive's routes of a sendrecv and what their prepared calls take
    of each array (route.view: a host view, or a device address), once every argument is
    known good; None where the calls go through a group block instead (an argument to refuse
    there, arrays of two kinds of memory or views, a group block open, the communicator
    closed)."""
    size, top = comm.size, comm._tag_ub
    if (
        comm._aborted is not None
        or comm._closed
        or comm._group is not None
        or dst.__class__ is not int
        or src.__class__ is not int
        or tag.__class__ is not int
        or recv_tag.__class__ is not int
        or not (0 <= dst < size and 0 <= src < size and 0 <= tag <= top and 0 <= recv_tag <= top)
    ):
        return None
    receive = comm._p2p_route("recv", out)
    send = comm._p2p_route("send", x)
    view = send.view
    if receive.view is not view:
        return None
    oh = view(out, True)
    xh = view(x, False)
    if oh is None or xh is None:
        return None
    if timeout is not None:
        check_timeout(timeout, "sendrecv")
    return send, receive, xh, oh


def _pair(comm: PointToPoint, send: Route, receive: Route, x: Any, out: Any) -> Route:
    """The route of a sendrecv of these two arrays' signatures (kept beside theirs): the
    transport's prepared exchange of the pair where it has one (`Transport.prepare` of
    "sendrecv", given the send's buffer and the receive's), else none (`run` None)."""
    key = ("sendrecv", send, receive)
    pair = comm._routes.get(key)
    if pair is None:
        transport = send.transport
        prepare = getattr(transport, "prepare", None)
        run = None
        if prepare is not None and receive.transport is transport:
            xb, ob = as_buffer(x, "sendrecv: x"), as_buffer(out, "sendrecv: out")
            run = prepare("sendrecv", xb, ob, None, -1)
        pair = Route("sendrecv", transport, send.vec, no_general, run=run)
        comm._keep_route(key, pair)
    return pair
