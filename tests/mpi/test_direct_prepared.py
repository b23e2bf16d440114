"""The direct transport's prepared sends and receives (direct/prepared.py) without a GPU.

The GPU runtime is stood in for by the host: the ranks' buffers lie in one MPI shared window
(each rank addresses every rank's part, as a mapped peer allocation), a "device copy" is a host
copy between those addresses, and every stream and event is done. So the protocol runs on the
CPU as it does on the GPU: the lender's record, the copy by the rank the schedule names, the
copier's "done" with its size, in both copier layouts (the receiver copies between ranks on two
GPUs; the lower rank copies both ways on a shared one); a size that differs fails on both
ends, naming both sizes, and the pair goes on; a call finding the proxy busy moves nothing;
the proxy's path with several tags in flight, and mixed with the prepared one across a pair.
Each runs with the records and "done"s in a mailbox (direct/mailbox.py) and as MPI messages.
tests/gpu/test_direct_gpu.py runs the same calls on the GPU.
"""

from __future__ import annotations

import ctypes
import types
from functools import partial

import numpy as np
import pytest
from mpi4py import MPI

from hetcomm import InvalidArgument
from hetcomm.transports import tags
from hetcomm.transports.direct import mailbox
from hetcomm.transports.direct import proxy as proxy_mod
from hetcomm.transports.direct.mailbox import MpiPost, ShmPost
from hetcomm.transports.direct.peer import RECORD, Described
from hetcomm.transports.direct.prepared import PreparedP2P
from hetcomm.transports.direct.proxy import Proxy, Task
from hetcomm.transports.direct.transport import DirectTransport

PART = 1 << 18  # bytes of the shared window per rank
PAD = 64  # bytes checked untouched around each receive


class _Event:
    done = True

    def record(self, stream: object) -> None:
        pass


class _Runtime:
    """The calls prepared.py makes of the GPU runtime, on host memory."""

    def getDevice(self) -> int:
        return 0

    def memcpyAsync(self, dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
        ctypes.memmove(dst, src, nbytes)


_CUPY = types.SimpleNamespace(
    cuda=types.SimpleNamespace(
        runtime=_Runtime(),
        Event=lambda disable_timing: _Event(),
        Device=lambda d: types.SimpleNamespace(use=lambda: None),
        Stream=lambda non_blocking: None,
    )
)


class _Peers:
    """Records of window addresses: a record's offset is from the owner's part of the window,
    and every rank resolves it against its own view of that part (as IPC maps a peer's
    allocation into this process)."""

    def __init__(self, rank: int, bases: list[int]) -> None:
        self.rank, self.bases = rank, bases
        self.driver = types.SimpleNamespace(buffer_id=lambda ptr: 1)

    def describe(self, ptr: int, nbytes: int, audience: object, full: bool = False) -> np.ndarray:
        rec = np.zeros(1, RECORD)
        rec["id"], rec["offset"], rec["nbytes"], rec["has"] = (
            self.rank,
            ptr - self.bases[self.rank],
            nbytes,
            1,
        )
        return rec

    def address(self, peer: int, rec: np.ndarray) -> tuple[int, int]:
        owner, offset, nbytes, _ = rec.view(np.uint64)[:4].tolist()
        assert owner == peer, f"a record of rank {owner} came from rank {peer}"
        return self.bases[peer] + offset, nbytes

    def learn(self, peer: int, rec: np.void) -> None:
        pass


@pytest.fixture(params=["mailbox", "MPI"])
def pair(hetcomm_comm, request):
    """Ranks 0 and 1's prepared calls over a shared window, their records and "done"s through
    a mailbox in another shared window, or as MPI messages; other ranks take no part."""
    mpi = hetcomm_comm.mpi.Split(0 if hetcomm_comm.rank < 2 else MPI.UNDEFINED, hetcomm_comm.rank)
    if mpi == MPI.COMM_NULL:
        yield None
        return
    shared = mpi.Split_type(MPI.COMM_TYPE_SHARED)
    if shared.Get_size() != 2:
        pytest.skip("ranks 0 and 1 on different hosts")
    win = MPI.Win.Allocate_shared(PART, 1, comm=shared)
    parts = [np.frombuffer(win.Shared_query(r)[0], np.uint8) for r in range(2)]
    svc = mpi.Dup()
    nbytes = mailbox.lanes_bytes(["gpu0", "gpu1"], ["host", "host"])
    if request.param == "mailbox" and not nbytes:
        pytest.skip("this CPU may reorder stores: no mailbox")
    lanes_win = MPI.Win.Allocate_shared(nbytes if shared.Get_rank() == 0 else 0, 1, comm=shared)
    lanes = memoryview(lanes_win.Shared_query(0)[0])[:nbytes]
    if shared.Get_rank() == 0:
        lanes[:] = bytes(nbytes)
    shared.Barrier()
    proxy = Proxy(0, _CUPY, svc)
    rank = mpi.Get_rank()
    peers = _Peers(rank, [p.ctypes.data for p in parts])
    t = types.SimpleNamespace(
        svc=svc,
        cupy=_CUPY,
        rank=rank,
        device=0,
        _devices=["gpu0", "gpu1"],
        _proxy=proxy,
        peers=peers,
        described=Described(peers),
        comm=hetcomm_comm,
        device_kernels=types.SimpleNamespace(
            external_stream=lambda ptr, dev: types.SimpleNamespace(ptr=ptr, done=True)
        ),
        _lead_tag=tags.lead_base(int(svc.Get_attr(MPI.TAG_UB) or 32767)),
        _mismatch=DirectTransport._mismatch,
        post=ShmPost(lanes, rank, 2) if request.param == "mailbox" else MpiPost(svc),
    )
    t._key = partial(DirectTransport._key, t)
    try:
        yield types.SimpleNamespace(
            t=t, prepared=PreparedP2P(t), mine=parts[rank], rank=rank, mpi=mpi
        )
    finally:
        proxy.stop()
        mpi.Barrier()
        t.post.close()
        lanes.release()
        for w in (win, lanes_win):
            w.Free()
        for c in (svc, shared, mpi):
            c.Free()


def _call(p, op: str, offset: int, nbytes: int, seq: int, tag: int = 0) -> bool:
    ptr = p.mine.ctypes.data + offset
    return p.prepared._run(op, nbytes, lambda: 0, f"{nbytes} bytes", ptr, 1 - p.rank, tag, seq)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout", ["two GPUs", "one GPU"])
def test_prepared_messages_both_ways_in_both_copier_layouts(
    pair, hetcomm_comm, errors, rng, layout
):
    problems = []
    if pair is not None:
        if layout == "one GPU":
            pair.t._devices = ["gpu0", "gpu0"]  # rank 0 copies both ways
        seq = 0
        for nbytes in (1, 4096, 100_000):
            data = rng.integers(0, 256, (2, nbytes), dtype=np.uint8)
            send_at, recv_at = 0, PART // 2  # this rank's part: what it sends, where it receives
            pair.mine[:] = 0
            pair.mine[send_at : send_at + nbytes] = data[pair.rank]
            pair.mpi.Barrier()
            for first in (0, 1):
                seq += 1
                if pair.rank == first:
                    ok = _call(pair, "send", send_at, nbytes, seq)
                else:
                    ok = _call(pair, "recv", recv_at + PAD, nbytes, seq)
                if not ok:
                    problems.append(f"{nbytes} B: the prepared call declined an idle proxy")
            pair.mpi.Barrier()
            got = pair.mine[recv_at + PAD : recv_at + PAD + nbytes]
            if not np.array_equal(got, data[1 - pair.rank]):
                problems.append(f"{layout}, {nbytes} B: wrong data")
            around = np.concatenate(
                [pair.mine[recv_at : recv_at + PAD], pair.mine[recv_at + PAD + nbytes :]]
            )
            if around.any():
                problems.append(f"{layout}, {nbytes} B: wrote beside the receive buffer")
            if not np.array_equal(pair.mine[send_at : send_at + nbytes], data[pair.rank]):
                problems.append(f"{layout}, {nbytes} B: the sent array changed")
    errors.expect(not problems, "; ".join(problems))
    errors.verify()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout", ["two GPUs", "one GPU"])
def test_prepared_size_mismatch_fails_on_both_ends_and_the_pair_goes_on(
    pair, hetcomm_comm, errors, layout
):
    problems = []
    if pair is not None:
        if layout == "one GPU":
            pair.t._devices = ["gpu0", "gpu0"]
        for sender in (0, 1):  # on one GPU rank 0 pushes, then pulls
            try:
                if pair.rank == sender:
                    _call(pair, "send", 0, 10, 1, tag=3)
                else:
                    _call(pair, "recv", PART // 2, 12, 1, tag=3)
                problems.append(f"sender {sender}: a size mismatch went unnoticed")
            except InvalidArgument as exc:
                if "10" not in str(exc) or "12" not in str(exc):
                    problems.append(f"unclear mismatch error: {exc}")
        pair.mine[:8] = 7 + pair.rank
        pair.mine[PART // 2 : PART // 2 + 8] = 0
        pair.mpi.Barrier()
        for first in (0, 1):
            if pair.rank == first:
                _call(pair, "send", 0, 8, 2, tag=3)
            else:
                _call(pair, "recv", PART // 2, 8, 2, tag=3)
        if not (pair.mine[PART // 2 : PART // 2 + 8] == 7 + (1 - pair.rank)).all():
            problems.append("the message after a mismatch went wrong")
    errors.expect(not problems, "; ".join(problems))
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_prepared_call_finding_the_proxy_busy_moves_nothing(pair, hetcomm_comm, errors):
    """An operation in flight on the proxy goes first: the prepared call declines (the general
    path queues behind it) without sending a record or posting a receive."""
    problems = []
    if pair is not None:
        me, gate = pair.rank, np.zeros(1, np.int8)

        def held():
            yield pair.mpi.Irecv(gate, me, 77)  # in flight until this rank sends it

        task = Task(held())
        pair.t._proxy.submit(task, False)
        if _call(pair, "send" if me == 0 else "recv", 0, 8, 1):
            problems.append("a prepared call ran while the proxy was busy")
        pair.mpi.Barrier()  # the peer's declined call is over too
        if pair.t.svc.Iprobe(1 - me, MPI.ANY_TAG):
            problems.append("a declined call left a message behind")
        post = pair.t.post
        if isinstance(post, ShmPost) and (any(post._sent) or any(post._taken)):
            problems.append("a declined call lent or took a record")
        pair.mpi.Send(np.ones(1, np.int8), me, 77)
        if not task.finished.wait(5):
            problems.append("the proxy never finished its operation")
        pair.mpi.Barrier()
    errors.expect(not problems, "; ".join(problems))
    errors.verify()


class _Buf:
    """What the general path reads of a Buffer, for bytes of the shared window."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.ptr, self.nbytes = ptr, nbytes

    def describe(self) -> str:
        return f"{self.nbytes} bytes"


def _general(pair) -> DirectTransport:
    """A DirectTransport of the stand-in's parts whose sends and receives take the proxy's
    path (records sent and "done"s received by the proxy thread)."""
    t = object.__new__(DirectTransport)
    names = ("svc", "rank", "device", "_devices", "_proxy", "peers", "described", "comm", "post")
    for name in names:
        setattr(t, name, getattr(pair.t, name))
    t._lead_tag, t._lent = pair.t._lead_tag, {}
    t._check = lambda op, bufs: None
    t._ready = lambda b: None
    t._copy = lambda dst, src, nbytes: ctypes.memmove(dst, src, nbytes)
    t._sync = lambda: iter(())
    return t


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout", ["two GPUs", "one GPU"])
def test_general_path_many_in_flight_and_mixed_with_prepared(
    pair, hetcomm_comm, errors, rng, layout, monkeypatch
):
    """Asynchronous sends and receives on the proxy, several user tags in flight at once and
    received in another order than sent, then blocking calls where one rank takes the
    prepared path and the other the proxy's: every message lands whole, nothing beside it."""
    problems = []
    # a blocking call's operation run on the calling thread (Proxy.wait), with no device
    monkeypatch.setattr(proxy_mod, "on_device", lambda device, fn, *args: fn(*args))
    if pair is not None:
        if layout == "one GPU":
            pair.t._devices = ["gpu0", "gpu0"]
        t, me, peer = _general(pair), pair.rank, 1 - pair.rank
        count, size = 80, 512  # messages of `size` bytes, tags 0..2 in turn: more than a ring
        data = rng.integers(1, 256, (2, count, size), dtype=np.uint8)
        out_at = PART // 2
        pair.mine[:] = 0
        for k in range(count):
            pair.mine[k * size : (k + 1) * size] = data[me, k]
        pair.mpi.Barrier()
        order = list(range(count))
        if me == 1:
            order = sorted(order, key=lambda k: (-(k % 3), k))  # by tag, last tag first
        works = []
        for k in order:
            if (me == 0) == (k % 2 == 0):  # even messages rank 0 -> 1, odd ones 1 -> 0
                works.append(t.send(_Buf(pair.mine.ctypes.data + k * size, size), peer, k % 3, k))
            else:
                dst = _Buf(pair.mine.ctypes.data + out_at + PAD + k * (size + PAD), size)
                works.append(t.recv(dst, peer, k % 3, k))
        for w in works:
            w.wait()
        for k in range(count):
            if (me == 0) == (k % 2 == 0):
                continue
            at = out_at + PAD + k * (size + PAD)
            if not np.array_equal(pair.mine[at : at + size], data[peer, k]):
                problems.append(f"message {k} (tag {k % 3}) wrong")
            if pair.mine[at - PAD : at].any():
                problems.append(f"message {k}: wrote before the receive buffer")
        # blocking calls: rank 0 prepared, rank 1 the proxy's path, both directions
        pair.mpi.Barrier()
        for first in (0, 1):
            pair.mine[out_at : out_at + 64] = 0
            pair.mpi.Barrier()
            if me == 0:
                if me == first:
                    ok = _call(pair, "send", 0, 64, 100 + first, tag=1)
                else:
                    ok = _call(pair, "recv", out_at, 64, 100 + first, tag=1)
                if not ok:
                    problems.append("the prepared call declined an idle proxy")
            elif me == first:
                t.send(_Buf(pair.mine.ctypes.data, 64), peer, 1, 100 + first).wait()
            else:
                t.recv(_Buf(pair.mine.ctypes.data + out_at, 64), peer, 1, 100 + first).wait()
            if me != first and not np.array_equal(
                pair.mine[out_at : out_at + 64], data[peer, 0, :64]
            ):
                problems.append(f"mixed paths, sender {first}: wrong data")
    errors.expect(not problems, "; ".join(problems[:6]))
    errors.verify()
