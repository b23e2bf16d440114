"""send / recv: every dtype and layout around a ring, tags, and message spaces of dup()."""

from __future__ import annotations

import numpy as np
import pytest
from _data import CASES, SHAPES, Placed, compare, draw

import hetcomm
from hetcomm import introspect
from hetcomm.transports.staged.eager import EAGER_BYTES


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(("lib", "dtype"), CASES)
def test_send_recv_ring(hetcomm_comm, rng, errors, lib, dtype):
    """Rank r sends to r+1 and receives from r-1, from and into every layout."""
    dst, src = (
        (hetcomm_comm.rank + 1) % hetcomm_comm.size,
        (hetcomm_comm.rank - 1) % hetcomm_comm.size,
    )
    for tag, (shape, layout) in enumerate(SHAPES):
        stack = draw(rng, dtype, shape, hetcomm_comm.size)
        case = f"{layout}{list(shape)} tag {tag}"
        x = Placed(stack[hetcomm_comm.rank], dtype, lib, layout)
        y = Placed(draw(rng, dtype, shape, 1)[0], dtype, lib, layout)

        def exchange(x=x, y=y, tag=tag):
            sent = hetcomm_comm.send(x.array, dst, tag, async_op=True)
            hetcomm_comm.recv(y.array, src, tag)
            sent.wait()

        if errors.run(case, exchange):
            errors += compare(y.values(), stack[src], f"received, {case}")
            errors += compare(x.values(), stack[hetcomm_comm.rank], f"sent, {case}: x changed")
            errors.expect(x.intact() and y.intact(), f"{case}: wrote outside the target")
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_tags_select_the_message(hetcomm_comm, errors):
    """Rank 0 sends tags 1 then 2; rank 1 receives tag 2 first: each lands where it belongs."""
    if hetcomm_comm.rank == 0:
        works = [
            hetcomm_comm.send(np.full(3, t, dtype=np.int32), 1, tag=t, async_op=True)
            for t in (1, 2)
        ]
        for w in works:
            w.wait()
    elif hetcomm_comm.rank == 1:
        second, first = np.zeros(3, dtype=np.int32), np.zeros(3, dtype=np.int32)
        hetcomm_comm.recv(second, 0, tag=2)
        hetcomm_comm.recv(first, 0, tag=1)
        errors.expect(
            (first == 1).all() and (second == 2).all(), f"tag 1 gave {first}, tag 2 gave {second}"
        )
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_recv_posted_before_send(hetcomm_comm, errors):
    """An async recv posted before the matching send completes once the send comes."""
    x = np.arange(6, dtype=np.float64).reshape(2, 3)
    if hetcomm_comm.rank == 1:
        y = np.zeros((2, 3))
        work = hetcomm_comm.recv(y, 0, tag=5, async_op=True)
        errors.expect(isinstance(work, hetcomm.Work), f"recv returned {work!r}")
        hetcomm_comm.barrier()
        work.wait(timeout=30)
        errors.expect(work.test() and work.exception() is None, f"recv work {work!r}")
        errors += compare(y, x, "received")
    else:
        hetcomm_comm.barrier()
        if hetcomm_comm.rank == 0:
            hetcomm_comm.send(x, 1, tag=5)
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_dup_has_its_own_message_space(hetcomm_comm, errors):
    """The same (source, tag) on a dup and on its parent never match each other."""
    with hetcomm_comm.dup(name="twin") as twin:
        if hetcomm_comm.rank == 0:
            a = hetcomm_comm.send(np.array([1.0]), 1, tag=0, async_op=True)
            b = twin.send(np.array([2.0]), 1, tag=0, async_op=True)
            a.wait()
            b.wait()
        elif hetcomm_comm.rank == 1:
            on_twin, on_comm = np.zeros(1), np.zeros(1)
            twin.recv(on_twin, 0, tag=0)
            hetcomm_comm.recv(on_comm, 0, tag=0)
            errors.expect(
                on_twin[0] == 2.0 and on_comm[0] == 1.0,
                f"twin got {on_twin[0]}, parent got {on_comm[0]}",
            )
        twin.barrier()
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_same_tag_messages_match_in_order(hetcomm_comm, rng, errors):
    """Several messages in flight between two ranks with one tag match in the order they were
    posted, as in MPI, whatever their sizes (a transport that starts them on several threads
    must not let a later one overtake an earlier one)."""
    if hetcomm_comm.rank > 1:
        errors.verify()
        return
    sizes = [int(n) for n in rng.integers(1, 300_000, 6)]
    for _ in range(3):
        if hetcomm_comm.rank == 0:
            xs = [np.full(n, i + 1, np.int8) for i, n in enumerate(sizes)]
            for w in [hetcomm_comm.send(x, 1, tag=5, async_op=True) for x in xs]:
                w.wait()
        else:
            ys = [np.zeros(n, np.int8) for n in sizes]
            for w in [hetcomm_comm.recv(y, 0, tag=5, async_op=True) for y in ys]:
                w.wait()
            for i, y in enumerate(ys):
                errors += compare(y, np.full(sizes[i], i + 1, np.int8), f"message {i}")
    errors.verify()


# element counts of float32 from one element to past staged's eager slot and its PULL reads
ANY_ORDER_COUNTS = [1, 3, 600, 9000, 70_000, 300_000]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("opened", [False, True], ids=["first messages", "open channels"])
def test_every_send_and_receive_asynchronous_waited_in_any_order(
    hetcomm_make_comm, rng, errors, opened
):
    """Every rank makes 10-30 sends to every other rank on three tags and the matching
    receives, all asynchronous, of sizes from one element to past the eager and PULL
    thresholds, interleaved at random (those of one peer and tag in their order), then waits
    on them in a random order. MPI completes this: a wait makes progress on everything
    posted. Staged once stalled here three ways (2026-12-06): receives made before their
    channel opened were posted only by drivers busy with sends; a ring stayed full of PULL
    messages already read, whose slots came back only when their sends were polled; and a
    ring was landed only by waits on its own peer."""
    comm = hetcomm_make_comm(timeout=30)
    me, size = comm.rank, comm.size
    if opened:
        z, w = np.zeros(1), np.zeros(1)
        for peer in range(size):  # pairs in one order on every rank: no cycle
            if peer != me:
                comm.sendrecv(z, peer, w, peer)
    base = int(rng.integers(1 << 30))

    def messages(src: int, dst: int) -> list[tuple[int, np.ndarray]]:
        r = np.random.default_rng([base, src, dst])
        return [
            (int(r.integers(3)), r.integers(-1000, 1000, int(r.choice(ANY_ORDER_COUNTS))))
            for _ in range(int(r.integers(10, 31)))
        ]

    queues: dict[tuple[str, int, int], list[np.ndarray]] = {}
    for peer in range(size):
        if peer != me:
            for tag, x in messages(me, peer):
                queues.setdefault(("send", peer, tag), []).append(x.astype(np.float32))
            for tag, x in messages(peer, me):
                queues.setdefault(("recv", peer, tag), []).append(x.astype(np.float32))
    mine = np.random.default_rng([base, me, size])  # this rank's own order
    works, received = [], []
    keys = list(queues)
    while keys:
        key = keys[int(mine.integers(len(keys)))]
        x = queues[key].pop(0)
        if not queues[key]:
            keys.remove(key)
        kind, peer, tag = key
        if kind == "send":
            works.append(comm.send(x, peer, tag=tag, async_op=True))
        else:
            y = np.full(x.size + 1, -1.0, np.float32)
            works.append(comm.recv(y[:-1], peer, tag=tag, async_op=True))
            received.append((f"from {peer}, tag {tag}, {x.size} elements", y, x))
    for i in mine.permutation(len(works)):
        works[i].wait()
    for what, y, x in received:
        errors += compare(y[:-1], x, what)
        errors.expect(y[-1] == -1.0, f"{what}: wrote past the message")
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_staged_send_recv_start_on_the_calling_thread(hetcomm_make_comm, rng, errors):
    """Once the shm channel between two ranks of a host is open, staged send and recv run
    without a driver thread, whether the receive is posted before the send or after it, and
    the k-th send still lands in the k-th receive of its tag. Without a shm rail (simulated
    hosts, HETCOMM_RAILS=mpi) the clear-to-send comes over MPI and a driver runs each one."""
    comm = hetcomm_make_comm(transport="staged")
    if comm.rank > 1:
        errors.verify()
        return
    data = rng.standard_normal((6, 1000))
    got = np.zeros((6, 1000))
    if comm.rank == 0:
        comm.send(data[0], 1)  # opens the channel (a driver thread does that)
    else:
        comm.recv(got[0], 0)
    staged = introspect.transports(comm)["staged"]
    before = introspect.driver_submitted(staged)
    for i, receive_first in ((1, True), (2, False)):
        if comm.rank == 1 and receive_first:
            work = comm.recv(got[i], 0, tag=7, async_op=True)
            comm.mpi.Send(np.zeros(1), 0, tag=99)  # the receive is posted: send now
            work.wait()
        elif comm.rank == 0 and receive_first:
            comm.mpi.Recv(np.zeros(1), 1, tag=99)
            comm.send(data[i], 1, tag=7)
        elif comm.rank == 0:
            work = comm.send(data[i], 1, tag=7, async_op=True)
            comm.mpi.Send(np.zeros(1), 1, tag=99)  # the send waits for its clear-to-send
            work.wait()
        else:
            comm.mpi.Recv(np.zeros(1), 0, tag=99)
            comm.recv(got[i], 0, tag=7)
    # three messages of one tag in flight at once, waited for last to first
    works = []
    for i in (3, 4, 5):
        if comm.rank == 0:
            works.append(comm.send(data[i], 1, tag=8, async_op=True))
        else:
            works.append(comm.recv(got[i], 0, tag=8, async_op=True))
    for w in reversed(works):
        w.wait()
    # without a doorbell (between hosts) the four asynchronous calls of each rank need a
    # driver; its blocking call runs on the calling thread either way
    want = 0 if staged.cts.doorbell(1 - comm.rank) is not None else 4
    handed = introspect.driver_submitted(staged) - before
    errors.expect(handed == want, f"{handed} sends/recvs went to a driver thread, expected {want}")
    if comm.rank == 1:
        errors += compare(got, data, "received")
    errors.verify()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("opened", [False, True], ids=["first message", "open channel"])
def test_staged_send_without_a_receive_times_out_naming_it(hetcomm_make_comm, errors, opened):
    """A staged send whose receive is never posted fails with CommTimeout saying so, whether a
    driver thread runs it (the first message to a peer: the peer opens the channel with a
    receive of another tag, which times out too) or the calling thread, and leaves nothing
    behind that a late clear-to-send could start. The message is larger than an eager slot,
    since an eager send completes without its receive (as MPI's do)."""
    comm = hetcomm_make_comm(transport="staged", timeout=3)
    big = np.ones(EAGER_BYTES // 8 + 1)
    if opened and comm.rank < 2:
        if comm.rank == 0:
            comm.send(np.ones(4), 1)
        else:
            comm.recv(np.empty(4), 0)
    if comm.rank == 0:
        try:
            # the wait outlasts the transport's own limit (3 s), whose error names the cause
            comm.send(big, 1, tag=5, timeout=10)
            errors.expect(False, "the send completed without a receive")
        except hetcomm.CommTimeout as exc:
            errors.expect("never posted the matching receive" in str(exc), f"said: {exc}")
        staged = introspect.transports(comm)["staged"]
        errors.expect(not staged.cts.waiting, f"left behind: {staged.cts.waiting}")
    elif comm.rank == 1 and not opened:
        try:
            comm.recv(np.empty(4), 0, tag=6, timeout=10)
            errors.expect(False, "a receive of a tag never sent completed")
        except hetcomm.CommTimeout:
            pass
    comm.mpi.Barrier()
    errors.verify()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("form", ["blocking", "async", "any source"])
def test_mpi_receive_of_another_size_names_both_sizes(hetcomm_make_comm, rng, errors, form):
    """On the mpi transport a receive smaller than its message and one larger raise
    MismatchError naming the sizes, through the prepared call, a Work and a receive from any
    source alike; the next message of the right size still lands."""
    comm = hetcomm_make_comm(transport="mpi")
    data = rng.standard_normal(12).astype(np.float32)
    if comm.rank == 0:
        for tag, n in ((1, 5), (2, 3), (3, 4)):
            comm.send(data[:n], 1, tag=tag)
    elif comm.rank == 1:
        src = hetcomm.ANY_SOURCE if form == "any source" else 0

        def receive(y, tag):
            if form == "async":
                comm.recv(y, src, tag=tag, async_op=True).wait()
            else:
                comm.recv(y, src, tag=tag)

        for tag, said in ((1, "has more than 16 bytes"), (2, "has 12 bytes")):
            try:
                receive(np.zeros(4, np.float32), tag)
                errors.expect(False, f"tag {tag}: no MismatchError")
            except hetcomm.MismatchError as exc:
                errors.expect(said in str(exc), f"tag {tag} said: {exc}")
                errors.expect("rank 0" in str(exc), f"tag {tag} names no sender: {exc}")
        y = np.zeros(4, np.float32)
        receive(y, 3)
        errors += compare(y, data[:4], "the message after")
    errors.verify()
