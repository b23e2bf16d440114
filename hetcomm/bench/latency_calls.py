"""The buffers and calls of `hetcomm bench --latency` (latency.py): the arrays each row works
on, their fill and check against a float64 reference, and each implementation's calls of one op
form (hetcomm, raw mpi4py, torch.distributed), alternating two buffer sets."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np

from .impls import Case
from .timing import Run

#: the root of the rooted op forms
ROOT = 0
_TOLERANCE = {"float32": 1e-6, "float64": 1e-12}
#: arrays of an all_reduce_coalesced row: the row's bytes split into this many arrays
COALESCED_ARRAYS = 4


# ---- buffers --------------------------------------------------------------------------------


class Arrays:
    """Allocation and synchronisation for one kind of memory: numpy on the host, CuPy on the
    GPU of this rank."""

    def __init__(self, device: str) -> None:
        self.device = device
        if device == "cuda":
            import cupy

            self.xp: Any = cupy
        else:
            self.xp = np

    def zeros(self, count: int, dtype: str) -> Any:
        return self.xp.zeros(count, dtype=dtype)

    def put(self, dst: Any, values: np.ndarray) -> None:
        """Copy float64 `values` into `dst` (converted to dst's dtype)."""
        dst[...] = self.xp.asarray(values.astype(dst.dtype))

    def host(self, a: Any) -> np.ndarray:
        return a.get() if self.device == "cuda" else np.asarray(a)

    def sync(self) -> None:
        """Wait for every queued GPU operation (nothing on the host)."""
        if self.device == "cuda":
            self.xp.cuda.runtime.deviceSynchronize()


class Buffers:
    """One buffer set of an (op, form) at `count` elements: `x` the input, `y` the output, and
    for in-place forms the views the call takes."""

    def __init__(
        self, arrays: Arrays, op: str, form: str, count: int, dtype: str, rank: int, ranks: int
    ) -> None:
        z = arrays.zeros
        self.op, self.form, self.count, self.rank, self.ranks = op, form, count, rank, ranks
        self.x: Any = None
        self.y: Any = None
        self.pieces: list[Any] = []
        block = count // ranks
        self.block = block
        if op in ("all_reduce", "all_to_all", "sendrecv"):
            self.x, self.y = z(count, dtype), z(count, dtype)
        elif op == "all_gather_single":
            self.x, self.y = z(block, dtype), z(count, dtype)
        elif op in ("reduce", "broadcast"):
            self.x = z(count, dtype)
        elif op == "all_gather":
            self.y = z(count, dtype)
            mine = self.y[rank * block : (rank + 1) * block]
            self.x = mine if form == "in-place" else z(block, dtype)
        elif op == "reduce_scatter":
            self.x = z(count, dtype)
            mine = self.x[rank * block : (rank + 1) * block]
            self.y = mine if form == "in-place" else z(block, dtype)
        elif op == "all_reduce_coalesced":
            sizes = np.array_split(np.arange(count), min(COALESCED_ARRAYS, count))
            self.pieces = [z(len(s), dtype) for s in sizes]
        elif op != "barrier":
            raise ValueError(f"no buffers for op {op!r}")


def _case(op: str, count: int, dtype: str, rank: int, ranks: int) -> Case:
    base = {"all_reduce_coalesced": "all_reduce", "all_gather_single": "all_gather"}
    return Case(base.get(op, op), count, dtype, "sum", ROOT, rank, ranks)


def fill(arrays: Arrays, b: Buffers, dtype: str) -> None:
    """Put the check's inputs (impls.Case) into `b`; outputs get -1, a value no result has."""
    case = _case(b.op, b.count, dtype, b.rank, b.ranks)
    mine = case.input(b.rank)
    if b.op == "all_reduce_coalesced":
        for piece, values in zip(b.pieces, np.array_split(mine, len(b.pieces))):
            arrays.put(piece, values)
        return
    if b.op == "barrier":
        return
    if b.y is not None and not (b.op == "reduce_scatter" and b.form == "in-place"):
        arrays.put(b.y, np.full(b.y.shape, -1.0))
    arrays.put(b.x, mine)


def wrong(arrays: Arrays, b: Buffers, dtype: str, peer: int | None) -> int:
    """Elements of b's result that differ from the float64 reference."""
    if b.op == "barrier":
        return 0
    case = _case(b.op, b.count, dtype, b.rank, b.ranks)
    if b.op == "sendrecv":
        if peer is None:
            return 0
        want: np.ndarray | None = case.input(peer)
    else:
        want = case.expected()
    if want is None:
        return 0
    if b.op == "all_reduce_coalesced":
        got = np.concatenate([arrays.host(p) for p in b.pieces]).astype(np.float64)
    else:
        got = arrays.host(result(b)).astype(np.float64).ravel()
    if got.shape != want.shape:
        return int(max(got.size, want.size))
    if dtype in _TOLERANCE:
        return int(np.count_nonzero(~np.isclose(got, want, rtol=_TOLERANCE[dtype], atol=0)))
    return int(np.count_nonzero(got != want))


def result(b: Buffers) -> Any:
    """The array that holds b's result: x for the in-place forms that write x, else y (for
    all_gather and reduce_scatter in place, y is the view into the one buffer)."""
    if (
        b.op in ("reduce", "broadcast")
        or (b.op == "all_reduce" and b.form in ("in-place", "async"))
        or (b.op == "all_to_all" and b.form == "in-place")
    ):
        return b.x
    return b.y


# ---- the calls: hetcomm, mpi4py, gloo -------------------------------------------------------


def _pair(sets: Sequence[Any]) -> Callable[[int], Any]:
    a, b = sets
    return lambda i: b if i & 1 else a


def pingpong_peer(rank: int, ranks: int) -> int | None:
    """The partner of `rank` in the ping-pong (2k with 2k+1); None for a last odd rank."""
    peer = rank ^ 1
    return peer if peer < ranks else None


def _pingpong(
    send: Callable[[Any, int], Any],
    recv: Callable[[Any, int], Any],
    sets: Sequence[Any],
    rank: int,
    ranks: int,
) -> Run:
    """The sendrecv row: ranks 2k and 2k+1 send each other `x` and receive `y` in turn (2k
    first), alternating the buffer sets; a last odd rank sits out."""
    pick, peer, first = _pair(sets), pingpong_peer(rank, ranks), rank % 2 == 0

    def pingpong(calls: int) -> None:
        if peer is None:
            return
        for i in range(calls):
            s = pick(i)
            if first:
                send(s.x, peer)
                recv(s.y, peer)
            else:
                recv(s.y, peer)
                send(s.x, peer)

    return pingpong


def _waited(call: Callable[..., Any]) -> Callable[[Any, int], Any]:
    """A send or receive made asynchronous and waited for at once."""
    return lambda a, peer: call(a, peer, async_op=True).wait()


def _exchange(
    call: Callable[[Any, int], Any],
    sets: Sequence[Any],
    rank: int,
    ranks: int,
    each: Callable[[], Any] = lambda: None,
) -> Run:
    """The exchange row: ranks 2k and 2k+1 each send `x` to the other and receive `y` from it
    in one call (`call(buffers, peer)`), alternating the buffer sets; a last odd rank sits
    out. `each` runs after every call (the device's synchronize)."""
    pick, peer = _pair(sets), pingpong_peer(rank, ranks)

    def exchange(calls: int) -> None:
        if peer is None:
            return
        for i in range(calls):
            call(pick(i), peer)
            each()

    return exchange


def hetcomm_run(
    comm: Any, op: str, form: str, sets: Sequence[Any], sync: Callable[[], Any], device: bool
) -> Run:
    """`calls` calls of one op form on a hetcomm Communicator, alternating the buffer sets."""
    pick, root = _pair(sets), ROOT
    each: Callable[[], Any] = sync if device else (lambda: None)
    if op == "sendrecv":
        if form.startswith("exchange"):
            waited = form == "exchange-async"

            def exchange(s: Buffers, peer: int) -> None:
                work = comm.sendrecv(s.x, peer, s.y, peer, async_op=waited)
                if work is not None:
                    work.wait()

            return _exchange(exchange, sets, comm.rank, comm.size, each)
        send, receive = (
            (comm.send, comm.recv)
            if form == "ping-pong"
            else (_waited(comm.send), _waited(comm.recv))
        )

        def received(y: Any, peer: int) -> None:
            receive(y, peer)
            sync()  # the device's copy is done before the next message

        return _pingpong(send, received if device else receive, sets, comm.rank, comm.size)
    calls_of: dict[tuple[str, str], Callable[[Buffers], Any]] = {
        ("all_reduce", "in-place"): lambda s: comm.all_reduce(s.x),
        ("all_reduce", "out-of-place"): lambda s: comm.all_reduce(s.x, out=s.y),
        ("reduce", "in-place"): lambda s: comm.reduce(s.x, root),
        ("broadcast", "in-place"): lambda s: comm.broadcast(s.x, root),
        ("all_gather", "out-of-place"): lambda s: comm.all_gather(s.y, s.x),
        ("all_gather", "in-place"): lambda s: comm.all_gather(s.y, s.x),
        ("reduce_scatter", "out-of-place"): lambda s: comm.reduce_scatter(s.y, s.x),
        ("reduce_scatter", "in-place"): lambda s: comm.reduce_scatter(s.y, s.x),
        ("all_to_all", "out-of-place"): lambda s: comm.all_to_all(s.y, s.x),
        ("all_to_all", "in-place"): lambda s: comm.all_to_all(s.x, s.x),
        ("all_reduce_coalesced", "in-place"): lambda s: comm.all_reduce_coalesced(s.pieces),
        ("barrier", "-"): lambda s: comm.barrier(),
        ("all_reduce", "async"): lambda s: comm.all_reduce(s.x, async_op=True).wait(),
        ("broadcast", "async"): lambda s: comm.broadcast(s.x, root, async_op=True).wait(),
        ("all_gather", "async"): lambda s: comm.all_gather(s.y, s.x, async_op=True).wait(),
        ("reduce", "async"): lambda s: comm.reduce(s.x, root, async_op=True).wait(),
        ("reduce_scatter", "async"): (
            lambda s: comm.reduce_scatter(s.y, s.x, async_op=True).wait()
        ),
        ("all_to_all", "async"): lambda s: comm.all_to_all(s.y, s.x, async_op=True).wait(),
    }
    one = calls_of[(op, form)]

    def run(calls: int) -> None:
        for i in range(calls):
            one(pick(i))
            each()

    return run


def mpi4py_run(raw: Any, op: str, form: str, sets: Sequence[Buffers]) -> Run:
    """The same op form as raw mpi4py on host buffers: MPI.IN_PLACE in place, two buffers out
    of place, Send/Recv ping-pong, Barrier; all_reduce_coalesced packs, reduces, unpacks."""
    from mpi4py import MPI

    pick, root, rank, ranks = _pair(sets), ROOT, raw.Get_rank(), raw.Get_size()
    inplace = MPI.IN_PLACE
    if op == "sendrecv":
        if form == "exchange":
            return _exchange(
                lambda s, peer: raw.Sendrecv(s.x, peer, recvbuf=s.y, source=peer), sets, rank, ranks
            )
        if form == "exchange-async":
            return _exchange(
                lambda s, peer: MPI.Request.Waitall([raw.Irecv(s.y, peer), raw.Isend(s.x, peer)]),
                sets,
                rank,
                ranks,
            )
        if form == "async":
            return _pingpong(
                lambda x, peer: raw.Isend(x, peer).Wait(),
                lambda y, peer: raw.Irecv(y, peer).Wait(),
                sets,
                rank,
                ranks,
            )
        return _pingpong(raw.Send, raw.Recv, sets, rank, ranks)
    if op == "all_reduce_coalesced":
        flats = [np.empty(sum(p.size for p in s.pieces), s.pieces[0].dtype) for s in sets]

        def coalesced(calls: int) -> None:
            for i in range(calls):
                s, flat = pick(i), flats[i & 1]
                np.concatenate(s.pieces, out=flat)
                raw.Allreduce(inplace, flat)
                at = 0
                for p in s.pieces:
                    p[...] = flat[at : at + p.size]
                    at += p.size

        return coalesced
    calls_of: dict[tuple[str, str], Callable[[Buffers], Any]] = {
        ("all_reduce", "in-place"): lambda s: raw.Allreduce(inplace, s.x),
        ("all_reduce", "out-of-place"): lambda s: raw.Allreduce(s.x, s.y),
        ("reduce", "in-place"): (
            (lambda s: raw.Reduce(inplace, s.x, root=root))
            if rank == root
            else (lambda s: raw.Reduce(s.x, None, root=root))
        ),
        ("broadcast", "in-place"): lambda s: raw.Bcast(s.x, root=root),
        ("all_gather", "out-of-place"): lambda s: raw.Allgather(s.x, s.y),
        ("all_gather", "in-place"): lambda s: raw.Allgather(inplace, s.y),
        ("reduce_scatter", "out-of-place"): lambda s: raw.Reduce_scatter_block(s.x, s.y),
        # MPI's in-place reduce_scatter leaves the result in the first block of x
        ("reduce_scatter", "in-place"): lambda s: raw.Reduce_scatter_block(inplace, s.x),
        ("all_to_all", "out-of-place"): lambda s: raw.Alltoall(s.x, s.y),
        ("all_to_all", "in-place"): lambda s: raw.Alltoall(inplace, s.x),
        ("barrier", "-"): lambda s: raw.Barrier(),
        ("all_reduce", "async"): lambda s: raw.Iallreduce(inplace, s.x).Wait(),
        ("broadcast", "async"): lambda s: raw.Ibcast(s.x, root=root).Wait(),
        ("all_gather", "async"): lambda s: raw.Iallgather(s.x, s.y).Wait(),
        ("reduce", "async"): (
            (lambda s: raw.Ireduce(inplace, s.x, root=root).Wait())
            if rank == root
            else (lambda s: raw.Ireduce(s.x, None, root=root).Wait())
        ),
        ("reduce_scatter", "async"): lambda s: raw.Ireduce_scatter_block(s.x, s.y).Wait(),
        ("all_to_all", "async"): lambda s: raw.Ialltoall(s.x, s.y).Wait(),
    }
    one = calls_of[(op, form)]

    def run(calls: int) -> None:
        for i in range(calls):
            one(pick(i))

    return run


def torch_run(
    dist: Any, group: Any, op: str, form: str, sets: Sequence[Any], rank: int, ranks: int
) -> Run | None:
    """The op form through torch.distributed on `group` (torch tensors in `sets`), or None where
    torch has no such form (out-of-place all_reduce, all_reduce_coalesced)."""
    from ..torch import dist_function

    pick, root = _pair(sets), ROOT
    if op == "sendrecv":
        if form.startswith("exchange"):
            return None
        if form == "async":
            return _pingpong(
                lambda x, peer: dist.isend(x, peer, group=group).wait(),
                lambda y, peer: dist.irecv(y, peer, group=group).wait(),
                sets,
                rank,
                ranks,
            )
        return _pingpong(
            partial(dist.send, group=group), partial(dist.recv, group=group), sets, rank, ranks
        )
    gather, scatter = dist_function("all_gather_single"), dist_function("reduce_scatter_single")
    calls_of: dict[tuple[str, str], Callable[[Any], Any]] = {
        ("all_reduce", "in-place"): lambda s: dist.all_reduce(s.x, group=group),
        ("reduce", "in-place"): lambda s: dist.reduce(s.x, root, group=group),
        ("broadcast", "in-place"): lambda s: dist.broadcast(s.x, root, group=group),
        ("all_gather", "out-of-place"): lambda s: gather(s.y, s.x, group=group),
        ("all_gather_single", "out-of-place"): lambda s: gather(s.y, s.x, group=group),
        ("all_gather", "in-place"): lambda s: gather(s.y, s.x, group=group),
        ("reduce_scatter", "out-of-place"): lambda s: scatter(s.y, s.x, group=group),
        ("reduce_scatter", "in-place"): lambda s: scatter(s.y, s.x, group=group),
        ("all_to_all", "out-of-place"): lambda s: dist.all_to_all_single(s.y, s.x, group=group),
        ("barrier", "-"): lambda s: dist.barrier(group=group),
        ("all_reduce", "async"): lambda s: dist.all_reduce(s.x, group=group, async_op=True).wait(),
        ("broadcast", "async"): (
            lambda s: dist.broadcast(s.x, root, group=group, async_op=True).wait()
        ),
        ("all_gather", "async"): (lambda s: gather(s.y, s.x, group=group, async_op=True).wait()),
        ("reduce", "async"): lambda s: dist.reduce(s.x, root, group=group, async_op=True).wait(),
        ("reduce_scatter", "async"): (
            lambda s: scatter(s.y, s.x, group=group, async_op=True).wait()
        ),
        ("all_to_all", "async"): (
            lambda s: dist.all_to_all_single(s.y, s.x, group=group, async_op=True).wait()
        ),
    }
    one = calls_of.get((op, form))
    if one is None:
        return None
    fn = one

    def run(calls: int) -> None:
        for i in range(calls):
            fn(pick(i))

    return run


class TorchView:
    """A buffer set's arrays as torch tensors sharing their memory."""

    def __init__(self, b: Buffers) -> None:
        import torch

        def t(a: Any) -> Any:
            return None if a is None else torch.from_numpy(a)

        self.x, self.y = t(b.x), t(b.y)
