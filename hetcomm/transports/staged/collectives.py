"""Collectives of the staged transport: rings (and a pipelined chain) of staged messages, and
for groups of one host, one shared segment (hetcomm.transports.hostcoll)."""

from __future__ import annotations

import contextlib
import math
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from ...arrays import as_buffer, own_block
from ...errors import CommTimeout, PeerLost
from ...ops import ReduceOp
from .. import hostcoll, local, tags
from ..local import Region
from .cts import CTS_COLL
from .ops import PeerTimeout
from .schedule import block_spans, chunk_spans

if TYPE_CHECKING:
    from ...arrays import Buffer
    from ...work import Work
    from .transport import StagedTransport

Body = Callable[[float, Any], None]


class _Local:
    """Copies, reductions and scratch space on whichever side the data lives."""

    def __init__(self, t: StagedTransport, ready: Any) -> None:
        self.gpu = t.gpu
        self.ready = ready

    def temp(self, nbytes: int, like: Region) -> Region:
        if like.host is not None:
            return Region(nbytes, np.empty(nbytes, np.uint8))
        mem, ptr = self.gpu.alloc(nbytes)
        return Region(nbytes, None, ptr, mem)

    def copy(self, dst: Region, src: Region) -> None:
        if dst.nbytes == 0:
            return
        if dst.host is not None and src.host is not None:
            np.copyto(dst.host, src.host)
        else:
            self.gpu.copy_device(dst, src, self.ready)

    def combine(self, dst: Region, src: Region, dtype: str, op: ReduceOp) -> None:
        if dst.nbytes == 0:
            return
        if dst.host is not None and src.host is not None:
            local.combine_host(dst.host, src.host, dtype, op)
        else:
            kind = "sum" if op is ReduceOp.AVG else op.value
            self.gpu.combine(dst, src, dtype, kind, self.ready)

    def divide(self, region: Region, n: int, dtype: str) -> None:
        if region.nbytes == 0:
            return
        if region.host is not None:
            local.divide_host(region.host, n, dtype)
        else:
            self.gpu.divide(region, n, dtype, self.ready)


def _ring(t: StagedTransport, deadline: float, *extra: int) -> None:
    """Open the channels a ring needs (left, right and `extra` peers) together, up front."""
    n, r = t.size, t.rank
    t.channels(sorted({(r - 1) % n, (r + 1) % n, *extra}), deadline)


def _blocks(region: Region, count: int, parts: int, itemsize: int) -> list[Region]:
    return [region.sub(start * itemsize, n * itemsize) for start, n in block_spans(count, parts)]


def _ring_reduce_scatter(
    t: StagedTransport,
    seq: int,
    work: list[Region],
    tmp: Region,
    local: _Local,
    dtype: str,
    op: ReduceOp,
    deadline: float,
    ready: Any,
) -> None:
    """After this, block r of `work` on rank r holds the reduction over every rank."""
    n, r = t.size, t.rank
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        send_b, recv_b = (r - s - 1) % n, (r - s - 2) % n
        into = tmp.sub(0, work[recv_b].nbytes)
        t.exchange(seq, s, right, work[send_b], left, into, deadline, ready)
        local.combine(work[recv_b], into, dtype, op)


def _ring_all_gather(
    t: StagedTransport, seq: int, first_step: int, blocks: list[Region], deadline: float, ready: Any
) -> None:
    """Starting with its own block r, every rank ends with every block."""
    n, r = t.size, t.rank
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        t.exchange(
            seq,
            first_step + s,
            right,
            blocks[(r - s) % n],
            left,
            blocks[(r - s - 1) % n],
            deadline,
            ready,
        )


# all_reduce of at most this many bytes over a power-of-two group: recursive doubling
# (log2(n) exchanges of the whole buffer) instead of the ring's 2(n-1) exchanges of blocks,
# since a small operation's time is the number of its steps
DOUBLING_MAX_BYTES = 256 << 10


def _doubling(
    t: StagedTransport,
    seq: int,
    acc: Region,
    local: _Local,
    dtype: str,
    op: ReduceOp,
    deadline: float,
    ready: Any,
) -> None:
    """Recursive doubling: at step k, swap `acc` with rank r XOR 2^k and combine. Both
    partners combine the same two values (IEEE sums, products, minima and maxima commute), so
    every rank ends with the same bits."""
    n, r = t.size, t.rank
    tmp = local.temp(acc.nbytes, acc)
    # each step opens its partner's channel when it first needs it: the two ranks of a pair
    # ask for each other at the same step, so no opening waits on a third rank (all partners
    # at once could, with a send to one of them opening the same channel meanwhile)
    for step, partner in enumerate(r ^ (1 << k) for k in range(n.bit_length() - 1)):
        t.exchange(seq, step, partner, acc, partner, tmp, deadline, ready)
        local.combine(acc, tmp, dtype, op)


def all_reduce(t: StagedTransport, x: Buffer, out: Buffer, op: ReduceOp, seq: int) -> Body:
    """Ring reduce-scatter then ring all-gather: each rank sends 2(n-1)/n of the data; small
    operations over a power-of-two group by recursive doubling instead; through the shared
    segment where the group is one host's ranks."""

    def run(group: hostcoll.HostGroup, src: Any, res: Any, deadline: float) -> None:
        group.all_reduce(src, res, x.nbytes, x.dtype, op, deadline)

    ring = partial(_all_reduce_ring, t, x, out, op, seq)
    return _through_segment(t, "all_reduce", seq, x, out, ring, run, (x.dtype, op))


def _through_segment(
    t: StagedTransport,
    name: str,
    seq: int,
    x: Buffer,
    out: Buffer,
    ring: Callable[[], Body],
    run: Callable[[hostcoll.HostGroup, Any, Any, float], None],
    reduction: tuple[str, ReduceOp] | None = None,
) -> Body:
    """Collective `name` #`seq` as `ring()`'s body, or where the group has a shared segment for x's
    size, `run(group, src, res, deadline)` in it: x copied into this rank's block first, the
    result out of it after (the operations whose input is x and whose output is out on every
    rank; `reduction`: their dtype and reduce op, for those that reduce)."""
    group = _segment(t, x.nbytes)
    if group is None:
        return ring()
    xr, orr = t._region(x), t._region(out)

    def in_segment(deadline: float, ready: Any) -> None:
        src = _input(t, group, xr, ready)
        with _output(t, orr, ready) as res:
            run(group, src, res, deadline)

    dtype, rop = reduction or ("", None)
    start = (name, xr.host, orr.host, xr.nbytes, dtype, rop, -1)
    return _on_segment(t, f"{name} #{seq}", group, xr.nbytes, in_segment, ring, start)


def _all_reduce_ring(t: StagedTransport, x: Buffer, out: Buffer, op: ReduceOp, seq: int) -> Body:
    xr, orr = t._region(x), t._region(out)
    n = t.size
    doubling = n > 1 and n & (n - 1) == 0 and xr.nbytes <= DOUBLING_MAX_BYTES

    def body(deadline: float, ready: Any) -> None:
        local = _Local(t, ready)
        if doubling:
            if out is not x:
                local.copy(orr, xr)
            _doubling(t, seq, orr, local, x.dtype, op, deadline, ready)
            if op is ReduceOp.AVG:
                local.divide(orr, n, x.dtype)
            return
        _ring(t, deadline)
        if out is not x:
            local.copy(orr, xr)
        if t.size > 1:
            blocks = _blocks(orr, x.count, t.size, x.itemsize)
            tmp = local.temp(max(b.nbytes for b in blocks), orr)
            _ring_reduce_scatter(t, seq, blocks, tmp, local, x.dtype, op, deadline, ready)
            _ring_all_gather(t, seq, t.size - 1, blocks, deadline, ready)
        if op is ReduceOp.AVG:
            local.divide(orr, t.size, x.dtype)

    return body


def reduce_scatter(t: StagedTransport, out: Buffer, x: Buffer, op: ReduceOp, seq: int) -> Body:
    """The reduce-scatter half of the ring, on a scratch copy of `x` (or the shared segment)."""

    def run(group: hostcoll.HostGroup, src: Any, res: Any, deadline: float) -> None:
        group.reduce_scatter(src, res, x.nbytes, x.dtype, op, deadline)

    ring = partial(_reduce_scatter_ring, t, out, x, op, seq)
    return _through_segment(t, "reduce_scatter", seq, x, out, ring, run, (x.dtype, op))


def _reduce_scatter_ring(
    t: StagedTransport, out: Buffer, x: Buffer, op: ReduceOp, seq: int
) -> Body:
    xr, orr = t._region(x), t._region(out)

    def body(deadline: float, ready: Any) -> None:
        local = _Local(t, ready)
        _ring(t, deadline)
        work = local.temp(xr.nbytes, xr)
        local.copy(work, xr)
        blocks = _blocks(work, x.count, t.size, x.itemsize)
        if t.size > 1:
            tmp = local.temp(blocks[0].nbytes, xr)
            _ring_reduce_scatter(t, seq, blocks, tmp, local, x.dtype, op, deadline, ready)
        local.copy(orr, blocks[t.rank])
        if op is ReduceOp.AVG:
            local.divide(orr, t.size, x.dtype)

    return body


def reduce(t: StagedTransport, x: Buffer, op: ReduceOp, root: int, seq: int) -> Body:
    """Ring reduce-scatter on a scratch copy, then every rank sends its reduced block to root
    (or the shared segment)."""
    ring = partial(_reduce_ring, t, x, op, root, seq)
    group = _segment(t, x.nbytes)
    if group is None:
        return ring()
    xr = t._region(x)

    def in_segment(deadline: float, ready: Any) -> None:
        assert group is not None
        src = _input(t, group, xr, ready)
        if t.rank != root:
            group.reduce(src, None, xr.nbytes, x.dtype, op, root, deadline)
            return
        with _output(t, xr, ready) as res:
            group.reduce(src, res, xr.nbytes, x.dtype, op, root, deadline)

    start = ("reduce", xr.host, xr.host, xr.nbytes, x.dtype, op, root)
    return _on_segment(t, f"reduce #{seq}", group, xr.nbytes, in_segment, ring, start)


def _reduce_ring(t: StagedTransport, x: Buffer, op: ReduceOp, root: int, seq: int) -> Body:
    xr = t._region(x)

    def body(deadline: float, ready: Any) -> None:
        local = _Local(t, ready)
        n, r = t.size, t.rank
        _ring(t, deadline, *(range(n) if r == root else [root]))
        work = local.temp(xr.nbytes, xr)
        local.copy(work, xr)
        blocks = _blocks(work, x.count, n, x.itemsize)
        if n > 1:
            tmp = local.temp(max(b.nbytes for b in blocks), xr)
            _ring_reduce_scatter(t, seq, blocks, tmp, local, x.dtype, op, deadline, ready)
        if r == root:
            final = _blocks(xr, x.count, n, x.itemsize)
            local.copy(final[r], blocks[r])
            for peer in range(n):
                if peer != r:
                    t.exchange(seq, n + peer, -1, None, peer, final[peer], deadline, ready)
            if op is ReduceOp.AVG:
                local.divide(xr, n, x.dtype)
        else:
            t.exchange(seq, n + r, root, blocks[r], -1, None, deadline, ready)

    return body


def broadcast(t: StagedTransport, x: Buffer, root: int, seq: int) -> Body:
    """A chain from the root, cut into segments so that every link of the chain is busy (or
    the shared segment)."""
    ring = partial(_broadcast_chain, t, x, root, seq)
    group = _segment(t, x.nbytes)
    if group is None:
        return ring()
    xr = t._region(x)

    def in_segment(deadline: float, ready: Any) -> None:
        assert group is not None
        if t.rank == root:
            group.broadcast(_input(t, group, xr, ready), None, xr.nbytes, root, deadline)
            return
        with _output(t, xr, ready) as res:
            group.broadcast(None, res, xr.nbytes, root, deadline)

    start = ("broadcast", xr.host, xr.host, xr.nbytes, "", None, root)
    return _on_segment(t, f"broadcast #{seq}", group, xr.nbytes, in_segment, ring, start)


def _broadcast_chain(t: StagedTransport, x: Buffer, root: int, seq: int) -> Body:
    xr = t._region(x)

    def body(deadline: float, ready: Any) -> None:
        n, r = t.size, t.rank
        _ring(t, deadline)
        pos = (r - root) % n
        seg = max(t.chunk_bytes, math.ceil(xr.nbytes / 16))
        segs = [xr.sub(off, k) for off, k in chunk_spans(xr.nbytes, seg)]
        left, right = (r - 1) % n, (r + 1) % n
        recvs = (
            [
                t.messages.post_recv(left, s, CTS_COLL, seq, k, deadline, ready)
                for k, s in enumerate(segs)
            ]
            if pos > 0
            else []
        )
        sends = []
        for k, s in enumerate(segs):
            if pos > 0:
                t.messages.finish_recv(recvs[k], deadline)
            if pos < n - 1:
                sends.append(t.messages.start_send(right, s, CTS_COLL, seq, k, deadline, ready))
        for op in sends:
            t.messages.finish_send(op, deadline)

    return body


def all_gather(t: StagedTransport, out: Buffer, x: Buffer, seq: int) -> Body:
    """Own block into place, then the all-gather half of the ring (or the shared segment)."""

    def run(group: hostcoll.HostGroup, src: Any, res: Any, deadline: float) -> None:
        group.all_gather(src, res, x.nbytes, deadline)

    ring = partial(_all_gather_ring, t, out, x, seq)
    return _through_segment(t, "all_gather", seq, x, out, ring, run)


def _all_gather_ring(t: StagedTransport, out: Buffer, x: Buffer, seq: int) -> Body:
    xr, orr = t._region(x), t._region(out)
    in_place = own_block(x, out, t.rank)  # x already is its block of out

    def body(deadline: float, ready: Any) -> None:
        local = _Local(t, ready)
        _ring(t, deadline)
        blocks = _blocks(orr, out.count, t.size, x.itemsize)
        if not in_place:
            local.copy(blocks[t.rank], xr)
        _ring_all_gather(t, seq, 0, blocks, deadline, ready)

    return body


def all_to_all(t: StagedTransport, out: Buffer, x: Buffer, seq: int) -> Body:
    """Pairwise exchange: at step s, send to rank r+s while receiving from rank r-s (or the
    shared segment)."""

    def run(group: hostcoll.HostGroup, src: Any, res: Any, deadline: float) -> None:
        group.all_to_all(src, res, x.nbytes, deadline)

    ring = partial(_all_to_all_pairs, t, out, x, seq)
    return _through_segment(t, "all_to_all", seq, x, out, ring, run)


def _all_to_all_pairs(t: StagedTransport, out: Buffer, x: Buffer, seq: int) -> Body:
    xr, orr = t._region(x), t._region(out)

    def body(deadline: float, ready: Any) -> None:
        local = _Local(t, ready)
        n, r = t.size, t.rank
        t.channels(list(range(n)), deadline)
        xs = _blocks(xr, x.count, n, x.itemsize)
        os_ = _blocks(orr, out.count, n, x.itemsize)
        local.copy(os_[r], xs[r])
        for s in range(1, n):
            dst, src = (r + s) % n, (r - s) % n
            t.exchange(seq, s, dst, xs[dst], src, os_[src], deadline, ready)

    return body


# ---- one host's ranks: the shared segment (hetcomm.transports.hostcoll) --------------------

# Collectives whose input is at most this many bytes per rank go through the group's shared
# segment where every rank of the group is on this host (and HETCOMM_RAILS is not `mpi`, which
# asks for MPI messages). In a group of CPU ranks: on the 2-core CPU machine, 4 ranks, host
# all_reduce, the segment took 1.1-6x less time than the rings at every size from 8 B to 16 MiB
# (measured in interleaved rounds on a loaded machine; docs/staged.md, "Collectives"). Above
# it the segment would hold 2 x 16 MiB per rank of /dev/shm. In a group
# with GPUs, device data crosses to the host and is reduced there, where the rings reduce on
# the GPU: up to DEVICE_SEGMENT_MAX_BYTES only (the sizes of the H200 goals, 1 and 64 KiB, are
# well inside; where the two cross on a GPU machine has not been measured). The limit depends on
# the group alone, not on the memory of one rank's call: ranks of one collective may pass host
# and device arrays, and must all take the same way.
SEGMENT_MAX_BYTES = hostcoll.MAX_BYTES
DEVICE_SEGMENT_MAX_BYTES = 1 << 20

# the segment of each staged transport and the largest operation it takes (None: its group
# cannot have one); weak, so that a transport's segment goes with it
_GROUPS: weakref.WeakKeyDictionary[StagedTransport, tuple[hostcoll.HostGroup, int] | None] = (
    weakref.WeakKeyDictionary()
)
_GROUPS_LOCK = threading.Lock()


def close_segment(t: StagedTransport) -> None:
    """Unregister and unmap `t`'s segment, when the transport closes: left to the garbage
    collector, the pages were unmapped still registered with the GPU, and a later segment
    mapped at the same address failed to register (cudaErrorHostMemoryAlreadyRegistered,
    tests/gpu/test_staged_gpu.py on the H200)."""
    with _GROUPS_LOCK:
        found = _GROUPS.pop(t, None)
    if found is not None:
        found[0].close()


def _segment(t: StagedTransport, nbytes: int) -> hostcoll.HostGroup | None:
    """The shared segment an operation of `nbytes` per rank takes, or None (the rings): a
    choice of the signature and the group alone, so every rank makes the same one."""
    if nbytes <= 0:
        return None
    with _GROUPS_LOCK:
        if t in _GROUPS:
            found = _GROUPS[t]
        else:
            found = _GROUPS[t] = _new_segment(t)
    if found is None or nbytes > found[1]:
        return None
    return found[0]


def _new_segment(t: StagedTransport) -> tuple[hostcoll.HostGroup, int] | None:
    topology = t.comm.topology
    if t.mode == "mpi" or hostcoll.unavailable(topology) is not None:
        return None
    ref = weakref.ref(t)

    def closed() -> bool:
        transport = ref()
        return transport is None or transport.closed

    gpus = any(r.vendor != "cpu" or r.detected_vendor != "cpu" for r in topology.ranks)
    limit = DEVICE_SEGMENT_MAX_BYTES if gpus else SEGMENT_MAX_BYTES
    return hostcoll.HostGroup(t.rank, t.size, t.svc, tags.HOSTCOLL, closed), limit


def _on_segment(
    t: StagedTransport,
    what: str,
    group: hostcoll.HostGroup,
    nbytes: int,
    body: Body,
    ring: Callable[[], Body],
    start: tuple[Any, ...],
) -> Body:
    """`body` in the segment at this operation's turn (drawn now, in the group's order of
    operations); `ring()`'s body (made then) where the segment cannot take it (every rank
    finds so together). `what`: the operation and its sequence number, for errors; `start`:
    HostGroup.start's arguments after the ticket, for a start on the issuing thread (used
    where both arrays are host memory)."""
    return _SegmentBody(t, what, group, nbytes, body, ring, start)


class _SegmentBody:
    """A collective's body through the shared segment at its turn (see _on_segment), and
    `start()`: the same operation begun on the issuing thread where it can begin without
    waiting (HostGroup.start), else None (the body then runs, on a driver or the waiter)."""

    __slots__ = ("body", "group", "nbytes", "ring", "start_args", "t", "ticket", "what")

    def __init__(
        self,
        t: StagedTransport,
        what: str,
        group: hostcoll.HostGroup,
        nbytes: int,
        body: Body,
        ring: Callable[[], Body],
        start: tuple[Any, ...],
        ticket: int | None = None,
    ) -> None:
        self.t, self.what, self.group, self.nbytes = t, what, group, nbytes
        self.body, self.ring, self.start_args = body, ring, start
        # its turn: drawn now, where the operation is issued, unless drawn already
        self.ticket = group.ticket() if ticket is None else ticket

    def __call__(self, deadline: float, ready: Any) -> None:
        t, group = self.t, self.group
        try:
            if group.run(self.ticket, deadline, self.nbytes, self.body, deadline, ready):
                return
        except hostcoll.Late as exc:
            raise PeerTimeout(exc.ranks, str(exc)) from None
        except hostcoll.Dead as exc:
            raise PeerLost(f"group '{t.comm.name}': {self.what}: {exc}", exc.ranks) from None
        self.ring()(deadline, ready)

    def start(self) -> hostcoll.Posted | None:
        x, out = self.start_args[1:3]  # host arrays, None for device memory
        if x is None or out is None:
            return None
        return self.group.start(self.ticket, *self.start_args)


def _input(
    t: StagedTransport, group: hostcoll.HostGroup, region: Region, ready: Any
) -> np.ndarray | None:
    """Host input as it is (the segment copies it in); device input copied into this rank's
    half of the segment here, after the caller's queued work (None: it is there)."""
    if region.host is not None:
        return region.host
    group.register_with_gpu(t.gpu.device)
    if region.nbytes:
        t.gpu.copy_to_host(group.mine(region.nbytes), region, ready)
    return None


@contextlib.contextmanager
def _output(t: StagedTransport, region: Region, ready: Any) -> Iterator[np.ndarray]:
    """Where the segment writes a result: host output itself, or for device output a pinned
    buffer copied to the device afterwards (waited for, as every staged copy is)."""
    if region.host is not None:
        yield region.host
        return
    with t.gpu.bounce(region.nbytes) as buf:
        yield buf
        if region.nbytes:
            t.gpu.copy_from_host(region, buf, ready)


_SEGMENT_OPS = frozenset(
    ("all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all")
)


def stages_input(t: StagedTransport, op: str, nbytes: int) -> bool:
    """Whether `op` with `nbytes` of input per rank, issued now, runs in the shared segment as
    it stands, which copies every rank's whole input in before any output is written (so an
    output that overlaps the input in any way is served as it is). Only where the segment
    holds the size already: one that must grow first may fall back to the rings (every rank
    at that call), which read their input while they write. A choice of this rank alone:
    ranks that choose differently still meet in the segment or in the rings alike."""
    if op not in _SEGMENT_OPS:
        return False
    group = _segment(t, nbytes)
    return group is not None and group.holds(nbytes)


def prepare(
    t: StagedTransport,
    op: str,
    x: Buffer | None,
    out: Buffer | None,
    rop: ReduceOp | None,
    root: int,
) -> Callable[..., bool] | None:
    """The blocking call of one signature on host arrays, run in the shared segment on the
    calling thread with no Work (the contract of MpiTransport.prepare, the same arguments: the
    arrays, then the sequence number). None where the group or the size do not allow it; the
    general path of the same signature goes through the segment too (on a driver thread), so
    that ranks that take different paths still meet there. A call returns False, having moved
    nothing, where the segment could not grow to its size (every rank does at that call).
    Each call copies its whole input into the segment before it writes any output, so the
    in-place forms (an output that overlaps the input) are served as they are (`in_place`)."""
    found = _segment_calls(t, op, x, out, rop, root)
    if found is None:
        return None
    group, nbytes, calls = found

    def run(*arrays_and_seq: Any) -> bool:
        seq = arrays_and_seq[-1]
        fn, args, _ = calls(*arrays_and_seq[:-1])
        timeout = t.limit()
        deadline = time.monotonic() + timeout
        try:
            return group.run(group.ticket(), deadline, nbytes, fn, *args, deadline)
        except hostcoll.Late as exc:
            err: BaseException = CommTimeout(
                t.comm.name, op, seq, timeout, exc.ranks or None, str(exc)
            )
        except hostcoll.Dead as exc:
            err = PeerLost(f"group '{t.comm.name}': {op} #{seq}: {exc}", exc.ranks)
        t.comm._abort(err)
        raise err

    if op in ("reduce_scatter", "all_gather", "all_to_all"):
        run.in_place = True  # type: ignore[attr-defined]
    return run


def prepare_async(
    t: StagedTransport,
    op: str,
    x: Buffer | None,
    out: Buffer | None,
    rop: ReduceOp | None,
    root: int,
) -> Callable[..., Work] | None:
    """The asynchronous start of one signature on host arrays in the shared segment (the
    contract of MpiTransport.prepare_async: prepare's arguments, a Work back), None where
    prepare has none. It takes its turn at the segment now and begins there on the calling
    thread where it can (HostGroup.start: its input is in, this rank has arrived), as the
    general path's start does; else its body runs at its turn on a driver thread, and where
    the segment cannot grow to its size, the general path's ring (on a copy of an input that
    overlaps the output: the rings read while they write)."""
    found = _segment_calls(t, op, x, out, rop, root)
    if found is None:
        return None
    group, nbytes, calls = found

    def start(*arrays_and_seq: Any) -> Work:
        seq, arrays = arrays_and_seq[-1], arrays_and_seq[:-1]
        fn, args, begin = calls(*arrays)
        ticket = group.ticket()
        posted = group.start(ticket, *begin)
        if posted is not None:
            return t._started(op, seq, nbytes, posted)

        def in_segment(deadline: float, ready: Any) -> None:
            fn(*args, deadline)

        ring = partial(_ring_of, t, op, arrays, rop, root, seq)
        body = _SegmentBody(t, f"{op} #{seq}", group, nbytes, in_segment, ring, begin, ticket)
        return t._on_driver(op, seq, nbytes, body, None)

    return start


def _segment_calls(
    t: StagedTransport,
    op: str,
    x: Buffer | None,
    out: Buffer | None,
    rop: ReduceOp | None,
    root: int,
) -> tuple[hostcoll.HostGroup, int, Callable[..., tuple[Callable[..., None], tuple, tuple]]] | None:
    """For prepare and prepare_async: the segment a signature of host arrays takes, its bytes
    per rank, and `calls(*arrays)`: the segment's call of those arrays (its function and
    arguments, the deadline to follow) and HostGroup.start's arguments after the ticket. None
    where the op, the memory, the group or the size keep it out of the segment."""
    if op not in _SEGMENT_OPS or x is None or x.host is None:
        return None
    if out is not None and out.host is None:
        return None
    nbytes, dtype = x.nbytes, x.dtype
    group = _segment(t, nbytes)
    if group is None:
        return None
    at_root = t.rank == root
    calls: Callable[..., tuple[Callable[..., None], tuple, tuple]]
    if op == "all_reduce":

        def calls(xh: np.ndarray, oh: np.ndarray) -> tuple[Callable[..., None], tuple, tuple]:
            fx = _flat(xh)
            fo = fx if oh is xh else _flat(oh)
            args = (fx, fo, nbytes, dtype, rop)
            return group.all_reduce, args, ("all_reduce", fx, fo, nbytes, dtype, rop, -1)

    elif op == "reduce":

        def calls(xh: np.ndarray) -> tuple[Callable[..., None], tuple, tuple]:
            flat = _flat(xh)
            args = (flat, flat if at_root else None, nbytes, dtype, rop, root)
            return group.reduce, args, ("reduce", flat, flat, nbytes, dtype, rop, root)

    elif op == "broadcast":

        def calls(xh: np.ndarray) -> tuple[Callable[..., None], tuple, tuple]:
            flat = _flat(xh)
            src, dst = (flat, None) if at_root else (None, flat)
            args = (src, dst, nbytes, root)
            return group.broadcast, args, ("broadcast", flat, flat, nbytes, "", None, root)

    elif op == "reduce_scatter":

        def calls(xh: np.ndarray, oh: np.ndarray) -> tuple[Callable[..., None], tuple, tuple]:
            fx, fo = _flat(xh), _flat(oh)
            args = (fx, fo, nbytes, dtype, rop)
            return group.reduce_scatter, args, ("reduce_scatter", fx, fo, nbytes, dtype, rop, -1)

    else:
        blocks = group.all_gather if op == "all_gather" else group.all_to_all

        def calls(xh: np.ndarray, oh: np.ndarray) -> tuple[Callable[..., None], tuple, tuple]:
            fx, fo = _flat(xh), _flat(oh)
            return blocks, (fx, fo, nbytes), (op, fx, fo, nbytes, "", None, -1)

    return group, nbytes, calls


def _ring_of(
    t: StagedTransport,
    op: str,
    arrays: tuple[np.ndarray, ...],
    rop: ReduceOp | None,
    root: int,
    seq: int,
) -> Body:
    """The general path's ring body of a prepared start's host arrays (as prepare_async
    passes them: x, then the output where there is one), for a segment that could not grow
    to the operation's size (nothing has moved yet: every rank finds so at that turn)."""
    if op in ("reduce", "broadcast"):
        x = as_buffer(arrays[0])
        if op == "reduce":
            assert rop is not None
            return _reduce_ring(t, x, rop, root, seq)
        return _broadcast_chain(t, x, root, seq)
    xh, oh = arrays
    inplace = op == "all_reduce" and xh is oh  # the one in-place form its ring serves as it is
    if not inplace and np.may_share_memory(xh, oh):
        xh = xh.copy()  # the other rings read the input while they write the output
    x = as_buffer(xh)
    out = x if inplace else as_buffer(oh)
    if op == "all_reduce":
        assert rop is not None
        return _all_reduce_ring(t, x, out, rop, seq)
    if op == "reduce_scatter":
        assert rop is not None
        return _reduce_scatter_ring(t, out, x, rop, seq)
    if op == "all_gather":
        return _all_gather_ring(t, out, x, seq)
    return _all_to_all_pairs(t, out, x, seq)


def _flat(a: np.ndarray) -> np.ndarray:
    """The bytes of a contiguous array, as a flat uint8 view."""
    return a.reshape(-1).view(np.uint8)
