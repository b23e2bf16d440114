"""Point-to-point calls of a Communicator (a mixin of hetcomm.comm.Communicator): send, recv,
sendrecv and `with comm.group():` blocks.

Each call validates its peer and tag, then takes the route of its array's signature: a
blocking call of host arrays runs the transport's prepared send or receive on the calling
thread, an asynchronous one its prepared start; a sendrecv the transport's exchange of the
pair (hetcomm.grouping). Anything else goes the general way (hetcomm.general).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, Literal, overload

import numpy as np

from . import ANY_SOURCE, general, grouping
from . import work as _work
from .arrays import as_buffer
from .entry import Entry
from .errors import InvalidArgument
from .grouping import Group
from .routes import Route, host_view, key_of, no_general
from .work import Work, all_of


class PointToPoint(Entry):
    """send, recv, sendrecv and group blocks, on the Communicator's state."""

    _tag_ub: int
    _routes: dict[Hashable, Route]
    _route: Callable[..., Route]
    _keep_route: Callable[[Hashable, Route], None]
    _root: Callable[[Any, str], int]
    _check_open: Callable[[], None]

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
        if self._aborted is not None or self._closed:
            self._check_open()
        dst = self._root(dst, "send: dst") if dst.__class__ is not int else dst
        if not 0 <= dst < self.size:
            self._root(dst, "send: dst")
        if tag.__class__ is not int or not 0 <= tag <= self._tag_ub:
            tag = self._tag(tag, "send")
        if self._group is not None:
            return grouping.queue(self, "send", x, dst, tag, async_op, timeout)
        route = self._p2p_route("send", x)
        if async_op and route.start is not None:
            xh = host_view(x, False)
            if xh is not None:
                return self._start_p2p(route, x, xh, dst, tag, timeout)
        if route.run is not None and not async_op and not _work.observing:
            xh = route.view(x, False)
            if xh is not None:
                seq = self._run_p2p(route, xh, dst, tag, timeout)
                if seq is None:
                    return None
                return general.send(self, route, x, dst, tag, False, timeout, seq)
        return general.send(self, route, x, dst, tag, async_op, timeout, None)

    def _p2p_route(self, op: str, x: Any) -> Route:
        """The route of a send or receive of `x` (kept per array signature)."""
        kx = key_of(x)
        key = None if kx is None else (op, kx)
        route = self._routes.get(key) if key is not None else None
        if route is None:
            route = self._route(key, op, as_buffer(x, f"{op}: x"), no_general)
        return route

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
        if self._aborted is not None or self._closed:
            self._check_open()
        anywhere = src == ANY_SOURCE and isinstance(src, (int, np.integer))
        if anywhere:
            src = ANY_SOURCE
        else:
            src = self._root(src, "recv: src") if src.__class__ is not int else src
            if not 0 <= src < self.size:
                self._root(src, "recv: src")
        if tag.__class__ is not int or not 0 <= tag <= self._tag_ub:
            tag = self._tag(tag, "recv")
        if self._group is not None:
            queued = grouping.queue(self, "recv", x, src, tag, async_op, timeout)
            return queued if queued is not None else src
        route = self._p2p_route("recv", x)
        if anywhere:
            if not route.transport.any_source:
                xb = as_buffer(x, "recv: x")
                memory = "device" if xb.on_device else "host"
                raise InvalidArgument(
                    f"recv from ANY_SOURCE: group '{self.name}' receives {memory} buffers of "
                    f"{xb.nbytes} bytes over the '{route.transport.name}' transport, which "
                    "needs the sender's rank; name it (src=rank), or run the group on the mpi "
                    "transport (HETCOMM_TRANSPORT=mpi), which receives from any source"
                )
            return general.recv(self, route, x, src, tag, async_op, timeout, None)
        if async_op and route.start is not None:
            xh = host_view(x, True)
            if xh is not None:
                return self._start_p2p(route, x, xh, src, tag, timeout)
        if route.run is not None and not async_op and not _work.observing:
            xh = route.view(x, True)
            if xh is not None:
                seq = self._run_p2p(route, xh, src, tag, timeout)
                if seq is None:
                    return src
                return general.recv(self, route, x, src, tag, False, timeout, seq)
        return general.recv(self, route, x, src, tag, async_op, timeout, None)

    def group(self) -> Group:
        """`with comm.group():` queues the sends and receives made inside the block and starts
        them together when it ends (receives first), as ncclGroupStart/End and torch's
        batch_isend_irecv do, so that rings and halo exchanges cannot deadlock. Each call is
        validated where it is made; a blocking one returns at once and is complete when the
        block ends, an asynchronous one returns a Work that completes after the block. Only
        point-to-point calls may be made inside; an exception inside the block drops the queued
        calls, none of which has moved a byte."""
        return Group(self)

    def sendrecv(
        self,
        x: Any,
        dst: int,
        out: Any,
        src: int,
        tag: int = 0,
        *,
        recv_tag: int | None = None,
        async_op: bool = False,
        timeout: float | None = None,
    ) -> Work | None:
        """Send `x` to `dst` and receive `out` from `src` at once, as MPI_Sendrecv: the
        classic ring step (each rank sends right and receives left) cannot deadlock.
        `recv_tag` defaults to `tag`."""
        rtag = tag if recv_tag is None else recv_tag
        if not async_op:
            if grouping.exchange(self, x, dst, out, src, tag, rtag, timeout):
                return None
        else:
            started = grouping.start_exchange(self, x, dst, out, src, tag, rtag, timeout)
            if started is not None:
                return started
        with self.group():
            sent = self.send(x, dst, tag, async_op=async_op, timeout=timeout)
            got = self.recv(out, src, rtag, async_op=async_op, timeout=timeout)
        if not async_op:
            return None
        assert sent is not None and isinstance(got, Work)
        return all_of(self, [got, sent], "sendrecv")

    def _tag(self, tag: Any, what: str) -> int:
        top = self._tag_ub
        if isinstance(tag, bool) or not isinstance(tag, (int, np.integer)) or not 0 <= tag <= top:
            raise InvalidArgument(f"{what}: expected a tag in [0, {top}], got {tag!r}")
        return int(tag)
