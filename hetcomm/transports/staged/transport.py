"""Staged transport (CPU-forwarding): chunks through pinned host memory, striped over rails."""

from __future__ import annotations

import atexit
import collections
import contextlib
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from mpi4py import MPI

from ...errors import CommTimeout, HetcommError, PeerLost, TransportUnavailable
from ...ops import ReduceOp
from ...work import Work, take_blocking
from .. import hostcoll
from ..base import Context, Transport
from ..local import Region
from . import links, p2p, prepared, pull, starts
from .channel import Channel
from .connect import Opener
from .cts import CTS_COLL, ClearToSend
from .eager import EAGER_BYTES, EAGER_SLOTS
from .messages import Messages
from .ops import _STOP, PeerTimeout, _Drivers, _Op, stamp
from .rails import MpiRail
from .schedule import rail_key

if TYPE_CHECKING:
    from ...arrays import Buffer
    from ...topology import Topology

log = logging.getLogger("hetcomm")

# Chunk size and slots per shared segment: measured on the H200 (docs/BENCHMARKS.md). Values
# that `hetcomm tune` measured for the job's topology replace them; both can also be changed
# per transport through `StagedTransport.chunk_bytes` / `.slots` before its first operation.
CHUNK_BYTES = 8 << 20
SLOTS = 8
# A send over shm copies up to this many of its first chunks into free shared slots at once,
# before the receiver's clear-to-send comes; a channel's sends waiting for theirs hold at most
# half its slots, so the sends already cleared always have slots to go on with. On the H200 a
# 256 MiB send/recv took 1-3% less time so (docs/BENCHMARKS.md).
EARLY_CHUNKS = 4


class StagedTransport(Transport):
    """CPU-forwarding: device -> pinned host -> rails -> pinned host -> device, chunk by chunk.

    A receive posts a clear-to-send (over the shm rail's socket, else MPI) naming its op id;
    the sender then streams its chunks over every rail to that peer at once, each rail taking
    the next chunk when it is free, so that faster rails carry more. Collectives are rings of
    these messages.

    The message itself (posting, starting and finishing it) is `messages` (messages.py).
    What it holds, and which thread owns it: `_channels` (opened by the calling or a driver
    thread under the peer's lock, then read by all), `receives` (receives in flight by op id:
    added and removed by the thread that runs the receive, read by the channels' readers and
    the mpi rail), `cts` (the clear-to-send bookkeeping, shared with the channels, its own
    lock), `mpi_rail` (its own thread), `gpu` (made by the first operation on device memory,
    before any thread uses it), `stats` (bytes per rail, added by the sender threads under
    `_stats_lock`).
    """

    name: ClassVar[str] = "staged"
    memory: ClassVar[tuple[str, ...]] = ("host", "device")

    def __init__(self, comm: Context) -> None:
        super().__init__(comm)
        self.rank, self.size = comm.rank, comm.size
        self.svc: MPI.Intracomm = comm.service
        tuned = comm.config.tuned
        self.chunk_bytes = CHUNK_BYTES if tuned is None else tuned.chunk_bytes
        self.slots = SLOTS if tuned is None else tuned.slots
        self.early_chunks = EARLY_CHUNKS
        # eager messages between ranks of one host (eager.py); set before a channel opens
        self.eager_bytes, self.eager_slots = EAGER_BYTES, EAGER_SLOTS
        # larger host messages between them read by the receiver from the sender's array
        # where the pair can (pull.py); False sends them over the rails. Set before a
        # channel opens
        self.single_copy = True
        self.rail_weights: dict[str, float] = {} if tuned is None else dict(tuned.rail_weights)
        self.timeout = comm.config.timeout
        self.mode, addrs = _rail_addresses(comm)
        self.token = links.new_token()
        self.listener = links.Listener(addrs, self.token, self.rank)
        info = comm.topology[self.rank]
        self.card = {
            "rank": self.rank,
            "host": info.host,
            "node": info.node,
            "addrs": addrs,
            "prefixes": {n.ipv4: n.prefixlen for n in info.nics},
            "ports": self.listener.ports,
            "unix": self.listener.unix_name,
            "token": self.token,
        }
        self._channels: dict[int, Channel] = {}
        # per peer, the order of the sends that take the pair's ring slots (EagerOut.ticket):
        # drawn by each send where it is made, also before the channel opens
        self._tickets: dict[int, Iterator[int]] = {}
        # per peer whose channel is not open yet, what is to run once it is (`when_open`)
        self._on_open: dict[int, list[Callable[[Channel], object]]] = {}
        self._on_open_lock = threading.Lock()
        self._lock = threading.Lock()  # the p2p message counts
        self._opener = Opener(self)
        self.receives: dict[int, _Op] = {}
        self._op_ids = itertools.count(1)
        self.messages = Messages(self)
        self.cts = ClearToSend(self.rank, self.svc, self._channels, self.messages.queue_send)
        self.mpi_rail = MpiRail(self)
        self._p2p_counts: dict[tuple[str, int, int], itertools.count[int]] = {}
        self._driver = _Drivers(4, f"hetcomm-staged-{self.rank}")
        self.closed = False
        self.gpu: Any = None
        self._one_gpu = comm.topology.share_one_device()  # see reduces_arrays
        self.stats: dict[str, int] = {}
        self._stats_lock = threading.Lock()
        self._counting = threading.local()  # .info: the trace facts of the op a driver runs
        # which path served each message and operation body (for tests and the benchmark);
        # added to by whichever thread runs it, so an approximate count under contention
        self.paths: collections.Counter[str] = collections.Counter()
        self.watcher = pull.Watcher(self, self._progress)
        _LIVE.add(self)

    @classmethod
    def unavailable(cls, topology: Topology) -> str | None:
        """Always None: host memory always works; device memory needs cupy (checked per call)."""
        return None  # host memory always works; device memory needs cupy (checked per call)

    # ---- channels (connect.py) ----------------------------------------------------------

    def tickets(self, peer: int) -> Iterator[int]:
        """The ticket counter of the sends to `peer` (shared by its ring, once it opens)."""
        drawn = self._tickets.get(peer)
        if drawn is None:
            drawn = self._tickets.setdefault(peer, itertools.count())
        return drawn

    def when_open(self, peer: int, fn: Callable[[Channel], object]) -> None:
        """`fn(channel)` once the channel to `peer` is open: here if it is, else on the thread
        that opens it, right after (receives made before it opened are posted so at once, and
        in the order they were made, whichever operation opens it)."""
        with self._on_open_lock:
            ch = self._channels.get(peer)
            if ch is None:
                self._on_open.setdefault(peer, []).append(fn)
                return
        fn(ch)

    def opened(self, peer: int) -> None:
        """The channel to `peer` has opened: run what waited for it (`when_open`)."""
        with self._on_open_lock:
            waiting = self._on_open.pop(peer, [])
        ch = self._channels[peer]
        for fn in waiting:
            fn(ch)

    def channel(self, peer: int, deadline: float) -> Channel:
        """The channel to `peer`, opened on first use (both ranks reach this together)."""
        return self._opener.open([peer], deadline)[0]

    def channels(self, peers: list[int], deadline: float) -> list[Channel]:
        """Channels to `peers`, the missing ones opened together (connect.Opener.open)."""
        return self._opener.open(peers, deadline)

    # ---- operations --------------------------------------------------------------------------

    def count_bytes(self, link: links.Link | None, n: int) -> None:
        """Add `n` bytes sent to the statistics of `link`'s rail (None: the mpi rail)."""
        name = "mpi" if link is None else str(link.spec)
        with self._stats_lock:
            self.stats[name] = self.stats.get(name, 0) + n

    def bytes_per_rail(self) -> dict[str, int]:
        """Bytes sent so far per rail (`stats`), keyed by rail_key: the same names on every run."""
        names = {str(s): rail_key(s) for ch in self._channels.values() for s in ch.specs}
        with self._stats_lock:
            per: dict[str, int] = {}
            for name, n in self.stats.items():
                key = names.get(name, name)
                per[key] = per.get(key, 0) + n
        return per

    def _region(self, buf: Buffer) -> Region:
        if buf.host is not None:
            return Region(buf.nbytes, buf.host.view(np.uint8).reshape(-1))
        return Region(buf.nbytes, None, buf.ptr)

    def _run(
        self,
        op: str,
        seq: int,
        bufs: list[Buffer],
        body: Callable[[float, Any], None],
        reduce_op: ReduceOp | None = None,
        nbytes: int | None = None,
        ready: Any = None,
    ) -> Work:
        """Start `body(deadline, ready)` on a driver thread, the Work completing with it; a
        blocking call's (hetcomm.work.take_blocking) runs here instead, to its end.

        Its `info` (for the trace) counts as stages the chunks this rank sends and receives
        over rails; `nbytes` is the operation's size (default: the first buffer's); `ready`:
        the device event the body waits for (default: the caller's stream for `bufs`).
        """
        blocking = take_blocking()
        if ready is None:
            ready = self._ready(bufs, reduce_op)
        size = bufs[0].nbytes if nbytes is None else nbytes
        if blocking:
            return self._inline(op, seq, size, lambda deadline: body(deadline, ready))
        start = getattr(body, "start", None)  # collectives.py's segment bodies have one
        posted = start() if start is not None else None
        if posted is not None:
            return self._started(op, seq, size, posted)
        return self._on_driver(op, seq, size, body, ready)

    def _on_driver(
        self, op: str, seq: int, size: int, body: Callable[[float, Any], None], ready: Any
    ) -> Work:
        """`body(deadline, ready)` started on a driver thread, the Work completing with it."""
        self.paths["driver"] += 1
        deadline = time.monotonic() + self.timeout
        info = {"transport": "staged", "bytes": size, "stages": 0}

        def task(by: float) -> None:
            self._counting.info = info
            try:
                body(by, ready)
            except PeerTimeout as exc:
                raise CommTimeout(
                    self.comm.name, op, seq, self.timeout, exc.ranks, str(exc)
                ) from None
            finally:
                self._counting.info = None

        job = self._driver.submit(task, deadline)
        # a thread that waits before a driver took the body runs it itself (Work.drive), as
        # a blocking call would; else it sleeps until the driver ends the body: no spinning
        # while the transport's own threads need the interpreter
        work = Work(
            self.comm,
            op,
            seq,
            job.is_set,
            [job.check],
            waiter=job.wait,
            drive=job.run_here,
            signal=job,
        )
        work.info = info
        return work

    def _started(self, op: str, seq: int, nbytes: int, posted: hostcoll.Posted) -> Work:
        """The Work of an asynchronous collective begun on the issuing thread in the shared
        segment (HostGroup.start): its input is in and this rank has arrived; it ends once
        every rank has, with this rank's reads, made by a poll (test(), the torch layer's
        progress thread), the thread that waits (Work.drive), or the segment's next
        operation, whichever comes first. No driver thread takes part."""
        self.paths["issuing thread"] += 1
        name = self.comm.name
        bound = time.monotonic() + self.timeout  # as a driver's body is bounded

        def drive(deadline: float) -> bool:
            try:
                posted.complete(min(deadline, bound))
            except hostcoll.Late as exc:
                ranks = exc.ranks or None
                raise CommTimeout(name, op, seq, self.timeout, ranks, str(exc)) from None
            except hostcoll.Dead as exc:
                raise PeerLost(f"group '{name}': {op} #{seq}: {exc}", exc.ranks) from None
            return True

        work = Work(self.comm, op, seq, posted.poll, drive=drive)
        work.info = {"transport": "staged", "bytes": nbytes, "stages": 0}
        return work

    def _count(self, chunks: int) -> None:
        """Add `chunks` to the stages of the operation that this driver thread runs."""
        info = getattr(self._counting, "info", None)
        if info is not None:
            info["stages"] += chunks

    def _device(self, bufs: list[Buffer]) -> Any:
        if not any(b.on_device for b in bufs):
            return None
        return self.staging()

    def staging(self) -> Any:
        """The transport's device side (kernels.device.StagingDevice), made at its first
        operation on device memory."""
        if self.gpu is None:
            from ...kernels import device

            why = device.unavailable()
            if why is not None:
                raise TransportUnavailable(f"staged transport on device buffers: {why}")
            self.gpu = device.StagingDevice(self.chunk_bytes, self.slots)
        return self.gpu

    def _p2p_number(self, direction: str, peer: int, tag: int) -> int:
        """The how-many-th message to or from `peer` with `tag` this is, counted when the call
        is made: message k of a sender matches receive k of its receiver, as MPI matches them,
        however the driver threads that run the bodies happen to be scheduled."""
        key = (direction, peer, tag)
        counter = self._p2p_counts.get(key)
        if counter is None:
            with self._lock:
                counter = self._p2p_counts.setdefault(key, itertools.count())
        return next(counter)  # one C call: atomic under the interpreter lock

    def _progress(self, ch: Channel) -> None:
        """Land the posted receives of `ch`'s ring whose messages are there (the Watcher)."""
        if ch.eager_in is not None:
            p2p.progress(self, ch, ch.eager_in)

    def _ready(self, bufs: list[Buffer], reduce_op: ReduceOp | None = None) -> Any:
        """On the calling thread, for device buffers: an event after the caller's queued work,
        which every copy and kernel of the operation waits for (the caller's later work is
        ordered by Work.wait() returning after every copy has finished, see docs/staged.md);
        the kernels a reduction needs are compiled first. None for host buffers."""
        gpu = self._device(bufs)
        if gpu is None:
            return None
        if reduce_op is not None:
            gpu.prepare(bufs[0].dtype, reduce_op.value)
        return gpu.ready_event(bufs[0])

    def send(self, x: Buffer, dst: int, tag: int, seq: int) -> Work:
        """Eagerly through a shared slot (a small message to a rank of this host), else chunks
        over every rail to `dst` once its clear-to-send names this message. A blocking send
        runs here to its end; an asynchronous one starts here where nothing must wait."""
        return self._message("send", x, dst, tag, seq, p2p.send, starts.send_start)

    def _message(
        self,
        op: str,
        x: Buffer,
        peer: int,
        tag: int,
        seq: int,
        run: Callable[..., None],
        start: Callable[..., Work],
    ) -> Work:
        """The general path of a send or receive (`op`) of `x`: numbered, its region and
        ready event made, then run here to its end where the call is blocking
        (`run(self, region, peer, tag, k, deadline, ready)`: p2p.send or p2p.recv), else
        started (`start(self, region, peer, tag, k, seq, ready, bufs)`: starts.send_start or
        starts.recv_start)."""
        blocking = take_blocking()
        stamp(op)
        region = self._region(x)
        k = self._p2p_number(op, peer, tag)
        ready = self._ready([x])
        stamp("ready")
        if blocking:
            return self._inline(
                op, seq, x.nbytes, lambda d: run(self, region, peer, tag, k, d, ready)
            )
        return start(self, region, peer, tag, k, seq, ready, [x])

    def recv(self, x: Buffer, src: int, tag: int, seq: int) -> Work:
        """Receive into `x` from `src` (see _recv); the Work's `source` is `src`, known ahead."""
        work = self._recv(x, src, tag, seq)
        work.source = src
        return work

    def _recv(self, x: Buffer, src: int, tag: int, seq: int) -> Work:
        """Take the eager message of this number from its shared slot, else post a
        clear-to-send to `src` and copy the chunks in as they land. A blocking receive runs
        here to its end; an asynchronous one is polled by its Work where it can be."""
        return self._message("recv", x, src, tag, seq, p2p.recv, starts.recv_start)

    # ---- prepared calls (prepared.py, segment.py) ---------------------------------------------

    def prepare(
        self,
        op: str,
        x: Buffer | None,
        out: Buffer | None,
        rop: ReduceOp | None,
        root: int,
    ) -> Callable[..., bool] | None:
        """The blocking call of one signature on host arrays, made on the calling thread with
        no Work (hetcomm.routes.Route): sends and receives (prepared.py), collectives where
        segment.py prepares them."""
        return prepared.prepare(self, op, x, out, rop, root)

    def prepare_async(
        self, op: str, x: Buffer | None, out: Buffer | None, rop: ReduceOp | None, root: int
    ) -> Callable[..., Work] | None:
        """The asynchronous start of one signature on host arrays (hetcomm.routes.Route.start):
        sends and receives (prepared.py), collectives where segment.py prepares them."""
        return prepared.prepare_async(self, op, x, out, rop, root)

    def limit(self) -> float:
        """The seconds a prepared call, issued on this thread, may take: the call's own
        timeout while it has one (the communicator's call_timeout), else the transport's."""
        return self.comm.call_timeout or self.timeout

    def _fatal(self, name: str, seq: int, exc: PeerTimeout | PeerLost) -> BaseException:
        """The error a prepared call ends with when its peer is late or gone (CommTimeout
        naming the peer, or PeerLost), the communicator aborted with it as a Work would."""
        err: BaseException = exc
        if isinstance(exc, PeerTimeout):
            err = CommTimeout(self.comm.name, name, seq, self.limit(), exc.ranks, str(exc))
        self.comm._abort(err)
        return err

    def _inline(self, name: str, seq: int, nbytes: int, fn: Callable[[float], None]) -> Work:
        """Run a blocking operation's body `fn(deadline)` on the calling thread, the driver
        threads being for asynchronous operations only; its Work is complete (or failed, with
        the body's error, CommTimeout where a peer was late) when this returns."""
        self.paths["calling thread"] += 1
        info = {"transport": "staged", "bytes": nbytes, "stages": 0}
        before = getattr(self._counting, "info", None)
        self._counting.info = info
        error: BaseException | None = None
        try:
            fn(time.monotonic() + self.timeout)
        except PeerTimeout as exc:
            error = CommTimeout(self.comm.name, name, seq, self.timeout, exc.ranks, str(exc))
        except BaseException as exc:
            error = exc
        finally:
            self._counting.info = before

        def poll() -> bool:
            if error is not None:
                raise error
            return True

        work = Work(self.comm, name, seq, poll)
        work.info = info
        return work

    def exchange(
        self,
        seq: int,
        step: int,
        send_to: int,
        out: Region | None,
        recv_from: int,
        into: Region | None,
        deadline: float,
        ready: Any,
    ) -> None:
        """One step of a collective: send `out` to one rank while receiving `into` from one."""
        rop = None
        if into is not None:
            rop = self.messages.post_recv(
                recv_from, into, CTS_COLL, seq, step, deadline, ready, driven=True
            )
        if out is not None:
            sop = self.messages.start_send(
                send_to, out, CTS_COLL, seq, step, deadline, ready, driven=True
            )
            self.messages.finish_send(sop, deadline)
        if rop is not None:
            self.messages.finish_recv(rop, deadline)

    def stages_input(self, op: str, nbytes: int) -> bool:
        """Where the shared segment takes the operation as it stands (segment.py)."""
        from . import segment

        return segment.stages_input(self, op, nbytes)

    def all_reduce(self, x: Buffer, out: Buffer, op: ReduceOp, seq: int) -> Work:
        """A ring of staged messages (see collectives.py)."""
        from . import collectives

        return self._run(
            "all_reduce", seq, [x, out], collectives.all_reduce(self, x, out, op, seq), op
        )

    @property
    def reduces_arrays(self) -> bool:
        """Where the ranks share one GPU: each array is copied between the device and its
        place in the host buffers (collectives.all_reduce_arrays)."""
        return self._one_gpu

    def ready_events(self, bufs: Sequence[Buffer]) -> list[Any]:
        """Transport.ready_events."""
        from ...kernels.device import by_stream

        gpu = self.staging()
        return [gpu.ready_event(b) for b in by_stream(bufs).values()]

    def all_reduce_arrays(
        self,
        spans: Sequence[tuple[int, int]],
        dtype: str,
        op: ReduceOp,
        seq: int,
        ready: Sequence[Any],
    ) -> Work:
        """Transport.all_reduce_arrays (collectives.all_reduce_arrays)."""
        from . import collectives

        gpu = self.staging()
        gpu.prepare(dtype, op.value)  # the rings, where they take it, reduce on the GPU
        body = collectives.all_reduce_arrays(self, list(spans), dtype, op, seq)
        total = sum(n for _, n in spans)
        return self._run(
            "all_reduce_coalesced", seq, [], body, nbytes=total, ready=gpu.after_all(ready)
        )

    def reduce(self, x: Buffer, op: ReduceOp, root: int, seq: int) -> Work:
        """Staged messages to the root (see collectives.py)."""
        from . import collectives

        return self._run("reduce", seq, [x], collectives.reduce(self, x, op, root, seq), op)

    def broadcast(self, x: Buffer, root: int, seq: int) -> Work:
        """Staged messages from the root (see collectives.py)."""
        from . import collectives

        return self._run("broadcast", seq, [x], collectives.broadcast(self, x, root, seq))

    def all_gather(self, out: Buffer, x: Buffer, seq: int) -> Work:
        """A ring of staged messages (see collectives.py)."""
        from . import collectives

        return self._run(
            "all_gather",
            seq,
            [out, x],
            collectives.all_gather(self, out, x, seq),
            nbytes=out.nbytes,
        )

    def reduce_scatter(self, out: Buffer, x: Buffer, op: ReduceOp, seq: int) -> Work:
        """A ring of staged messages (see collectives.py)."""
        from . import collectives

        return self._run(
            "reduce_scatter",
            seq,
            [out, x],
            collectives.reduce_scatter(self, out, x, op, seq),
            op,
            x.nbytes,
        )

    def all_to_all(self, out: Buffer, x: Buffer, seq: int) -> Work:
        """One staged message to and from every peer (see collectives.py)."""
        from . import collectives

        return self._run(
            "all_to_all", seq, [out, x], collectives.all_to_all(self, out, x, seq), nbytes=x.nbytes
        )

    def barrier(self, seq: int) -> Work:
        """MPI_Ibarrier on the service communicator."""
        work = Work(self.comm, "barrier", seq, self.svc.Ibarrier().Test, ())
        work.info = {"transport": "staged", "bytes": 0, "stages": 0}
        return work

    def close(self) -> None:
        """Stop the channels and rails, fail what still runs, end the driver (idempotent)."""
        if self.closed:
            return
        self.closed = self.cts.closed = True
        for ch in self._channels.values():
            ch.stop()
            for link in ch.links:
                with contextlib.suppress(links.RailError):
                    link.send(links.BYE, -1, 0, 0, 0, 0)
        self.mpi_rail.stop()
        # operations still running (a peer that never came) end now: their threads must be out
        # of MPI before the process finalizes it
        closed = HetcommError("the staged transport was closed")
        for op in list(self.receives.values()):
            op.fail(closed)
        for ch in self._channels.values():
            if ch.eager_in is not None:
                ch.eager_in.fail_posted(closed)
            if ch.eager_out is not None:
                ch.eager_out.withdraw_all()  # nobody may read our arrays once we return
        self.watcher.stop()
        for ch, op in self.cts.take_waiting():
            if op.early:
                ch.drop_early(op)  # their copies end before the segment goes
            op.fail(HetcommError("the staged transport was closed while waiting to send"))
        for ch in self._channels.values():
            ch.fail(closed)
            ch.queue.put(_STOP)  # draining took the stop signal out too
        self.cts.wake()
        self._driver.shutdown(wait_s=2.0)
        for ch in self._channels.values():
            for t in ch.threads:
                t.join(timeout=2)
            ch.release()
        self.listener.close()
        from . import segment

        segment.close_segment(self)  # before the GPU goes: its pages are registered there
        if self.gpu is not None:
            self.gpu.close()


# Transports not closed by their communicator are closed when the interpreter exits, before
# mpi4py's own exit hook finalizes MPI: their threads must have left MPI by then.
_LIVE: weakref.WeakSet[StagedTransport] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for transport in list(_LIVE):
        with contextlib.suppress(Exception):
            transport.close()


def _rail_addresses(comm: Any) -> tuple[str, list[str]]:
    """('auto' | 'mpi' | 'list', the IPv4 addresses this rank listens on)."""
    from ...nics import parse_rails, shared_subnet_warnings

    spec = comm.config.rails.strip()
    if spec.lower() == "mpi":
        return "mpi", []
    nics = comm.topology[comm.rank].nics
    if spec.lower() == "auto":
        return "auto", ["127.0.0.1", *[n.ipv4 for n in nics]]
    chosen = parse_rails(spec, list(nics))
    for warning in shared_subnet_warnings(chosen):
        log.warning("HETCOMM_RAILS: %s", warning)
    return "list", [n.ipv4 for n in chosen]
