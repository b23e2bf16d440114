"""Staged messages over the shm rail moved by the thread that waits for them (inline.py).

Pairs of ranks (0, 1), (2, 3), ... of one host exchange host arrays larger than the eager
threshold with large messages sent over the rails (not read from the sender's array), in
chunks small enough that a message needs more chunks than the rail has shared slots. Where the
pair has no shm-only channel (the tcp and mpi steps of scripts/test) the same calls take the
channel's threads, and the tests check the data only."""

from __future__ import annotations

import time

import numpy as np
import pytest
from _data import pair_exchange as _exchange

import hetcomm
from hetcomm import introspect
from hetcomm.errors import MismatchError
from hetcomm.transports.staged import inline

CHUNK = 64 << 10  # 8 slots of it: a 1 MiB message reuses every slot twice
SIZES = (EAGER_PAST := (256 << 10) + 8, 1 << 20, (1 << 20) + 24)
SENTINEL = -7.0


def _pair(comm: hetcomm.Communicator) -> int | None:
    peer = comm.rank ^ 1
    return peer if peer < comm.size else None


def _setup(comm: hetcomm.Communicator, chunk: int = CHUNK) -> tuple[object, int | None]:
    """The staged transport with small chunks and large messages over the rails, and this
    rank's partner once their channel is open."""
    comm.barrier()
    staged = introspect.transports(comm)["staged"]
    staged.single_copy = False
    staged.chunk_bytes = chunk
    peer = _pair(comm)
    if peer is not None:
        _exchange(comm, peer, np.zeros(1), np.zeros(1))
    return staged, peer


def _inline_with(staged: object, peer: int) -> bool:
    ch = introspect.channels(staged).get(peer)  # type: ignore[arg-type]
    return ch is not None and inline.sole_shm(ch) is not None


def _slots_back(comm, staged, peer, errors, what):
    """Once both ranks are past the calls, every shared slot of the pair comes back (a
    receive completes before its last slot's FREE has reached the sender: give it a second)."""
    comm.barrier()  # every rank, partner or not
    ch = introspect.channels(staged).get(peer) if peer is not None else None
    if ch is not None and inline.sole_shm(ch) is not None:
        until = time.monotonic() + 1.0
        while introspect.free_slots(ch.shm_out) < ch.shm_out.slots and time.monotonic() < until:
            time.sleep(1e-3)
        free = introspect.free_slots(ch.shm_out)
        errors.expect(free == ch.shm_out.slots, f"{what}: {free} of {ch.shm_out.slots} free")


def ch_of(staged: object, peer: int) -> object:
    return introspect.channels(staged)[peer]  # type: ignore[arg-type]


def _draw(seed: list[int], n: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n // 8)


@pytest.mark.mpi(min_size=2)
def test_blocking_messages_move_inline(hetcomm_make_comm, errors, hetcomm_shared_seed):
    """Blocking sends and receives (and a sendrecv's receive) of more chunks than there are
    slots arrive whole, nothing past them is written, each is moved by the calling thread
    (counted: one "send inline" / "recv inline" per call; each receive looks for its chunks
    on the board where the host has boards), and every slot is back after."""
    comm = hetcomm_make_comm(transport="staged", timeout=60)
    staged, peer = _setup(comm)
    if peer is not None:
        on = _inline_with(staged, peer)
        for n in SIZES:
            seed = [hetcomm_shared_seed, n]
            mine, theirs = _draw([*seed, comm.rank], n), _draw([*seed, peer], n)
            back = np.full(mine.size + 2, SENTINEL)
            before = dict(staged.paths)
            for _ in range(3):
                back[:-2] = 0
                _exchange(comm, peer, mine, back[:-2], tag=n % 3)
            errors.expect(np.array_equal(back[:-2], theirs), f"{n} B: wrong data")
            errors.expect((back[-2:] == SENTINEL).all(), f"{n} B: wrote past the message")
            got = np.zeros_like(theirs)
            comm.sendrecv(mine, peer, got, peer)
            errors.expect(np.array_equal(got, theirs), f"{n} B sendrecv: wrong data")
            if on:
                board = ch_of(staged, peer).board_in is not None
                for key, want in (
                    ("send inline", 3),
                    ("recv inline", 4),
                    ("recv board", 4 * board),
                ):
                    count = staged.paths[key] - before.get(key, 0)
                    errors.expect(count == want, f"{n} B: {key} {count}, expected {want}")
    _slots_back(comm, staged, peer, errors, "after the exchanges")
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_a_host_message_of_one_chunk(hetcomm_make_comm, errors, hetcomm_shared_seed):
    """A host message of one chunk: its send stays with the channel's threads, its receive
    finds the chunk on the board where the pair has boards (counted), else the reader lands
    it; it arrives whole either way, and every slot is back after."""
    comm = hetcomm_make_comm(transport="staged", timeout=60)
    staged, peer = _setup(comm, 4 << 20)
    if peer is not None:
        n = (1 << 20) + 8
        seed = [hetcomm_shared_seed, n]
        mine, theirs = _draw([*seed, comm.rank], n), _draw([*seed, peer], n)
        back = np.full(mine.size + 2, SENTINEL)
        before = dict(staged.paths)
        _exchange(comm, peer, mine, back[:-2], tag=4)
        errors.expect(np.array_equal(back[:-2], theirs), "wrong data")
        errors.expect((back[-2:] == SENTINEL).all(), "wrote past the message")
        if _inline_with(staged, peer):
            board = ch_of(staged, peer).board_in is not None
            want = {"send inline": 0, "recv inline": board, "recv board": board}
            for key, count in want.items():
                got = staged.paths[key] - before.get(key, 0)
                errors.expect(got == count, f"{key} {got}, expected {count}")
    _slots_back(comm, staged, peer, errors, "after a message of one chunk")
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_inline_beside_asynchronous_messages(hetcomm_make_comm, errors, hetcomm_shared_seed):
    """Asynchronous sends and receives (the channel's threads) in flight while blocking ones
    of the same pair move inline, waited for after: every message arrives whole, in order."""
    comm = hetcomm_make_comm(transport="staged", timeout=60)
    staged, peer = _setup(comm)
    if peer is not None:
        n = 1 << 20
        msgs = [_draw([hetcomm_shared_seed, i], n) for i in range(4)]
        if comm.rank % 2 == 0:
            works = [comm.send(msgs[0], peer, tag=1, async_op=True)]
            comm.send(msgs[1], peer, tag=2)
            works.append(comm.send(msgs[2], peer, tag=1, async_op=True))
            got = np.zeros_like(msgs[3])
            comm.recv(got, peer, tag=3)
            errors.expect(np.array_equal(got, msgs[3]), "blocking receive: wrong data")
            for w in works:
                w.wait()
        else:
            outs = [np.zeros_like(m) for m in msgs[:3]]
            first = comm.recv(outs[0], peer, tag=1, async_op=True)
            comm.recv(outs[1], peer, tag=2)
            second = comm.recv(outs[2], peer, tag=1, async_op=True)
            comm.send(msgs[3], peer, tag=3)
            first.wait()
            second.wait()
            for i, out in enumerate(outs):
                errors.expect(np.array_equal(out, msgs[i]), f"message {i}: wrong data")
    _slots_back(comm, staged, peer, errors, "after mixed messages")
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_sizes_that_disagree_fail_both_and_free_the_slots(hetcomm_make_comm, errors):
    """A receive of fewer bytes than the send: MismatchError on both ranks, the receive's
    buffer untouched, every slot back, and the next messages of the pair go through."""
    comm = hetcomm_make_comm(transport="staged", timeout=60)
    staged, peer = _setup(comm)
    if peer is not None:
        x = np.arange((1 << 20) // 8, dtype=np.float64)
        into = np.full(x.size // 2, SENTINEL)
        try:
            if comm.rank % 2 == 0:
                comm.send(x, peer, tag=5)
            else:
                comm.recv(into, peer, tag=5)
        except MismatchError:
            pass
        else:
            errors.expect(False, "no MismatchError")
        errors.expect((into == SENTINEL).all(), "the short receive's buffer was written")
    _slots_back(comm, staged, peer, errors, "after the mismatch")
    if peer is not None:
        back = np.zeros_like(x)
        _exchange(comm, peer, x, back, tag=6)
        errors.expect(np.array_equal(back, x), "after the mismatch: wrong data")
    errors.verify()
