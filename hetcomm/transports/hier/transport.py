"""Hier transport: collectives across vendor islands, native inside each island, shards between."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from ... import plan as planning
from ...arrays import Buffer, storage_dtype
from ...errors import CommAborted, CommTimeout, HetcommError
from ...ops import ReduceOp
from ...work import Work, completed
from .. import local, tags
from ..base import Context, Transport
from ..local import Region
from ..worker import InOrderWorker
from .schedule import (
    all_reduce_schedule,
    block_schedule,
    broadcast_entries,
    locate,
)

if TYPE_CHECKING:
    from ...comm import Communicator
    from ...config import Config
    from ...topology import Topology

log = logging.getLogger("hetcomm")

# the parts of a hier transport plan for themselves but may never choose hier again
EXCLUDED = {"hier": "inside a hier transport"}


def _tag(offset: int) -> int:
    return tags.HIER + offset % tags.HIER_SPAN


_MAX_SLEEP_S = 200e-6


class _Ctx:
    """What an operation's body needs: its name, its deadline, where its scratch memory lives."""

    def __init__(self, name: str, seq: int, deadline: float, mem: _Memory) -> None:
        self.name, self.seq, self.deadline, self.mem = name, seq, deadline, mem


class _Parts:
    """The communicators a hier transport runs its collectives on (see docs/hier.md)."""

    def __init__(self, comm: Context, islands: list[tuple[int, ...]], index: int) -> None:
        from ...comm import Communicator

        svc = comm.service  # collectives on it are issued only in program order
        _all_arrived(comm, svc)
        name = f"{comm.name}/island{index}"
        island_mpi: Any = svc.Split(index, comm.rank)
        self.island = Communicator(
            island_mpi,
            _part_config(comm.config, name),
            comm.topology.subset(islands[index]),
            name,
            exclude=EXCLUDED,
        )
        # islands exchange shards over `cross`; the collectives hier hands on whole go to
        # `flat`: neither shares a message space with the caller's own send/recv
        self.cross, self.flat = (
            Communicator(
                svc.Dup(),
                _part_config(comm.config, f"{comm.name}/{what}"),
                comm.topology,
                f"{comm.name}/{what}",
                exclude=EXCLUDED,
            )
            for what in ("cross", "flat")
        )

    def all(self) -> tuple[Communicator, ...]:
        return self.island, self.cross, self.flat


class HierTransport(Transport):
    """Collectives across islands (members of one host and vendor): reduce-scatter inside each
    island with its own transport, partial shards exchanged between islands by every member at
    once, all-gather inside the island. reduce, all_to_all and barrier go to a flat communicator
    of the same members, send and recv to the group's own point-to-point transport (neither on
    hier)."""

    name: ClassVar[str] = "hier"
    memory: ClassVar[tuple[str, ...]] = ("host", "device")

    def __init__(self, comm: Context) -> None:
        # nothing collective here: the first operation routed to hier may be a send, which
        # only two ranks make; the parts wait for the first collective
        super().__init__(comm)
        self.rank, self.size = comm.rank, comm.size
        self.islands = planning.islands(comm.topology.members())
        self.index, self.local = locate(self.islands, self.rank)
        self.timeout = comm.config.timeout
        self._parts: _Parts | None = None
        self._stopping = threading.Event()
        self._worker: InOrderWorker | None = None
        self._gpu: Any = None
        self._host = _HostMemory()
        self._closed = False
        self._abandoned = False  # an operation gave up with parts' operations still in flight

    def _refusal(self) -> BaseException | None:
        """Closed before a queued operation started: start nothing that could not be waited for."""
        if self._stopping.is_set():
            return CommAborted("the hier transport was closed before this operation ran")
        return None

    def _setup(self) -> _Parts:
        """The parts, made by the first collective (on every rank, in program order)."""
        if self._parts is None:
            self._parts = _Parts(self.comm, self.islands, self.index)
            log.info(
                "hier: group '%s' islands %s; rank %d is member %d of island %d",
                self.comm.name,
                [list(i) for i in self.islands],
                self.rank,
                self.local,
                self.index,
            )
        return self._parts

    @property
    def island(self) -> Communicator:
        """This rank's island (made by the first collective)."""
        return self._made().island

    @property
    def cross(self) -> Communicator:
        """The whole group, for the shards exchanged between islands."""
        return self._made().cross

    @property
    def flat(self) -> Communicator:
        """The whole group, for the collectives hier hands on whole."""
        return self._made().flat

    def _made(self) -> _Parts:
        if self._parts is None:
            raise HetcommError(
                f"group '{self.comm.name}': the hier transport's parts are made "
                "by its first collective, and none has run yet"
            )
        return self._parts

    @classmethod
    def unavailable(cls, topology: Topology) -> str | None:
        """Always None: the parts' plans decide what moves the bytes."""
        return None  # it composes the other transports: the parts' plans say what moves bytes

    # ---- running operations ------------------------------------------------------------------

    def _submit(self, op: str, seq: int, bufs: list[Buffer], body: Callable[[_Ctx], None]) -> Work:
        """Queue `body` on the worker thread; the Work completes when it has run."""
        device = next((b for b in bufs if b.on_device), None)
        mem = self._host if device is None else self._device_memory(device)
        ready = mem.ready(device) if device is not None else None

        def run() -> None:
            deadline = time.monotonic() + self.timeout
            mem.enter(ready)
            body(_Ctx(op, seq, deadline, mem))

        if self._worker is None:
            self._worker = InOrderWorker(f"hetcomm-hier-{self.rank}", self._refusal)
        with self._worker.lock:
            job = self._worker.submit(run)
        work = Work(self.comm, op, seq, job.is_set, [job.check], waiter=job.wait, signal=job)
        work.info = {
            "transport": self.name,
            "bytes": max(b.nbytes for b in bufs),
            "islands": len(self.islands),
        }
        return work

    def _device_memory(self, like: Buffer) -> _Memory:
        if self._gpu is None:
            from ...errors import TransportUnavailable
            from ...kernels import device

            why = device.unavailable()
            if why is not None:
                raise TransportUnavailable(f"hier transport on device buffers: {why}")
            self._gpu = device.StagingDevice(1 << 20, 2)
        return _DeviceMemory(self._gpu, like)

    def _wait(self, works: list[Work], ctx: _Ctx) -> None:
        """Wait for the parts' operations, until the deadline or until the group is aborted or
        this transport closed."""
        for w in works:
            sleep = 10e-6
            while not w.test():
                if self._stopping.is_set() or self.comm._aborted is not None:
                    self._abandoned = True
                    raise CommAborted(
                        f"communicator '{self.comm.name}' was aborted or closed "
                        f"during {ctx.name} #{ctx.seq}"
                    )
                left = ctx.deadline - time.monotonic()
                if left <= 0:
                    self._abandoned = True
                    # the group's arrivals table: the hier collective entered it on every rank
                    late, detail = self.comm.late(ctx.name, ctx.seq)
                    where = f"waiting for {w.op} on group '{w._comm.name}'"
                    raise CommTimeout(
                        self.comm.name,
                        ctx.name,
                        ctx.seq,
                        self.timeout,
                        late,
                        f"{where}; {detail}" if detail else where,
                    )
                if w._waiter is not None:
                    w._waiter(min(left, 0.05))
                else:
                    # MPI moves a non-blocking operation on only inside Test: short sleeps keep
                    # a step of a small operation from waiting out a long one
                    time.sleep(min(sleep, left))
                    sleep = min(2 * sleep, _MAX_SLEEP_S)

    def _part_op(
        self, part: Communicator, op: str, buf: Buffer, start: Callable[[Transport, int], Work]
    ) -> Work:
        transport, seq = part._start(op, buf)
        return start(transport, seq)

    def _in_island(
        self, ctx: _Ctx, op: str, buf: Buffer, start: Callable[[Transport, int], Work]
    ) -> None:
        """Run one collective of the island's communicator to its end."""
        self._wait([self._part_op(self.island, op, buf, start)], ctx)

    def _route(self, peer: int) -> tuple[Communicator, int]:
        """The part that reaches group rank `peer`, and peer's rank there."""
        members = self.islands[self.index]
        if peer in members:
            return self.island, members.index(peer)
        return self.cross, peer

    def _send(self, buf: Buffer, peer: int, tag: int = tags.HIER) -> Work:
        part, dst = self._route(peer)
        return self._part_op(part, "send", buf, lambda t, s: t.send(buf, dst, tag, s))

    def _recv(self, buf: Buffer, peer: int, tag: int = tags.HIER) -> Work:
        part, src = self._route(peer)
        return self._part_op(part, "recv", buf, lambda t, s: t.recv(buf, src, tag, s))

    # ---- the collectives hier shapes itself ----------------------------------------------------

    def all_reduce(self, x: Buffer, out: Buffer, op: ReduceOp, seq: int) -> Work:
        """Reduce-scatter inside islands, exchange shards between them, all-gather inside."""
        self._setup()
        if x.count == 0:
            return completed(self.comm, "all_reduce", seq)
        return self._submit(
            "all_reduce", seq, [x, out], lambda ctx: self._all_reduce(ctx, x, out, op)
        )

    def _all_reduce(self, ctx: _Ctx, x: Buffer, out: Buffer, op: ReduceOp) -> None:
        mem, count = ctx.mem, x.count
        sch = all_reduce_schedule(self.islands, count, self.rank)
        part_op = ReduceOp.SUM if op is ReduceOp.AVG else op
        n, c = sch.island_size, sch.shard
        padded: Buffer | None = None
        # 1. reduce-scatter inside the island: this rank's shard holds the island's partial
        if n == 1:
            if out is not x:
                mem.copy(out, x)
            shard = out
        else:
            src = x
            if n * c != count:
                src = padded = mem.empty(n * c, x, "padded")
                mem.copy(_sub(padded, 0, count), x)
                mem.zero(_sub(padded, count, n * c - count))
            shard = mem.empty(c, x, "shard")
            self._in_island(
                ctx, "reduce_scatter", src, lambda t, s: t.reduce_scatter(shard, src, part_op, s)
            )
        # 2. every other island's partial of this shard, from the ranks whose shards overlap it
        width = sch.stop - sch.start
        mine = _sub(shard, 0, width)
        if width:
            k = len(self.islands)
            rows = mem.empty(k * width, x, "rows")
            works = [
                self._recv(
                    _sub(rows, t.island * width + t.start - sch.start, t.stop - t.start),
                    t.peer,
                    _tag(t.start),
                )
                for t in sch.exchanges
            ]
            works += [
                self._send(_sub(mine, t.start - sch.start, t.stop - t.start), t.peer, _tag(t.start))
                for t in sch.exchanges
            ]
            self._wait(works, ctx)
            # 3. reduce the partials in island order: every island's owner of an element folds
            # the same values in the same order, so every rank ends with the same bits
            acc = mine if sch.island == 0 else _sub(rows, 0, width)
            for i in range(1, k):
                row = mine if i == sch.island else _sub(rows, i * width, width)
                mem.combine(acc, row, x.dtype, part_op)
            if acc is not mine:
                mem.copy(mine, acc)
            if op is ReduceOp.AVG:
                mem.divide(mine, self.size, x.dtype)
        # 4. all-gather the reduced shards inside the island
        if n > 1:
            dst = out if padded is None else padded
            self._in_island(ctx, "all_gather", shard, lambda t, s: t.all_gather(dst, shard, s))
            if dst is not out:
                mem.copy(out, _sub(dst, 0, count))

    def reduce_scatter(self, out: Buffer, x: Buffer, op: ReduceOp, seq: int) -> Work:
        """Reduce-scatter inside islands, then the shards exchanged between islands."""
        self._setup()
        if out.count == 0:
            return completed(self.comm, "reduce_scatter", seq)
        return self._submit(
            "reduce_scatter", seq, [out, x], lambda ctx: self._reduce_scatter(ctx, out, x, op)
        )

    def _reduce_scatter(self, ctx: _Ctx, out: Buffer, x: Buffer, op: ReduceOp) -> None:
        mem, block = ctx.mem, out.count
        sch = block_schedule(self.islands, block, self.rank)
        part_op = ReduceOp.SUM if op is ReduceOp.AVG else op
        n, size = sch.island_size, sch.chunk
        # 1. every island's blocks sharded over this island's members, reduced inside it
        scratch = mem.empty(n * size, x, "scratch")
        mem.zero(scratch)
        for at, pos, count in sch.layout:
            mem.copy(_sub(scratch, at, count), _sub(x, pos, count))
        if n > 1:
            chunk = mem.empty(size, x, "chunk")
            self._in_island(
                ctx,
                "reduce_scatter",
                scratch,
                lambda t, s: t.reduce_scatter(chunk, scratch, part_op, s),
            )
        else:
            chunk = scratch
        # 2. pieces of the chunk to the blocks' owners; one partial of this block per island
        k = len(self.islands)
        rows = mem.empty(k * block, x, "rows")
        works = []
        for p in sch.owned:
            if p.peer != self.rank:
                works.append(
                    self._recv(
                        _sub(rows, p.island * block + p.block, p.count), p.peer, _tag(p.block)
                    )
                )
        for p in sch.held:
            piece = _sub(chunk, p.chunk, p.count)
            if p.peer == self.rank:
                mem.copy(_sub(rows, sch.island * block + p.block, p.count), piece)
            else:
                works.append(self._send(piece, p.peer, _tag(p.block)))
        self._wait(works, ctx)
        # 3. the partials folded in island order
        mem.copy(out, _sub(rows, 0, block))
        for i in range(1, k):
            mem.combine(out, _sub(rows, i * block, block), x.dtype, part_op)
        if op is ReduceOp.AVG:
            mem.divide(out, self.size, x.dtype)

    def all_gather(self, out: Buffer, x: Buffer, seq: int) -> Work:
        """Gather inside islands, then the islands' blocks exchanged between islands."""
        self._setup()
        if x.count == 0:
            return completed(self.comm, "all_gather", seq)
        return self._submit("all_gather", seq, [out, x], lambda ctx: self._all_gather(ctx, out, x))

    def _all_gather(self, ctx: _Ctx, out: Buffer, x: Buffer) -> None:
        """reduce_scatter run backwards: blocks to their holders, then the island gathers."""
        mem, block = ctx.mem, x.count
        sch = block_schedule(self.islands, block, self.rank)
        n, size = sch.island_size, sch.chunk
        # 1. this rank's block to its holders in every island; the pieces this rank holds
        chunk = mem.empty(size, x, "chunk")
        mem.zero(chunk)
        works = []
        for p in sch.held:
            piece = _sub(chunk, p.chunk, p.count)
            if p.peer == self.rank:
                mem.copy(piece, _sub(x, p.block, p.count))
            else:
                works.append(self._recv(piece, p.peer, _tag(p.block)))
        for p in sch.owned:
            if p.peer != self.rank:
                works.append(self._send(_sub(x, p.block, p.count), p.peer, _tag(p.block)))
        self._wait(works, ctx)
        # 2. the island's chunks gathered, then put in rank order
        if n > 1:
            scratch = mem.empty(n * size, x, "scratch")
            self._in_island(ctx, "all_gather", chunk, lambda t, s: t.all_gather(scratch, chunk, s))
        else:
            scratch = chunk
        for at, pos, count in sch.layout:
            mem.copy(_sub(out, pos, count), _sub(scratch, at, count))

    def broadcast(self, x: Buffer, root: int, seq: int) -> Work:
        """From the root to one member of each island, then inside each island."""
        self._setup()
        if x.count == 0:
            return completed(self.comm, "broadcast", seq)
        return self._submit("broadcast", seq, [x], lambda ctx: self._broadcast(ctx, x, root))

    def _broadcast(self, ctx: _Ctx, x: Buffer, root: int) -> None:
        """The root to one member of every other island, then a broadcast inside each island."""
        entries = broadcast_entries(self.islands, root)
        works = []
        if self.rank == root:
            works = [self._send(x, e) for i, e in enumerate(entries) if i != self.index]
        elif self.rank == entries[self.index]:
            works = [self._recv(x, root)]
        self._wait(works, ctx)
        members = self.islands[self.index]
        if len(members) > 1:
            local_root = members.index(entries[self.index])
            self._in_island(ctx, "broadcast", x, lambda t, s: t.broadcast(x, local_root, s))

    # ---- operations handed on -------------------------------------------------------------

    def _flat(
        self, op: str, seq: int, buf: Buffer | None, start: Callable[[Transport, int], Work]
    ) -> Work:
        """Start `op` on the flat part from the calling thread (it needs nothing hier shapes);
        the Work follows the part's."""
        flat = self._setup().flat
        transport, part_seq = flat._start(op, buf)
        w = start(transport, part_seq)
        return Work(self.comm, op, seq, w.test, waiter=w._waiter, drive=w.drive, signal=w.signal)

    def reduce(self, x: Buffer, op: ReduceOp, root: int, seq: int) -> Work:
        """On the flat communicator of the same members."""
        return self._flat("reduce", seq, x, lambda t, s: t.reduce(x, op, root, s))

    def all_to_all(self, out: Buffer, x: Buffer, seq: int) -> Work:
        """On the flat communicator of the same members."""
        return self._flat("all_to_all", seq, x, lambda t, s: t.all_to_all(out, x, s))

    def barrier(self, seq: int) -> Work:
        """On the flat communicator of the same members."""
        return self._flat("barrier", seq, None, lambda t, s: t.barrier(s))

    def _point_to_point(self, op: str, buf: Buffer) -> Transport:
        """The transport the group's plan picks for `op` when hier is left out. It is made on
        the group itself, by whichever rank gets here first (none needs its peers to be made),
        and the caller's tags keep their meaning: the message space is the group's own."""
        transports = self.comm._transports
        memory = "device" if buf.on_device else "host"
        choice = transports.choose(op, memory, buf.nbytes, "auto", EXCLUDED)
        return transports.make(choice.transport)

    def send(self, x: Buffer, dst: int, tag: int, seq: int) -> Work:
        """On the group's own point-to-point transport."""
        return self._point_to_point("send", x).send(x, dst, tag, seq)

    def recv(self, x: Buffer, src: int, tag: int, seq: int) -> Work:
        """On the group's own point-to-point transport."""
        return self._point_to_point("recv", x).recv(x, src, tag, seq)

    def close(self) -> None:
        """Stop the workers and close the parts (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._stopping.set()
        stopped = self._worker.stop(wait_s=5.0) if self._worker is not None else True
        aborted = self.comm._aborted
        for part in self._parts.all() if self._parts is not None else ():
            if aborted is not None or not stopped or self._abandoned:
                # operations may still be in flight there: leave their MPI communicators to
                # MPI_Finalize rather than free memory MPI may still write
                part._abort(
                    aborted or CommAborted("the hier transport closed with an operation unfinished")
                )
            part.close()
        self._host.clear()
        if self._gpu is not None:
            self._gpu.close()


def _all_arrived(comm: Context, svc: Any) -> None:
    """Wait, bounded by the timeout, until every rank has come to make the parts: the blocking
    Split and Dup that follow then cannot hang on a rank that never comes."""
    req = svc.Ibarrier()
    start = time.monotonic()
    sleep = 10e-6
    while not req.Test():
        waited = time.monotonic() - start
        if waited > comm.config.timeout:
            # the ranks not as far as this one (the arrivals table) are the ones not come;
            # none, where the setup comes before this rank enters the collective: unknown
            late, detail = comm.late("hier setup", comm._seq)
            why = "not every rank came to set up the hier transport"
            exc = CommTimeout(
                comm.name,
                "hier setup",
                comm._seq + 1,
                comm.config.timeout,
                late or None,
                f"{why}; {detail}" if detail else why,
            )
            comm._abort(exc)
            raise exc
        time.sleep(sleep)
        sleep = min(2 * sleep, 1e-3)


def _part_config(config: Config, name: str) -> Config:
    """The parts plan for themselves: a forced 'hier' (which they cannot use) becomes 'auto';
    any other setting for their names holds. They make no check of their own: the hier
    collective they serve was checked on the whole group before it started them."""
    if config.transport_for(name) == "hier":
        return config.with_options(transport="auto", check=False, debug=False)
    return config.with_options(check=False, debug=False)


def _sub(buf: Buffer, start: int, count: int) -> Buffer:
    """Elements [start, start + count) of a contiguous buffer, as a buffer of its own."""
    if buf.host is not None:
        host = buf.host[start : start + count]
        return Buffer(
            obj=host,
            kind=buf.kind,
            dtype=buf.dtype,
            shape=(count,),
            device="cpu",
            device_index=None,
            ptr=-1,
            contiguous=True,
            readonly=False,
            host=host,
        )
    return Buffer(
        obj=buf.obj,
        kind=buf.kind,
        dtype=buf.dtype,
        shape=(count,),
        device=buf.device,
        device_index=buf.device_index,
        ptr=buf.ptr + start * buf.itemsize,
        contiguous=True,
        readonly=False,
        host=None,
    )


# ---- scratch memory, copies and reductions where the data lives -----------------------------


class _Memory:
    """Scratch buffers, copies and element-wise reductions on one side (host or one device)."""

    def ready(self, buf: Buffer) -> Any:
        """On the calling thread: what the operation must wait for before touching `buf`."""
        return None

    def enter(self, ready: Any) -> None:
        """On the worker thread, before the operation's first step."""

    def empty(self, count: int, like: Buffer, slot: str) -> Buffer:
        """Scratch for `count` elements like `like`; `slot` names its use inside one operation
        (operations run one at a time, so a slot's memory may serve the next one again)."""
        raise NotImplementedError

    def zero(self, buf: Buffer) -> None:
        raise NotImplementedError

    def copy(self, dst: Buffer, src: Buffer) -> None:
        raise NotImplementedError

    def combine(self, dst: Buffer, src: Buffer, dtype: str, op: ReduceOp) -> None:
        raise NotImplementedError

    def divide(self, buf: Buffer, n: int, dtype: str) -> None:
        raise NotImplementedError


class _HostMemory(_Memory):
    """Host scratch kept between operations, one buffer per slot (the largest asked for so far):
    fresh pages would cost a page fault each, on every large operation."""

    def __init__(self) -> None:
        self._slots: dict[str, np.ndarray] = {}

    def empty(self, count: int, like: Buffer, slot: str) -> Buffer:
        sd = storage_dtype(like.dtype)
        nbytes = count * sd.itemsize
        raw = self._slots.get(slot)
        if raw is None or raw.nbytes < nbytes:
            raw = self._slots[slot] = np.empty(nbytes, np.uint8)
        host = raw[:nbytes].view(sd)
        return Buffer(
            obj=host,
            kind="numpy",
            dtype=like.dtype,
            shape=(count,),
            device="cpu",
            device_index=None,
            ptr=-1,
            contiguous=True,
            readonly=False,
            host=host,
        )

    def clear(self) -> None:
        self._slots.clear()

    def zero(self, buf: Buffer) -> None:
        assert buf.host is not None
        buf.host.fill(0)

    def copy(self, dst: Buffer, src: Buffer) -> None:
        assert dst.host is not None and src.host is not None
        local.copy_host(dst.host, src.host)

    def combine(self, dst: Buffer, src: Buffer, dtype: str, op: ReduceOp) -> None:
        assert dst.host is not None and src.host is not None
        local.combine_host(dst.host, src.host, dtype, op)

    def divide(self, buf: Buffer, n: int, dtype: str) -> None:
        assert buf.host is not None
        local.divide_host(buf.host, n, dtype)


class _DeviceMemory(_Memory):
    """Device scratch from cupy; copies and reductions by hetcomm's kernels (kernels/device.py),
    each finished before the next step, so that the parts' transports see finished data."""

    def __init__(self, gpu: Any, like: Buffer) -> None:
        self.gpu = gpu
        self.index = like.device_index

    def ready(self, buf: Buffer) -> Any:
        # the caller's stream: the operation starts after the work already queued there
        return self.gpu.ready_event(buf)

    def enter(self, ready: Any) -> None:
        import cupy

        cupy.cuda.Device(self.index if self.index is not None else self.gpu.device).use()
        if ready is not None:
            ready.synchronize()

    def empty(self, count: int, like: Buffer, slot: str) -> Buffer:
        import cupy  # its memory pool keeps freed blocks for the next operation

        mem = cupy.empty(max(1, count * like.itemsize), dtype=cupy.uint8)
        return Buffer(
            obj=mem,
            kind="cupy",
            dtype=like.dtype,
            shape=(count,),
            device=like.device,
            device_index=like.device_index,
            ptr=int(mem.data.ptr),
            contiguous=True,
            readonly=False,
            host=None,
        )

    def zero(self, buf: Buffer) -> None:
        # on the copy stream (non-blocking), so that a copy into the same memory right after
        # cannot run before the zeroing has finished
        self.gpu.zero(buf.ptr, buf.nbytes)

    def copy(self, dst: Buffer, src: Buffer) -> None:
        if dst.count:
            self.gpu.copy_device(_region(dst), _region(src), None)

    def combine(self, dst: Buffer, src: Buffer, dtype: str, op: ReduceOp) -> None:
        if dst.count:
            kind = "sum" if op is ReduceOp.AVG else op.value
            self.gpu.combine(_region(dst), _region(src), dtype, kind, None)

    def divide(self, buf: Buffer, n: int, dtype: str) -> None:
        if buf.count:
            self.gpu.divide(_region(buf), n, dtype, None)


def _region(buf: Buffer) -> Region:
    return Region(buf.nbytes, None, buf.ptr)
