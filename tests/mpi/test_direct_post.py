"""The direct transport's posts (direct/post.py) without a GPU: records and "done"s between
ranks 0 and 1, through shared words (a ring per direction) and through MPI messages.

The lender publishes records of several user tags, more than the ring has slots; the copier
takes them in another order than they were lent (by tag, and within a tag in issue order, as
MPI matches), answers each with a size of its own, and every lender sees exactly the answer to
its record. A record given up before the copier takes it is taken back: the copier learns so,
and the pair goes on. Nothing of the rings stays in /dev/shm, after the open or the close.
"""

from __future__ import annotations

import glob
import time

import numpy as np
import pytest
from mpi4py import MPI

from hetcomm.transports.direct.peer import RECORD
from hetcomm.transports.direct.post import NOT_READ, Polled, Posts


def _run(step, deadline: float = 20.0) -> None:
    """Drive a step of MPI requests and shared words to its end, bounded."""
    until = time.monotonic() + deadline
    for w in step:
        while True:
            if w is None:
                break
            if w.__class__ is Polled:
                done = w.test()
            elif isinstance(w, list):
                done = MPI.Request.Testall(w)
            else:
                done = w.Test()
            if done:
                break
            assert time.monotonic() < until, "a step never ended"


def _until(test, deadline: float = 20.0) -> None:
    until = time.monotonic() + deadline
    while not test():
        assert time.monotonic() < until, "a wait never ended"


def _record(tag: int, k: int) -> np.ndarray:
    rec = np.zeros(1, RECORD)
    rec["id"], rec["offset"], rec["nbytes"] = 1000 * tag + k, k, 16 * k + tag
    return rec


@pytest.fixture(params=["shared words", "MPI messages"])
def posts(request, hetcomm_comm):
    """Ranks 0 and 1's posts, opened with each other; other ranks take no part."""
    mpi = hetcomm_comm.mpi.Split(0 if hetcomm_comm.rank < 2 else MPI.UNDEFINED, hetcomm_comm.rank)
    if mpi == MPI.COMM_NULL:
        yield None
        return
    if mpi.Split_type(MPI.COMM_TYPE_SHARED).Get_size() != 2:
        pytest.skip("ranks 0 and 1 on different hosts")
    svc = mpi.Dup()
    p = Posts(svc, mpi.Get_rank())
    if request.param == "MPI messages":
        p.why = "forced by the test"
    elif p.why is not None:
        pytest.skip(f"no shared words here: {p.why}")
    _run(p.open(1 - p.rank))
    mpi.Barrier()
    try:
        yield p
    finally:
        p.close()
        mpi.Barrier()
        svc.Free()
        mpi.Free()


def _pair(tag: int) -> tuple[int, int]:
    return 64 + 4 * tag, 65 + 4 * tag


@pytest.mark.mpi(min_size=2)
def test_records_meet_their_copies_in_any_order_of_tags(posts, errors):
    problems = []
    if posts is not None:
        peer, per_tag, tags_ = 1 - posts.rank, 30, (0, 1, 2)
        if posts.ring(peer) != (posts.why is None):
            problems.append(f"ring to the peer: {posts.ring(peer)}, unsupported: {posts.why}")
        if glob.glob(f"/dev/shm/hetcomm-d{posts._token}-*"):
            problems.append("a ring's name stayed in /dev/shm after the open")
        if posts.rank == 0:  # the lender: 90 records (more than a ring's slots), tags mixed
            lent = []
            for k in range(per_tag):
                for tag in tags_:
                    number = posts.number("send", peer, tag)
                    if number != k:
                        problems.append(f"tag {tag}: message {k} numbered {number}")
                    lent.append(
                        (tag, k, posts.lend(peer, "send", tag, number, _pair(tag), _record(tag, k)))
                    )
            # every record waited for at once, as the proxy does: one that found the ring full
            # is published once the copier frees a slot
            _until(lambda: all([one.test() for _, _, one in lent]))
            for tag, k, one in lent:
                want = 7 * k + tag
                if one.copied() != want:
                    problems.append(f"tag {tag} #{k}: answered {one.copied()}, expected {want}")
        else:  # the copier: tags from the last, each tag's messages in order
            for tag in reversed(tags_):
                for k in range(per_tag):
                    number = posts.number("recv", peer, tag)
                    got = posts.expect(peer, "recv", tag, number, _pair(tag))
                    _until(got.test)
                    rec = got.record.view(np.uint64)[:3].tolist()
                    if rec != [1000 * tag + k, k, 16 * k + tag]:
                        problems.append(f"tag {tag} #{k}: took record {rec}")
                    if got.withdrawn():
                        problems.append(f"tag {tag} #{k}: taken back without reason")
                    req = got.answer(7 * k + tag)
                    if req is not None:
                        req.Wait()
    errors.expect(not problems, "; ".join(problems[:6]))
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_a_record_given_up_is_taken_back_and_the_pair_goes_on(posts, hetcomm_comm, errors):
    problems = []
    if posts is not None:
        peer, mpi = 1 - posts.rank, posts.svc  # the pair's own
        if posts.rank == 0:
            first = posts.lend(
                peer, "send", 5, posts.number("send", peer, 5), _pair(5), _record(5, 0)
            )
            first.test()
            first.withdraw()  # its wait timed out, say
        mpi.Barrier()
        if posts.rank == 1:
            got = posts.expect(peer, "recv", 5, posts.number("recv", peer, 5), _pair(5))
            _until(got.test)
            if posts._in.get(peer) is not None:
                if not got.withdrawn():
                    problems.append("a record taken back was not seen so")
                got.answer(NOT_READ)
            else:  # an MPI message cannot be taken back: the copier answers it
                if got.withdrawn():
                    problems.append("an MPI record read as taken back")
                got.answer(16).Wait()
        mpi.Barrier()
        # the next message of the tag goes through
        if posts.rank == 0:
            second = posts.lend(
                peer, "send", 5, posts.number("send", peer, 5), _pair(5), _record(5, 1)
            )
            _until(second.test)
            if second.copied() != 21:
                problems.append(f"the next message answered {second.copied()}")
            if not posts.ring(peer):
                _until(first.test)  # the MPI "done" of the first, answered
        else:
            got = posts.expect(peer, "recv", 5, posts.number("recv", peer, 5), _pair(5))
            _until(got.test)
            if got.record.view(np.uint64)[0] != 5001:
                problems.append("the next message took the wrong record")
            req = got.answer(21)
            if req is not None:
                req.Wait()
    errors.expect(not problems, "; ".join(problems))
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_closing_leaves_nothing_in_dev_shm(hetcomm_comm, errors):
    mpi = hetcomm_comm.mpi.Split(0 if hetcomm_comm.rank < 2 else MPI.UNDEFINED, hetcomm_comm.rank)
    problems = []
    if mpi != MPI.COMM_NULL:
        svc = mpi.Dup()
        p = Posts(svc, mpi.Get_rank())
        made = p._make(99)  # a ring made and never opened with anyone (its peer never came)
        if made is None and p.why is None:
            problems.append("no ring could be made")
        p.close()
        if glob.glob(f"/dev/shm/hetcomm-d{p._token}-*"):
            problems.append("a ring stayed in /dev/shm after the close")
        svc.Free()
        mpi.Free()
    errors.expect(not problems, "; ".join(problems))
    errors.verify()
