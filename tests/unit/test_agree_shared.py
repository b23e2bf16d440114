"""The shared form of the check (agree.SharedCheck) in one process: each "rank" is a
SharedRecords over one anonymous mapping, as the ranks of one host map one segment."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from hetcomm import agree
from hetcomm.ops import ReduceOp

_START = 128  # the records start after the arrivals table, as in a real segment
_RING = 8


def _ranks(size: int, ring: int = _RING) -> list[agree.SharedRecords]:
    segment = mmap.mmap(-1, _START + agree.SharedRecords.nbytes(size, ring))
    return [agree.SharedRecords(segment, _START, r, size, ring) for r in range(size)]


def _slots(records: list[agree.SharedRecords], i: int) -> list[agree.SharedCheck]:
    return [agree.SharedCheck(r, i) for r in records]


def _sig(n: int, op: str = "all_reduce") -> np.ndarray:
    return agree.signature(op, "float64", n, ReduceOp.SUM, -1)


def test_agreeing_ranks_complete_once_all_have_written():
    records = _ranks(3)
    checks = _slots(records, 1)
    vec = _sig(5)
    for c in checks:
        c.load(vec)
    assert not checks[0].quick(1)  # the others have not written yet
    assert not checks[1].quick(1)
    assert not checks[0].Test()
    assert checks[2].quick(1)  # the last to write sees every record at once
    assert checks[0].Test() and checks[1].Test()
    assert all(c.agreed() for c in checks)
    assert not any(c.busy for c in checks)


def test_a_difference_is_seen_by_every_rank():
    records = _ranks(3)
    checks = _slots(records, 2)
    for r, c in enumerate(checks):
        c.load(_sig(7 if r == 1 else 5))  # rank 1 has another count
        c.start(2)
    assert all(c.Test() for c in checks)
    assert [c.agreed() for c in checks] == [False, False, False]
    # the MPI form's vectors (fields, then negations) stay what `mine` holds, for the report
    assert checks[1].mine[2] == 7 and checks[0].mine[2] == 5


def test_a_record_is_written_again_only_once_every_rank_has_read_it():
    records = _ranks(2, ring=2)
    vec = _sig(1)
    a = [agree.SharedCheck(records[0], i) for i in range(4)]
    b = [agree.SharedCheck(records[1], i) for i in range(4)]
    for c in a + b:
        c.load(vec)
    # rank 0 runs ahead through collectives 1 and 2 (records 1 and 0) while rank 1 has
    # written them but read neither
    b[1].start(1)
    b[2].start(2)
    assert a[1].quick(1) and a[2].quick(2)
    # collective 3 reuses record 1, which rank 1 has not read yet: rank 0 may not write it
    assert not a[3].quick(3)
    assert not b[3].quick(3)  # rank 1 may (rank 0 read its record 1), but 3 is not complete
    assert b[1].Test()  # rank 1 reads collective 1: its done word moves on
    assert a[3].Test()  # so rank 0 writes collective 3 now, and finds rank 1's there
    assert b[3].Test()
    assert a[3].agreed() and b[3].agreed()


def test_slots_that_share_a_record_write_it_again_after_each_other():
    """A record is written only where it does not hold the header already; slots of the
    Agreement's ring that share one record (collectives `ring` apart) must see each other's
    writes: a slot that skipped its write after another slot wrote the record would compare
    the other signature."""
    records = _ranks(2, ring=2)
    # a ring of 4 slots over the 2 records, as Agreement.RING slots share SHARED_RING records
    slots = [[agree.SharedCheck(r, i) for r in records] for i in range(4)]
    a, b = _sig(5), _sig(9)
    for seq in range(1, 25):
        vec = a if seq % 4 in (1, 2) else b  # slots i and i + 2 hold a and b in turn
        checks = slots[seq % 4]
        for c in checks:
            c.load(vec)
            c.quick(seq)
        assert all(c.Test() for c in checks), seq
        assert [c.agreed() for c in checks] == [True, True], seq
    checks = slots[25 % 4]  # and a difference is still seen
    for c, vec in zip(checks, (a, b), strict=True):
        c.load(vec)
        c.quick(25)
    assert all(c.Test() for c in checks)
    assert [c.agreed() for c in checks] == [False, False]


def test_the_carried_path_is_taken_only_where_every_rank_takes_it():
    records = _ranks(3)
    vec = _sig(4, "broadcast")
    data = np.arange(4, dtype=np.float64) + 0.5
    for carried_by_all in (True, False):
        seq = 1 if carried_by_all else 2
        checks = _slots(records, seq)
        for r, c in enumerate(checks):
            c.load(vec)
            if r == 0:
                c.start(seq, data)
            elif r == 2 and not carried_by_all:
                c.start(seq)  # an asynchronous call, say: not on the carried path
            else:
                c.start(seq, False)
        assert all(c.Test() and c.agreed() for c in checks)
        assert [c.carried() for c in checks] == [carried_by_all] * 3
        got = np.frombuffer(checks[1].payload(0, data.nbytes), np.float64)
        assert np.array_equal(got, data)


def test_rows_hold_every_rank_carried_input_in_rank_order():
    records = _ranks(4)
    vec = _sig(3, "reduce")
    rng = np.random.default_rng()
    every = rng.standard_normal((4, 3))
    checks = _slots(records, 5)
    for r, c in enumerate(checks):
        c.load(vec)
        c.start(5, every[r])
    assert all(c.Test() for c in checks)
    for c in checks:
        rows = c.rows(np.dtype(np.float64), 3)
        assert np.array_equal(rows, every)
        assert c.rows(np.dtype(np.float64), 3) is rows  # kept for the next call alike


@pytest.mark.parametrize("dtype", ["float64", "float32", "int8", "uint8", "int64", "bool"])
@pytest.mark.parametrize("op", ["sum", "prod", "min", "max"])
def test_reduce_rows_reduces_in_row_order(dtype, op):
    from hetcomm.kernels.reduce import reduce_rows

    rng = np.random.default_rng()
    if dtype == "bool":
        rows = rng.integers(0, 2, (5, 9)).astype(bool)
        want = (np.any if op in ("sum", "max") else np.all)(rows, axis=0)
    else:
        rows = rng.integers(-4, 5, (5, 9)).astype(dtype)
        if dtype.startswith("float"):
            rows[2, 3] = np.nan
        wide = rows.astype(np.float64 if dtype.startswith("float") else np.int64)
        fn = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}[op]
        want = fn.reduce(wide, axis=0).astype(dtype)
    strided = np.zeros((5, 18), rows.dtype)[:, ::2]  # rows need not be contiguous
    strided[...] = rows
    out = np.full(9, 1, rows.dtype)
    reduce_rows(strided, out, op)
    assert np.array_equal(out, want, equal_nan=True), (out, want)


def test_a_carried_record_is_written_again_only_once_its_collective_has_landed():
    """An asynchronous call writes its record at once, while an earlier carried collective
    may not have landed on this rank yet (it lands when the deferred starts reach it): no
    rank writes that collective's record again before it has landed everywhere, this rank
    included (its own row is one of those it lands from)."""
    records = _ranks(2, ring=2)
    vec = _sig(2)
    rng = np.random.default_rng()
    first, later = rng.standard_normal((2, 2)), rng.standard_normal((2, 2))
    a = [agree.SharedCheck(records[0], i) for i in range(4)]
    b = [agree.SharedCheck(records[1], i) for i in range(4)]
    for c in a + b:
        c.load(vec)
    for r, c in enumerate((a[1], b[1])):
        c.start(1, first[r])
    # rank 1 sees collective 1 complete and lands it; rank 0 has not looked yet
    assert b[1].Test() and b[1].agreed() and b[1].carried()
    b[1].landed()
    a[2].start(2)  # rank 0 goes on: collective 2 is on the other record
    # collective 3 reuses record 1: rank 0 has not landed collective 1 (its own row is in it)
    assert not a[3].start(3, later[0])._written
    assert not b[3].start(3, later[1])._written  # nor rank 1: rank 0 has not read record 1
    assert a[1].Test() and a[1].agreed() and a[1].carried()
    assert not b[3].Test()  # complete on rank 0 but not landed: still not rank 1's to write
    assert np.array_equal(a[1].rows(np.dtype(np.float64), 2), first)  # still collective 1's
    a[1].landed()
    b[2].start(2)
    assert a[2].Test() and b[2].Test()
    a[3].Test()  # both write now, and find each other there
    assert b[3].Test() and a[3].Test()
    assert a[3].agreed() and a[3].carried()
    assert np.array_equal(a[3].rows(np.dtype(np.float64), 2), later)


def test_a_carried_collective_that_disagrees_frees_its_records_at_once():
    """A mismatch lands nothing: the records are read (and the slot free) as the check
    completes, so the next collectives on that record do not wait for a landing."""
    records = _ranks(2, ring=1)
    a, b = (agree.SharedCheck(r, 0) for r in records)
    a.load(_sig(2))
    b.load(_sig(3))
    a.start(1, np.zeros(2))
    b.start(1, np.zeros(3))
    assert a.Test() and b.Test()
    assert not a.agreed() and not b.agreed()
    # the slot stays taken until the mismatch's report has copied this rank's signature
    assert a.busy and b.busy
    mine = a.mismatched()
    assert np.array_equal(mine, _sig(2)) and mine is not a.mine
    assert np.array_equal(b.mismatched(), _sig(3))
    assert not a.busy and not b.busy
    b.load(_sig(2))
    a.start(2, np.ones(2))
    b.start(2, np.ones(2))
    assert a.Test() and b.Test() and a.agreed() and a.carried()


def test_a_coalesced_call_through_the_leader_names_its_arrays():
    """all_reduce_coalesced reduced array by array (a shared GPU's leader) signs how many
    arrays each rank gives: two ranks with the same total in 1 and 2 arrays disagree, and the
    difference is named as the arrays', not a root's; against a plain all_reduce, the
    operation differs."""
    records = _ranks(2)
    one = agree.signature("all_reduce_coalesced", "float32", 6, ReduceOp.SUM, 1)
    two = agree.signature("all_reduce_coalesced", "float32", 6, ReduceOp.SUM, 2)
    checks = _slots(records, 1)
    for c, vec in zip(checks, (one, two), strict=True):
        c.load(vec)
        c.quick(1)
    assert all(c.Test() for c in checks)
    assert [c.agreed() for c in checks] == [False, False]
    assert agree.differences(np.stack([one, two])) == ["arrays differs: rank 0: 1, rank 1: 2"]
    plain = agree.signature("all_reduce", "float32", 6, ReduceOp.SUM, -1)
    said = agree.differences(np.stack([one, plain]))
    assert said[0] == "operation differs: rank 0: all_reduce_coalesced, rank 1: all_reduce"
