"""Device-direct transport (DDC): GPUs read each other's memory; a CPU proxy drives control.

Peers of one host map each other's allocations through CUDA/HIP IPC (hetcomm.transports.direct.peer,
each handle exchanged once). The calling thread records an event on the array's stream and
queues the operation; one proxy thread per communicator exchanges buffer records over MPI,
orders the GPU work on its own stream after that event, and completes the Work once the GPU is
done. Copies run on the copy engines (cudaMemcpyAsync between mapped pointers); reductions run
as kernels that read every peer's memory (kernels/reduce.cu, reduce_peers*).

Ordering across processes relies on MPI messages sent after a stream has been synchronized, never
on sleeps. The result is visible on the caller's stream once the Work is complete (wait()).

Send/recv: one rank of each pair does the copies (direct_schedule.copier): the receiver, or on a
shared GPU the lower rank in both directions, which spares the GPU a switch between the two
processes' contexts per message. The other rank lends its buffer: once its stream has the buffer
ready it lends the buffer's record, records of one peer and tag strictly in issue order (they
are matched in the order they are lent), and waits for the copier's "done". Record and "done"
travel through the group's mailbox in shared memory (direct/mailbox.py). A blocking send
or receive, or a blocking collective, repeated while the proxy is idle runs on the calling
thread instead, exchanging the same messages (direct/prepared.py, direct/collectives.py).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from mpi4py import MPI

from ...dtypes import HALVES, TABLE
from ...errors import InvalidArgument
from ...kernels.device import kernel_op, kernel_type
from ...ops import ReduceOp
from ...work import Work, take_blocking
from .. import tags
from ..base import Context, Transport
from . import schedule
from .collectives import PreparedCollectives
from .leader import launcher
from .mailbox import MpiPost, ShmPost
from .peer import RECORD, Described, PeerMap
from .pointtopoint import Lent, PointToPoint
from .prepared import D2D, PreparedP2P
from .proxy import Proxy, Step, Task, stamp

if TYPE_CHECKING:
    from ...arrays import Buffer
    from ...topology import Topology
    from .collectives import Span

log = logging.getLogger("hetcomm")

_THREADS = 512
# reduce_peers launches kept (DirectTransport._launch); a program that keeps reducing new
# addresses starts over instead of growing without bound
_MAX_LAUNCHES = 256


def group_unavailable(
    hosts: list[str], real_vendors: list[str], devices: list[str | None]
) -> str | None:
    """Why peer mapping cannot join these members (pure), or None."""
    if len(set(hosts)) > 1:
        return (
            f"members on {len(set(hosts))} hosts: peer mapping joins one host's GPUs (across "
            "hosts direct needs a GPU-aware MPI)"
        )
    if any(d is None for d in devices):
        return "some members have no device"
    if len(set(real_vendors)) > 1:
        return (
            f"members' GPUs come from vendors {', '.join(sorted(set(real_vendors)))}: no IPC "
            "between them"
        )
    return None


class DirectTransport(PointToPoint, Transport):
    """Every op by peer copies and peer-reading kernels among the GPUs of one host."""

    name: ClassVar[str] = "direct"
    memory: ClassVar[tuple[str, ...]] = ("device",)

    def __init__(self, comm: Context) -> None:
        super().__init__(comm)
        import cupy

        from ...kernels import device as device_kernels

        self.cupy, self.device_kernels = cupy, device_kernels
        self.rank, self.size = comm.rank, comm.size
        self.svc: MPI.Intracomm = comm.service
        self.device = cupy.cuda.Device().id
        self.peers = PeerMap(cupy)
        self.described = Described(self.peers)  # records of our buffers lent over and over
        self._devices = [r.device for r in comm.topology.ranks]
        # records of lent buffers not sent yet, per (peer, tag), in issue order
        self._lent: dict[tuple[int, int], deque[Lent]] = {}
        self._proxy = Proxy(self.device, cupy, self.svc)
        # where sends' and receives' records and "done"s travel: the group's mailbox, or MPI
        # messages where the group has none (every rank alike)
        lanes = comm.lanes
        self.post = ShmPost(lanes, self.rank, self.size) if lanes is not None else MpiPost(self.svc)
        self._scratch: list[Any] = []  # two one-shot input buffers, used alternately
        self._prepared: set[tuple[str, ReduceOp]] = set()
        self._launches: dict[tuple[Any, ...], tuple[Any, tuple[int], tuple[np.void]]] = {}
        self._flip = 0
        self._others = [p for p in range(self.size) if p != self.rank]
        self._tag_ub = int(self.svc.Get_attr(MPI.TAG_UB) or 32767)
        self._lead_tag = tags.lead_base(self._tag_ub)
        self._done_flag = np.zeros(1, np.int8)  # the leader's "done" message
        # ranks that share one GPU: the leader (rank 0) does every collective for all of them
        # from one process (one pass of a reduction, every copy on its stream), which saves the
        # GPU the switches between processes' contexts (about 250 us each on an H100 shared
        # by 4 ranks: BENCHMARKS, "Device collectives on 4 ranks sharing one GPU")
        self.shared = comm.topology.share_one_device() and self.size <= schedule.MAX_SOURCES
        self.led = 0  # collectives made through the leader
        device_kernels.kernel("copy16")
        # the stream GPU work is queued on: the proxy's, or the caller's while a prepared
        # collective runs on the calling thread (it holds the proxy's claim meanwhile)
        self.stream: Any = self._proxy.stream
        self._prepared_p2p = PreparedP2P(self)
        self._prepared_colls = PreparedCollectives(self, self._prepared_p2p)

    @classmethod
    def unavailable(cls, topology: Topology) -> str | None:
        """None for GPUs of one host that can map each other's memory, else the reason."""
        ranks = topology.ranks
        why = group_unavailable(
            [r.host for r in ranks], [r.detected_vendor for r in ranks], [r.device for r in ranks]
        )
        if why is not None:
            return why
        if len({r.node for r in ranks}) > 1:
            return "members on several shared-memory nodes"
        from ...kernels.device import unavailable as device_unavailable

        why = device_unavailable()
        if why is not None:
            return why
        if len(ranks) > 1:
            return topology.peer_mapping_unavailable()
        return None

    # ---- the calling thread ----------------------------------------------------------------------

    def _check(self, op: str, bufs: tuple[Buffer, ...]) -> None:
        for b in bufs:
            if b.device_index != self.device:
                raise InvalidArgument(
                    f"{op}: group '{self.comm.name}' moves device {self.device}'s memory on "
                    f"this rank, got {b.describe()}; use one device per rank"
                )

    def _ready(self, b: Buffer) -> Any:
        """An event where the caller's stream (the one its work on `b` is ordered on) reaches
        this call; None where that stream has nothing left to run. That holds for the legacy
        default stream (0 or 1) too: its query counts the work of the blocking streams it
        waits for (tests/gpu/test_legacy_stream.py)."""
        stream = self.device_kernels.external_stream(
            self.device_kernels.current_stream(b), self.device
        )
        # on the device: the legacy stream a query or record names is the current device's
        return self.device_kernels.on_device(self.device, self._event_unless_done, stream)

    def ready_events(self, bufs: Sequence[Buffer]) -> list[Any]:
        """Transport.ready_events: None where a stream has run everything (see _ready)."""
        self._check("all_reduce_coalesced", tuple(bufs))
        return [self._ready(b) for b in self.device_kernels.by_stream(bufs).values()]

    def _event_unless_done(self, stream: Any) -> Any:
        """None if `stream` (of the current device) has run everything queued on it, else a
        new event recorded on it."""
        if stream.done:
            return None
        ready = self.cupy.cuda.Event(disable_timing=True)
        ready.record(stream)
        return ready

    def _queue(
        self,
        op: str,
        seq: int,
        bufs: tuple[Buffer, ...],
        nbytes: int,
        body: Callable[[], Step],
        collective: bool = True,
        ready: Sequence[Any] | None = None,
    ) -> Work:
        """Hand the operation `body` to the proxy; it starts once the caller's stream has run
        what was queued before the call, or where `ready` is given once its events have
        passed (None among them, or none at all: nothing to wait for)."""
        stamp("prepared")
        self._check(op, bufs)
        if ready is None:
            ready = [self._ready(bufs[0])]

        def run() -> Step:
            for event in ready:
                if event is not None:
                    yield event  # what the caller queued before the op has run
            yield from body()

        task = Task(run())
        stamp("queued")
        proxy = self._proxy
        proxy.submit(task, collective, nbytes, take_blocking())
        work = Work(
            self.comm,
            op,
            seq,
            task.poll,
            waiter=lambda seconds: proxy.wait(task, collective, seconds),
            signal=task,
        )
        work.info = {"transport": self.name, "bytes": nbytes}
        return work

    # ---- steps the proxy runs ----------------------------------------------------------------

    def _exchange(self, recs: np.ndarray, into: list[np.ndarray]) -> Step:
        """Allgather this rank's records; `into[0]` becomes the (size, len(recs)) table."""
        table = np.empty((self.size, len(recs)), RECORD)
        yield self.svc.Iallgather(recs.view(np.uint8), table.view(np.uint8))
        # handles sent to everyone are kept, even if not opened now
        self.peers.learn_rows(table, self._others)
        into.append(table)

    def _records(self, bufs: list[Span]) -> np.ndarray:
        return np.concatenate([self.peers.describe(b.ptr, b.nbytes, self._others) for b in bufs])

    def _addresses(self, table: np.ndarray, col: int, mine: int) -> list[int]:
        """Our address of column `col` of every rank's records (our own: `mine`)."""
        return self.peers.addresses(table, col, self.rank, mine)

    def _sync(self) -> Step:
        yield self._proxy.mark(self.stream)

    def _barrier(self) -> Step:
        yield self.svc.Ibarrier()

    def _copy(self, dst: int, src: int, nbytes: int) -> None:
        """Copy on the transport's stream by cudaMemcpyAsync (faster through an IPC mapping
        than a copy kernel: docs/BENCHMARKS.md, "direct"); none of memory onto itself (the
        in-place all_gather's own block)."""
        if nbytes and dst != src:
            self.cupy.cuda.runtime.memcpyAsync(dst, src, nbytes, D2D, self.stream.ptr)

    def _reduce(self, dst: int, srcs: list[int], count: int, dtype: str, op: ReduceOp) -> None:
        """dst = op over srcs (in order), `count` elements, on the transport's stream."""
        if count == 0:
            return
        if dst in srcs[schedule.MAX_SOURCES :]:
            # dst is also a source past the first batch, which overwrites dst: read it first
            srcs = [dst, *(p for p in srcs if p != dst)]
        for group in schedule.batches(list(range(len(srcs)))):
            ptrs = [dst if i < 0 else srcs[i] for i in group]
            self._reduce_into([dst], ptrs, count, dtype, op, 0)

    def _reduce_into(
        self, outs: list[int], srcs: list[int], count: int, dtype: str, op: ReduceOp, div: int
    ) -> None:
        """Every one of `outs` = op over `srcs` (divided by `div` when > 0), one pass."""
        vector = (
            dtype == "float32"
            and op in (ReduceOp.SUM, ReduceOp.AVG)
            and not any(p % 16 for p in (*outs, *srcs))
        )
        head = count // 4 if vector else 0  # float32 sums of aligned memory: 4 per thread
        if head:
            self._launch("reduce_peers_f32x4", outs, srcs, head, div)
        if count > 4 * head:
            skip = 16 * head
            self._launch(
                _kernel_name(dtype, op),
                [p + skip for p in outs],
                [p + skip for p in srcs],
                count - 4 * head,
                div,
            )

    def _launch(self, name: str, outs: list[int], srcs: list[int], count: int, div: int) -> None:
        """Queue reduce_peers kernel `name` on the transport's stream. Its pointers and sizes
        go as one parameter by value (schedule.peers_args), kept with the kernel and grid per
        (name, addresses, count, divisor): a training loop reduces the same buffers call after
        call. On an H100's host the 20 numpy scalars it took before cost 13-14 us to make and
        17-19 us more to launch with; the kept parameter launches in 9 us."""
        key = (name, *outs, -1, *srcs, count, div)
        launch = self._launches.get(key)
        if launch is None:
            if len(self._launches) >= _MAX_LAUNCHES:
                self._launches.clear()
            blocks = max(1, min(2048, (count + _THREADS - 1) // _THREADS))
            args = (schedule.peers_args(outs, srcs, count, div),)
            launch = self._launches[key] = (self.device_kernels.kernel(name), (blocks,), args)
        kernel, grid, args = launch
        with self.stream:
            kernel(grid, (_THREADS,), args)

    def _average(self, ptr: int, count: int, dtype: str) -> None:
        if count:
            self.device_kernels.divide_on(self.stream, ptr, count, self.size, dtype)

    def _one_shot_scratch(self) -> Any:
        if not self._scratch:
            self._scratch = [self.cupy.cuda.alloc(schedule.ONE_SHOT_BYTES) for _ in range(2)]
        self._flip ^= 1
        return self._scratch[self._flip]

    # ---- operations ------------------------------------------------------------------------

    def all_reduce(self, x: Buffer, out: Buffer, op: ReduceOp, seq: int) -> Work:
        """The shared GPU's leader for all, else one-shot or two-shot by size."""
        return self._collective("all_reduce", seq, x, out, op, -1)

    def reduce_scatter(self, out: Buffer, x: Buffer, op: ReduceOp, seq: int) -> Work:
        """Each rank reduces its block straight from its peers' `x`."""
        return self._collective("reduce_scatter", seq, x, out, op, -1)

    def reduce(self, x: Buffer, op: ReduceOp, root: int, seq: int) -> Work:
        """The root reduces every peer's `x` into its own."""
        return self._collective("reduce", seq, x, None, op, root)

    def broadcast(self, x: Buffer, root: int, seq: int) -> Work:
        """Every rank copies the root's `x` into its own."""
        return self._collective("broadcast", seq, x, None, None, root)

    def all_gather(self, out: Buffer, x: Buffer, seq: int) -> Work:
        """Every rank copies each peer's `x` into that peer's block of `out`."""
        return self._collective("all_gather", seq, x, out, None, -1)

    def all_to_all(self, out: Buffer, x: Buffer, seq: int) -> Work:
        """Every rank copies its block of each peer's `x` into `out`."""
        return self._collective("all_to_all", seq, x, out, None, -1)

    def _collective(
        self,
        op: str,
        seq: int,
        x: Buffer,
        out: Buffer | None,
        rop: ReduceOp | None,
        root: int,
    ) -> Work:
        """`op` on the proxy, started once the caller's stream has run what came before."""
        if rop is not None:
            self._prepare(x.dtype, rop)
        steps, collective = self.steps(op, seq, x, out, rop, root)
        bufs = (x,) if out is None else (x, out)
        nbytes = out.nbytes if op == "all_gather" and out is not None else x.nbytes
        return self._queue(op, seq, bufs, nbytes, steps, collective)

    def steps(
        self,
        op: str,
        seq: int,
        x: Span,
        out: Span | None,
        rop: ReduceOp | None,
        root: int,
    ) -> tuple[Callable[[], Step], bool]:
        """The steps of collective `seq` (`op` on `x` and `out`: Buffers, or a prepared call's
        Spans), queued on the transport's stream; and whether they keep their place among the
        collectives (False: another rank's side of an op of the shared GPU's leader, which runs
        beside its other operations). Messages it receives are posted now, in issue order."""
        if op == "all_reduce" and self.size == 1:
            assert out is not None
            return partial(self._alone, x, out), True
        if self.shared:
            spans = (
                [(x.ptr, x.nbytes)] if out is None else [(x.ptr, x.nbytes), (out.ptr, out.nbytes)]
            )
            return self._lead(seq, spans, launcher(self, op, x, out, rop, root))
        if op == "all_reduce":
            assert out is not None and rop is not None
            if schedule.algorithm(x.nbytes, self.size) == "one-shot":
                return partial(self._one_shot, x, out, rop), True
            return partial(self._two_shot, x, out, rop), True
        if op == "reduce_scatter":
            assert out is not None and rop is not None
            return partial(self._reduce_scatter, x, out, rop), True
        if op == "reduce":
            assert rop is not None
            return partial(self._reduce_at, x, rop, root), True
        if op == "broadcast":
            return partial(self._broadcast, x, root), True
        assert out is not None
        if op == "all_gather":
            return partial(self._all_gather, x, out), True
        return partial(self._all_to_all, x, out), True

    def _lead(
        self,
        seq: int,
        spans: Sequence[tuple[int, int]],
        launch: Callable[[np.ndarray], Any],
    ) -> tuple[Callable[[], Step], bool]:
        """The steps of a collective that rank 0 does alone for every rank sharing its GPU.

        Each other rank sends rank 0 the records of `spans` ((address, bytes) each) once its
        stream is ready and waits for rank 0's "done"; rank 0 waits for every record, queues
        the GPU work (`launch(table)`, which returns what that work reads and must outlive
        it), waits for it, and sends "done". Point-to-point messages tagged by the
        collective's number, posted as soon as the operation is called, so that the other
        ranks' records of the next operation are already there when rank 0 ends this one:
        back-to-back operations do not pay a round trip between them. The other ranks' side
        runs beside their other operations; rank 0's keeps its place among the collectives.
        An empty span's record is all zeros (no allocation to name).
        """
        self.led += 1
        t_rec = self._lead_tag + 2 * (seq % tags.LEAD_TAGS)
        t_done = t_rec + 1
        if self.rank != 0:
            done = np.zeros(1, np.int8)
            finished = self.svc.Irecv(done, 0, t_done)

            def member(done: np.ndarray = done) -> Step:  # `done` lives until it arrived
                # described where the device's context is current (the proxy's thread, or a
                # prepared call's once it checked the device): on a thread without it the
                # driver's range query of a new allocation failed with
                # CUDA_ERROR_INVALID_CONTEXT (CuPy arrays made under a non-default stream)
                rec = self.described.many(tuple(spans))
                yield self.svc.Isend(rec.view(np.uint8), 0, t_rec)
                yield finished

            return member, False
        table = np.zeros((self.size, len(spans)), RECORD)
        arrived = [self.svc.Irecv(table[p].view(np.uint8), p, t_rec) for p in self._others]

        def leader() -> Step:
            yield arrived
            self.peers.learn_rows(table, self._others)
            held = launch(table)  # what the GPU work reads, kept until it has run
            yield from self._sync()
            del held
            yield [self.svc.Isend(self._done_flag, p, t_done) for p in self._others]

        return leader, True

    def _reduce_all(
        self, outs: list[int], srcs: list[int], count: int, dtype: str, op: ReduceOp
    ) -> None:
        """outs[k] = op over srcs for every k, one pass (AVG divides in the same pass)."""
        if count:
            self._reduce_into(outs, srcs, count, dtype, op, self.size if op is ReduceOp.AVG else 0)

    @property
    def reduces_arrays(self) -> bool:
        """Where the group shares one GPU, whose leader reads every rank's arrays itself."""
        return self.shared

    def all_reduce_arrays(
        self,
        spans: Sequence[tuple[int, int]],
        dtype: str,
        op: ReduceOp,
        seq: int,
        ready: Sequence[Any],
    ) -> Work:
        """Transport.all_reduce_arrays through the shared GPU's leader: it reduces every
        rank's arrays as one concatenation, cut wherever any rank's array ends
        (schedule.pieces): the small pieces in one launch over a table of them
        (schedule.tables), a large one in launches of its own. It reads as many records of
        every rank as it has arrays itself (the check compares the counts)."""
        assert self.shared
        self._prepare(dtype, op)
        kernel = self.device_kernels.kernel(_kernel_name(dtype, op, "reduce_pieces"))

        def all_reduce(table: np.ndarray) -> None:
            rows = [
                list(spans) if p == self.rank else self.peers.row(table, p)
                for p in range(self.size)
            ]
            item = TABLE[dtype].itemsize
            small = []
            for n, at in schedule.pieces(rows):
                if n > schedule.TABLE_BYTES:
                    self._reduce_all(at, at, n // item, dtype, op)
                else:
                    small.append((n // item, at))
            div = np.int64(self.size if op is ReduceOp.AVG else 0)
            for pieces, npieces, longest in schedule.tables(small):
                blocks = max(1, min(2048 // npieces, (longest + _THREADS - 1) // _THREADS))
                with self.stream:
                    kernel((blocks, npieces), (_THREADS,), (pieces, np.int32(self.size), div))

        steps, collective = self._lead(seq, spans, all_reduce)
        nbytes = sum(n for _, n in spans)
        return self._queue("all_reduce_coalesced", seq, (), nbytes, steps, collective, ready)

    def _alone(self, x: Span, out: Span) -> Step:
        if out.ptr != x.ptr:
            self._copy(out.ptr, x.ptr, x.nbytes)
        yield from self._sync()

    def _one_shot(self, x: Span, out: Span, op: ReduceOp) -> Step:
        # the input is copied into one of two scratch buffers first, so that `out` may be `x`
        # and peers never read memory the caller owns; two buffers used alternately suffice,
        # since an op's exchange completes only after every rank has ended the op before
        scratch = self._one_shot_scratch()
        self._copy(scratch.ptr, x.ptr, x.nbytes)
        yield from self._sync()
        rec = self.peers.describe(scratch.ptr, x.nbytes, self._others)
        got: list[np.ndarray] = []
        yield from self._exchange(rec, got)
        srcs = self._addresses(got[0], 0, scratch.ptr)
        self._reduce(out.ptr, srcs, x.count, x.dtype, op)
        if op is ReduceOp.AVG:
            self._average(out.ptr, out.count, out.dtype)
        yield from self._sync()

    def _two_shot(self, x: Span, out: Span, op: ReduceOp) -> Step:
        got: list[np.ndarray] = []
        yield from self._exchange(self._records([x, out]), got)
        xs = self._addresses(got[0], 0, x.ptr)
        outs = self._addresses(got[0], 1, out.ptr)
        spans = schedule.shards(x.count, x.itemsize, self.size)
        lo, hi = spans[self.rank]
        item = x.itemsize
        # reduce-scatter: this rank reduces its shard of every input into its own output
        self._reduce(out.ptr + lo * item, [p + lo * item for p in xs], hi - lo, x.dtype, op)
        if op is ReduceOp.AVG:
            self._average(out.ptr + lo * item, hi - lo, x.dtype)
        yield from self._sync()
        yield from self._barrier()  # every shard reduced
        # all-gather: copy every other rank's reduced shard from its output into ours
        for p in self._others:
            a, b = spans[p]
            self._copy(out.ptr + a * item, outs[p] + a * item, (b - a) * item)
        yield from self._sync()
        yield from self._barrier()  # nobody reads our buffers any more

    def _reduce_scatter(self, x: Span, out: Span, op: ReduceOp) -> Step:
        got: list[np.ndarray] = []
        yield from self._exchange(self._records([x]), got)
        block = out.nbytes * self.rank
        xs = [p + block for p in self._addresses(got[0], 0, x.ptr)]
        self._reduce(out.ptr, xs, out.count, x.dtype, op)
        if op is ReduceOp.AVG:
            self._average(out.ptr, out.count, out.dtype)
        yield from self._sync()
        yield from self._barrier()

    def _reduce_at(self, x: Span, op: ReduceOp, root: int) -> Step:
        got: list[np.ndarray] = []
        yield from self._exchange(self._records([x]), got)
        if self.rank == root:
            self._reduce(x.ptr, self._addresses(got[0], 0, x.ptr), x.count, x.dtype, op)
            if op is ReduceOp.AVG:
                self._average(x.ptr, x.count, x.dtype)
            yield from self._sync()
        yield from self._barrier()

    def _broadcast(self, x: Span, root: int) -> Step:
        got: list[np.ndarray] = []
        yield from self._exchange(self._records([x]), got)
        if self.rank != root:
            self._copy(x.ptr, self.peers.resolve(root, got[0][root, 0]), x.nbytes)
            yield from self._sync()
        yield from self._barrier()

    def _all_gather(self, x: Span, out: Span) -> Step:
        got: list[np.ndarray] = []
        yield from self._exchange(self._records([x]), got)
        for p, src in enumerate(self._addresses(got[0], 0, x.ptr)):
            self._copy(out.ptr + p * x.nbytes, src, x.nbytes)
        yield from self._sync()
        yield from self._barrier()

    def _all_to_all(self, x: Span, out: Span) -> Step:
        block = x.nbytes // self.size
        got: list[np.ndarray] = []
        yield from self._exchange(self._records([x]), got)
        for p, src in enumerate(self._addresses(got[0], 0, x.ptr)):
            self._copy(out.ptr + p * block, src + self.rank * block, block)
        yield from self._sync()
        yield from self._barrier()

    def barrier(self, seq: int) -> Work:
        """A barrier on the proxy, in issue order with the collectives."""
        task = Task(self._barrier())
        proxy = self._proxy
        proxy.submit(task, True)
        return Work(
            self.comm,
            "barrier",
            seq,
            task.poll,
            waiter=lambda seconds: proxy.wait(task, True, seconds),
            signal=task,
        )

    def stages_input(self, op: str, nbytes: int) -> bool:
        """The shared GPU's leader reads every rank's whole input of an all_to_all before it
        writes an output where they overlap, with no copy by each rank first (that copy, a
        kernel in every process, cost two switches between their contexts: 750-800 us
        against 220-230 us out of place on 4 ranks of one H100)."""
        return op == "all_to_all" and self.shared

    def prepare(
        self, op: str, x: Buffer | None, out: Buffer | None, rop: ReduceOp | None, root: int
    ) -> Callable[..., bool] | None:
        """The blocking call of one signature on device arrays, run on the calling thread with
        no Work (hetcomm.routes.Route.run): sends, receives and the sendrecv of a pair
        (direct/prepared.py), the collectives (direct/collectives.py); None where the proxy's
        path takes every call (the barrier, all_reduce_coalesced)."""
        if op == "sendrecv":
            return self._prepared_p2p.prepare_pair(x, out)
        if op in ("send", "recv"):
            return self._prepared_p2p.prepare(op, x)
        return self._prepared_colls.prepare(op, x, out, rop, root)

    # ---- life cycle ----------------------------------------------------------------------------

    def _prepare(self, dtype: str, op: ReduceOp) -> None:
        """Compile the kernels an op needs on the calling thread, before the proxy waits on it."""
        key = (dtype, op)
        if key in self._prepared:
            return
        self.device_kernels.kernel(_kernel_name(dtype, op))
        if dtype == "float32" and op in (ReduceOp.SUM, ReduceOp.AVG):
            self.device_kernels.kernel("reduce_peers_f32x4")
        if op is ReduceOp.AVG:
            self.device_kernels.kernel(self.device_kernels.divide_name(dtype))
        self._prepared.add(key)

    def stats(self) -> dict[str, int]:
        """Registration cache counters: mappings opened (misses), reused (hits), held; the
        collectives made through the shared GPU's leader, and how many of those were its
        prepared call (direct/leader.py)."""
        peers = self.peers
        return {
            "hits": peers.hits,
            "misses": peers.misses,
            "mapped": peers.mapped,
            "led": self.led,
            "prepared": self._prepared_colls.ran,
        }

    def close(self) -> None:
        """Stop the proxy, wait for its stream and unmap the peers' memory."""
        self._proxy.stop()
        if self._proxy.stream is not None:
            self._proxy.stream.synchronize()
        self.post.close()
        self.peers.close()
        # peers may still be reading the one-shot scratch of the last op (an op ends here once
        # this rank's part is done): returning it to the memory pool could let a new array
        # overwrite it under them, so it is kept until the process ends
        _RETIRED.extend(self._scratch)
        self._scratch = []


_RETIRED: list[Any] = []


def _kernel_name(dtype: str, op: ReduceOp, family: str = "reduce_peers") -> str:
    """The peer-reduction kernel of `family` (reduce_peers, reduce_pieces) for `dtype` and
    `op` (kernels/reduce.cu; AVG sums)."""
    half = "_half" if dtype in HALVES else ""
    name = "sum" if op is ReduceOp.AVG else op.value
    return f"{family}{half}{kernel_type(dtype)}, {kernel_op(dtype, name)}>"
