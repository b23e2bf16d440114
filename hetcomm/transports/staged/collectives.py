"""Collectives of the staged transport: rings (and a pipelined chain) of staged messages, and
for groups of one host, one shared segment (segment.py, hetcomm.transports.hostcoll): each
collective's body is the segment's where the group and the size allow, else the rings'."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from ...arrays import Buffer, as_buffer, own_block
from ...dtypes import TABLE
from ...ops import ReduceOp
from .. import hostcoll, local
from ..local import Region
from .cts import CTS_COLL
from .schedule import block_spans, chunk_spans
from .segment import Body, SegmentBody, segment_for, segment_input, segment_output

if TYPE_CHECKING:
    from .transport import StagedTransport


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


def all_reduce_arrays(
    t: StagedTransport, spans: list[tuple[int, int]], dtype: str, op: ReduceOp, seq: int
) -> Body:
    """all_reduce_coalesced of device arrays in place, at `spans` ((address, bytes) each):
    each array copied between the device and its place in the shared segment (the rank's
    input, then the result) where the segment takes the total, with no pack or unpack kernel
    (on a GPU the ranks share, a kernel in each process makes the GPU switch between their
    contexts); else copied into one device buffer, reduced by the rings and copied back.
    Ranks that pack instead meet this one in the segment or the rings alike: the bytes are
    laid out the same."""
    total = sum(n for _, n in spans)
    places = list(zip(spans, itertools.accumulate((n for _, n in spans), initial=0)))

    def ring() -> Body:
        def body(deadline: float, ready: Any) -> None:
            if not total:
                return  # every rank's arrays are empty (the check compared the totals)
            gpu = t.gpu
            mem, ptr = gpu.alloc(total)
            fused = Region(total, None, ptr, mem)
            for (p, n), at in places:
                if n:
                    gpu.copy_device(fused.sub(at, n), Region(n, None, p), ready)
            item = TABLE[dtype].itemsize
            buf = Buffer(
                obj=mem,
                kind="cupy",
                dtype=dtype,
                shape=(total // item,),
                device="cuda",
                device_index=gpu.device,
                ptr=ptr,
                contiguous=True,
                readonly=False,
                host=None,
            )
            _all_reduce_ring(t, buf, buf, op, seq)(deadline, None)
            for (p, n), at in places:
                if n:
                    gpu.copy_device(Region(n, None, p), fused.sub(at, n), None)

        return body

    group = segment_for(t, total)
    if group is None:
        return ring()

    def in_segment(deadline: float, ready: Any) -> None:
        gpu = t.gpu
        group.register_with_gpu(gpu.device)
        mine = group.mine(total)
        last = None
        for (p, n), at in places:  # in order on one stream: the last one's end is every one's
            if n:
                last = gpu.copy_to_host_async(mine[at : at + n], Region(n, None, p), ready)
        if last is not None:
            last.synchronize()
        with gpu.bounce(total) as res:
            group.all_reduce(None, res, total, dtype, op, deadline)
            for (p, n), at in places:
                if n:
                    last = gpu.copy_from_host_async(Region(n, None, p), res[at : at + n], None)
            if last is not None:
                last.synchronize()  # before the bounce buffer goes back

    start = ("all_reduce", None, None, total, dtype, op, -1)
    what = f"all_reduce_coalesced #{seq}"
    return SegmentBody(t, what, group, total, in_segment, ring, start)


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
    group = segment_for(t, x.nbytes)
    if group is None:
        return ring()
    xr, orr = t._region(x), t._region(out)

    def in_segment(deadline: float, ready: Any) -> None:
        src = segment_input(t, group, xr, ready)
        with segment_output(t, orr, ready) as res:
            run(group, src, res, deadline)

    dtype, rop = reduction or ("", None)
    start = (name, xr.host, orr.host, xr.nbytes, dtype, rop, -1)
    return SegmentBody(t, f"{name} #{seq}", group, xr.nbytes, in_segment, ring, start)


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
    group = segment_for(t, x.nbytes)
    if group is None:
        return ring()
    xr = t._region(x)

    def in_segment(deadline: float, ready: Any) -> None:
        assert group is not None
        src = segment_input(t, group, xr, ready)
        if t.rank != root:
            group.reduce(src, None, xr.nbytes, x.dtype, op, root, deadline)
            return
        with segment_output(t, xr, ready) as res:
            group.reduce(src, res, xr.nbytes, x.dtype, op, root, deadline)

    start = ("reduce", xr.host, xr.host, xr.nbytes, x.dtype, op, root)
    return SegmentBody(t, f"reduce #{seq}", group, xr.nbytes, in_segment, ring, start)


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
    group = segment_for(t, x.nbytes)
    if group is None:
        return ring()
    xr = t._region(x)

    def in_segment(deadline: float, ready: Any) -> None:
        assert group is not None
        if t.rank == root:
            group.broadcast(segment_input(t, group, xr, ready), None, xr.nbytes, root, deadline)
            return
        with segment_output(t, xr, ready) as res:
            group.broadcast(None, res, xr.nbytes, root, deadline)

    start = ("broadcast", xr.host, xr.host, xr.nbytes, "", None, root)
    return SegmentBody(t, f"broadcast #{seq}", group, xr.nbytes, in_segment, ring, start)


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
                t.messages.post_recv(left, s, CTS_COLL, seq, k, deadline, ready, driven=True)
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
                op = t.messages.start_send(right, s, CTS_COLL, seq, k, deadline, ready, driven=True)
                sends.append(op)
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


def ring_of(
    t: StagedTransport,
    op: str,
    arrays: tuple[np.ndarray, ...],
    rop: ReduceOp | None,
    root: int,
    seq: int,
) -> Body:
    """The ring body of a prepared start's host arrays (as segment.prepare_async passes them:
    x, then the output where there is one), for a segment that could not grow to the
    operation's size (nothing has moved yet: every rank finds so at that turn)."""
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
