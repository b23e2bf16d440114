"""The direct transport's prepared sends and receives (hetcomm.routes.Route.run): a blocking
send or receive of device memory, run start to end on the calling thread while the proxy has
nothing queued or in flight, with no Buffer, Task or Work per call.

It exchanges the messages the proxy's path does (DirectTransport._copier and _lender), through
the same mailbox (mailbox.py): the lending side's buffer record, then the copying side's "done"
with the size it copied, under the same keys and in the same order, so that either rank of a
pair may take either path. What
differs is where the work runs: the copy goes on the caller's stream itself (ordered after what
the caller queued there, with no event between two streams), a buffer's record is made once per
address and allocation, and every wait is a poll on this thread, bounded by the call's timeout.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
from mpi4py import MPI

from ...work import BusyPoll, wait_for
from . import schedule
from .proxy import stamp

if TYPE_CHECKING:
    from ...arrays import Buffer
    from .transport import DirectTransport

D2D = 3  # cudaMemcpyDeviceToDevice
# polls of a step before it goes to the bounded wait (which builds a Work to wait with)
_QUICK = 64


class PreparedP2P:
    """The prepared blocking sends and receives of one DirectTransport."""

    def __init__(self, t: DirectTransport) -> None:
        self.t = t
        self.svc: MPI.Intracomm = t.svc
        self.rt = t.cupy.cuda.runtime
        self._event: Any = None  # the copy's (or the caller's stream's) end, reused

    def prepare(self, op: str, x: Buffer | None) -> Callable[..., bool] | None:
        """The prepared call of a send or receive of `x`'s signature: `run(ptr, peer, tag,
        seq)` with `ptr` the array's device address (routes.device_view). None where the
        general path takes every call: host or empty arrays, another device (whose error the
        general path gives), array types whose current stream is not known here."""
        from ...kernels.device import stream_reader

        t = self.t
        if op not in ("send", "recv") or x is None or not x.on_device or not x.count:
            return None
        if x.device_index != t.device:
            return None
        stream = stream_reader(x.kind, x.device_index)
        if stream is None:
            return None
        return partial(self._run, op, x.nbytes, stream, x.describe())

    def prepare_pair(self, x: Buffer | None, out: Buffer | None) -> Callable[..., bool] | None:
        """The prepared sendrecv of two device arrays of one library on this device:
        `run(xptr, dst, tag, optr, src, recv_tag, seq)` (grouping.exchange). None where the
        group block takes every call (host or empty arrays, another device, two libraries'
        streams)."""
        from ...kernels.device import stream_reader

        t = self.t
        if x is None or out is None or not (x.on_device and out.on_device):
            return None
        if not (x.count and out.count) or x.kind != out.kind:
            return None
        if x.device_index != t.device or out.device_index != t.device:
            return None
        stream = stream_reader(x.kind, x.device_index)
        if stream is None:
            return None
        return partial(self._exchange, x.nbytes, out.nbytes, stream, x.describe(), out.describe())

    def _exchange(
        self,
        nx: int,
        no: int,
        stream: Callable[[], int],
        wx: str,
        wo: str,
        xptr: int,
        dst: int,
        tag: int,
        optr: int,
        src: int,
        recv_tag: int,
        seq: int,
    ) -> bool:
        """A sendrecv on the calling thread: each direction's messages as _copy's and _lend's
        (the same keys and order, so the peers may take either path), every lend and receive
        posted before any is waited for, so that a ring of exchanges cannot wait on itself. A
        lending side waits for the caller's stream first (its buffer is read or written by the
        peer); a copying side queues its copy on that stream once the peer's record is in,
        and says "done" once it has run. False (nothing moved) where _run would decline."""
        t = self.t
        if dst == t.rank or src == t.rank or self.rt.getDevice() != t.device:
            return False
        copies_send = schedule.copier(t.rank, dst, t._devices) == t.rank
        copies_recv = schedule.copier(src, t.rank, t._devices) == t.rank
        skey = t._key(tag, "send", copies_send)
        rkey = t._key(recv_tag, "recv", not copies_recv)
        proxy = t._proxy
        if not proxy.claim():
            return False
        try:
            s = t.device_kernels.external_stream(stream(), t.device)
            if not (copies_send and copies_recv) and not s.done:
                self.reach(s, "sendrecv", seq)
            post = t.post
            # per direction: (copies, peer, key, our address, our bytes, what, index)
            sides = (
                (copies_send, dst, skey, xptr, nx, wx, 0),
                (copies_recv, src, rkey, optr, no, wo, 1),
            )
            posted: list[Any] = [None, None]  # each direction's lend or receive
            for copies, peer, key, ptr, n, _, i in sides:
                if copies:
                    posted[i] = post.expect(peer, key)
                else:
                    posted[i] = self._lend_record(post, peer, key, ptr, n, "sendrecv", seq)
            records = [posted[i] for copies, *_, i in sides if copies]
            self.wait(partial(_all_in, records), "sendrecv", seq)
            wrong, answers = [], []
            for copies, peer, _, ptr, n, what, i in sides:
                if not copies:
                    continue
                got = posted[i].got
                theirs = int(got.view(np.uint64)[2])  # the record's nbytes
                if theirs == n:
                    mapped, _ = t.peers.address(peer, got)
                    to, fro = (mapped, ptr) if i == 0 else (ptr, mapped)
                    self.rt.memcpyAsync(to, fro, n, D2D, s.ptr)
                else:
                    t.peers.learn(peer, got[0])  # its handle may come only this once
                    wrong.append((i, peer, theirs, n, what))
            if records:
                self.reach(s, "sendrecv", seq)  # the copies have run
            for copies, peer, _, _, n, _, i in sides:
                if copies:
                    answers.append(post.done(peer, posted[i], n))
            lends = [posted[i] for copies, *_, i in sides if not copies]
            self.wait(partial(_all_in, lends + answers), "sendrecv", seq)
        finally:
            proxy.release()
        for copies, peer, _, _, n, what, i in sides:
            if not copies and posted[i].copied != n:
                wrong.append((i, peer, int(posted[i].copied), n, what))
        if wrong:
            i, peer, theirs, n, what = wrong[0]
            raise t._mismatch("send" if i == 0 else "recv", peer, theirs, n, what)
        return True

    def _run(
        self,
        op: str,
        nbytes: int,
        stream: Callable[[], int],
        what: str,
        ptr: int,
        peer: int,
        tag: int,
        seq: int,
    ) -> bool:
        """One call: False (nothing moved) where the general path must take it: a peer that is
        this rank (the general path says why), another device current on this thread, or the
        proxy busy with operations issued before (they go first, in issue order)."""
        t = self.t
        if peer == t.rank:
            return False
        src, dst = (t.rank, peer) if op == "send" else (peer, t.rank)
        copier = schedule.copier(src, dst, t._devices) == t.rank
        key = t._key(tag, op, (op == "send") == copier)
        if self.rt.getDevice() != t.device:
            return False
        proxy = t._proxy
        if not proxy.claim():
            return False
        try:
            stamp("prepared")
            s = t.device_kernels.external_stream(stream(), t.device)
            if copier:
                self._copy(op, nbytes, what, s, ptr, peer, key, seq)
            else:
                self._lend(op, nbytes, what, s, ptr, peer, key, seq)
        finally:
            proxy.release()
        return True

    def _copy(
        self,
        op: str,
        nbytes: int,
        what: str,
        s: Any,
        ptr: int,
        peer: int,
        key: int,
        seq: int,
    ) -> None:
        """The copying side: the peer's record, the copy on the caller's stream, its end, then
        "done" with the size copied (the peer's buffer is free once it reads that)."""
        t = self.t
        e = t.post.expect(peer, key)
        self.wait(e.Test, op, seq)
        got = e.got
        theirs = int(got.view(np.uint64)[2])  # the record's nbytes
        if theirs == nbytes:
            mapped, _ = t.peers.address(peer, got)
            stamp("resolved")
            dst, src = (mapped, ptr) if op == "send" else (ptr, mapped)
            self.rt.memcpyAsync(dst, src, nbytes, D2D, s.ptr)
            stamp("copy queued")
            self.reach(s, op, seq)
        else:
            t.peers.learn(peer, got[0])  # its handle may come only this once
        answer = t.post.done(peer, e, nbytes)
        if answer is not None:
            self.wait(answer.Test, op, seq)
        if theirs != nbytes:
            raise t._mismatch(op, peer, theirs, nbytes, what)

    def _lend(
        self,
        op: str,
        nbytes: int,
        what: str,
        s: Any,
        ptr: int,
        peer: int,
        key: int,
        seq: int,
    ) -> None:
        """The lending side: once the caller's stream has run what it queued before the call,
        the buffer's record is lent to the peer, and the call ends with the peer's "done"."""
        if not s.done:
            self.reach(s, op, seq)
        stamp("ready")
        lend = self._lend_record(self.t.post, peer, key, ptr, nbytes, op, seq)
        self.wait(lend.Test, op, seq)
        if lend.copied != nbytes:
            raise self.t._mismatch(op, peer, int(lend.copied), nbytes, what)

    def _lend_record(
        self, post: Any, peer: int, key: int, ptr: int, nbytes: int, op: str, seq: int
    ) -> Any:
        """Lend the record of `nbytes` at `ptr` to `peer`. A prepared call runs while the proxy
        has nothing in flight, so every earlier lend of this rank was taken and answered and
        the mailbox has room; the bounded wait for it is there should that ever not hold."""
        rec = self.t.described.one(ptr, nbytes)
        lend = post.lend(peer, key, rec)
        while lend is None:
            self.wait(post.room(peer).Test, op, seq)
            lend = post.lend(peer, key, rec)
        return lend

    def reach(self, s: Any, op: str, seq: int) -> None:
        """Wait here until stream `s` has run what is queued on it now (an event recorded
        there, polled)."""
        event = self._event
        if event is None:
            event = self._event = self.t.cupy.cuda.Event(disable_timing=True)
        event.record(s)
        self.wait(partial(getattr, event, "done"), op, seq)

    def wait(self, poll: Callable[[], Any], op: str, seq: int) -> None:
        """Wait here for `poll`: a few polls, then the bounded wait (the call's timeout)."""
        for _ in range(_QUICK):
            if poll():
                return
        busy = BusyPoll(poll)
        wait_for(self.t.comm, op, seq, busy, self.t.comm.call_timeout, busy.wait)


def _all_in(waits: list[Any]) -> bool:
    """Whether every one of `waits` (lends, receives, MPI requests; None: nothing) is over;
    each is tested, so that every MPI request progresses."""
    return all([w is None or w.Test() for w in waits])
