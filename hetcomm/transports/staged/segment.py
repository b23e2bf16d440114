"""Collectives among the ranks of one host through the group's shared segment
(hetcomm.transports.hostcoll), for the staged transport: which segment a signature takes, a
collective's body there at its turn (the general path's, chosen in collectives.py beside the
rings), and the prepared calls of host arrays: a blocking run on the calling thread and an
asynchronous start, both through one mapping of the arrays to the segment's call."""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import CommTimeout, PeerLost
from ...ops import ReduceOp
from .. import hostcoll, tags
from ..local import Region, flat_bytes
from .ops import PeerTimeout

if TYPE_CHECKING:
    from ...arrays import Buffer
    from ...work import Work
    from .transport import StagedTransport

Body = Callable[[float, Any], None]

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


def segment_for(t: StagedTransport, nbytes: int) -> hostcoll.HostGroup | None:
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


class SegmentBody:
    """A collective's `body` in the segment at its turn (drawn when it is made, in the group's
    order of operations, unless given); `ring()`'s body (made then) where the segment cannot
    take it (every rank finds so together). `what`: the operation and its sequence number,
    for errors. `start()`: the same operation begun on the issuing thread where it can begin
    without waiting (HostGroup.start, with `start`'s arguments after the ticket, where both
    arrays are host memory), else None (the body then runs, on a driver or the waiter)."""

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
        """Run the body in the segment at its turn, else (the segment cannot take it) the
        ring's."""
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
        """Begin it on the issuing thread (HostGroup.start) where its arrays are host memory
        and its turn allows; else None."""
        x, out = self.start_args[1:3]  # host arrays, None for device memory
        if x is None or out is None:
            return None
        return self.group.start(self.ticket, *self.start_args)


def segment_input(
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
def segment_output(t: StagedTransport, region: Region, ready: Any) -> Iterator[np.ndarray]:
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
    group = segment_for(t, nbytes)
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

        from .collectives import ring_of  # the rings (collectives.py) use this module

        ring = partial(ring_of, t, op, arrays, rop, root, seq)
        body = SegmentBody(t, f"{op} #{seq}", group, nbytes, in_segment, ring, begin, ticket)
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
    group = segment_for(t, nbytes)
    if group is None:
        return None
    at_root = t.rank == root
    calls: Callable[..., tuple[Callable[..., None], tuple, tuple]]
    if op == "all_reduce":

        def calls(xh: np.ndarray, oh: np.ndarray) -> tuple[Callable[..., None], tuple, tuple]:
            fx = flat_bytes(xh)
            fo = fx if oh is xh else flat_bytes(oh)
            args = (fx, fo, nbytes, dtype, rop)
            return group.all_reduce, args, ("all_reduce", fx, fo, nbytes, dtype, rop, -1)

    elif op == "reduce":

        def calls(xh: np.ndarray) -> tuple[Callable[..., None], tuple, tuple]:
            flat = flat_bytes(xh)
            args = (flat, flat if at_root else None, nbytes, dtype, rop, root)
            return group.reduce, args, ("reduce", flat, flat, nbytes, dtype, rop, root)

    elif op == "broadcast":

        def calls(xh: np.ndarray) -> tuple[Callable[..., None], tuple, tuple]:
            flat = flat_bytes(xh)
            src, dst = (flat, None) if at_root else (None, flat)
            args = (src, dst, nbytes, root)
            return group.broadcast, args, ("broadcast", flat, flat, nbytes, "", None, root)

    elif op == "reduce_scatter":

        def calls(xh: np.ndarray, oh: np.ndarray) -> tuple[Callable[..., None], tuple, tuple]:
            fx, fo = flat_bytes(xh), flat_bytes(oh)
            args = (fx, fo, nbytes, dtype, rop)
            return group.reduce_scatter, args, ("reduce_scatter", fx, fo, nbytes, dtype, rop, -1)

    else:
        blocks = group.all_gather if op == "all_gather" else group.all_to_all

        def calls(xh: np.ndarray, oh: np.ndarray) -> tuple[Callable[..., None], tuple, tuple]:
            fx, fo = flat_bytes(xh), flat_bytes(oh)
            return blocks, (fx, fo, nbytes), (op, fx, fo, nbytes, "", None, -1)

    return group, nbytes, calls
