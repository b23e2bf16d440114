"""The default check's two forms (hetcomm.agree): through shared memory where every rank is on
one host, an MPI all-reduce otherwise; both catch a mismatch on every rank. And small
collectives on host memory, whose data rides in the shared form's records: right for every
dtype, root, form and reduce op, nothing outside the buffers touched, and the same result
when some rank does not take that path (every rank then takes the transport's).

Runs on whichever transport the run's --hetcomm-transport picks; scripts/test also runs this
folder with two simulated hosts, where the check takes its MPI form."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest

import hetcomm
from hetcomm import ReduceOp, introspect
from hetcomm.agree import Agreement, SharedRecords
from hetcomm.transports import flags

_PAD = 32  # sentinel bytes before and after each buffer
_SENTINEL = 0x5A


def _expected_form(comm) -> str:
    one_host = len(comm.topology.hosts()) == 1
    if one_host and comm.size > 1 and flags.unsupported() is None:
        return "shared memory"
    return "MPI all-reduce"


def _placed(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(backing bytes, view): `values` inside bytes whose ends hold the sentinel."""
    backing = np.full(values.nbytes + 2 * _PAD, _SENTINEL, np.uint8)
    view = backing[_PAD : _PAD + values.nbytes].view(values.dtype)
    view[...] = values
    return backing, view


def _ends_untouched(backing: np.ndarray) -> bool:
    return bool((backing[:_PAD] == _SENTINEL).all() and (backing[-_PAD:] == _SENTINEL).all())


def _mismatch_everywhere(comm, errors, what, call, buf):
    before = buf.copy()
    try:
        call()
    except hetcomm.MismatchError as exc:
        errors.expect("count differs" in str(exc), f"{what}: count not named: {exc}")
    except Exception as exc:
        errors.append(f"{what}: {type(exc).__name__} instead of MismatchError: {exc}")
    else:
        errors.append(f"{what}: no MismatchError")
    errors.expect(np.array_equal(buf, before), f"{what}: the buffer was written")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("hosts", [None, ("ha", "hb")], ids=["as-run", "two-hosts"])
def test_each_form_catches_a_mismatch_on_every_rank(hetcomm_make_comm, errors, hosts):
    comm = hetcomm_make_comm(name="forms", hosts=hosts, timeout=30)
    form = introspect.check_form(comm)
    errors.expect(form == _expected_form(comm), f"check form {form!r} on {comm.topology.hosts()}")
    if hosts is not None:
        errors.expect(form == "MPI all-reduce", f"two hosts, form {form!r}")
    odd = comm.rank == 1
    for op in ("all_reduce", "broadcast", "reduce"):
        x = np.full(6 if odd else 3, comm.rank + 1.0)
        call = {
            "all_reduce": lambda x=x: comm.all_reduce(x),
            "broadcast": lambda x=x: comm.broadcast(x, 0),
            "reduce": lambda x=x: comm.reduce(x, 0),
        }[op]
        _mismatch_everywhere(comm, errors, f"{form}: {op}", call, x)
    # and agreeing calls still work, many of them (around both rings of check slots)
    y = np.empty(3)
    for i in range(2 * Agreement.RING + 3):
        y[:] = comm.rank + i
        comm.all_reduce(y)
        if not (y == sum(r + i for r in range(comm.size))).all():
            errors.append(f"{form}: all_reduce #{i} gave {y}")
            break
    errors.verify()


def _inputs(rng, size, count, dtype, nan):
    """Every rank's input: small integers (exact in every dtype here, sums included); with
    `nan`, a NaN in a float one, which a carried MIN and MAX propagate as numpy's do (what MPI
    does with one is its own, so only sizes that ride in the records get one)."""
    if dtype == "bool":
        return rng.integers(0, 2, (size, count)).astype(bool)
    every = rng.integers(-3, 4, (size, count)).astype(dtype)
    if nan and np.dtype(dtype).kind == "f" and count > 2:
        every[size - 1, 1] = np.nan
    return every


def _reference(every: np.ndarray, op: ReduceOp, dtype: str) -> np.ndarray:
    if dtype == "bool":
        fn = {
            ReduceOp.SUM: np.any,
            ReduceOp.MAX: np.any,
            ReduceOp.PROD: np.all,
            ReduceOp.MIN: np.all,
        }
        return fn[op](every, axis=0)
    # integers wrap: reduce them in int64 and cast back (modulo, as the wire does)
    wide = every.astype(np.float64 if np.dtype(dtype).kind == "f" else np.int64)
    if op is ReduceOp.SUM:
        got = wide.sum(axis=0)
    elif op is ReduceOp.AVG:
        got = wide.sum(axis=0) / len(every)
    elif op is ReduceOp.PROD:
        got = wide.prod(axis=0)
    elif op is ReduceOp.MIN:
        got = np.minimum.reduce(wide, axis=0)
    else:
        got = np.maximum.reduce(wide, axis=0)
    return got.astype(dtype)


_DTYPES = ("float64", "float32", "float16", "int8", "uint8", "int32", "int64", "bool")


@pytest.mark.mpi(min_size=2)
def test_small_broadcasts_and_reduces_are_right(hetcomm_make_comm, hetcomm_shared_seed, errors):
    """Every dtype, root and reduce op, at sizes that ride in the records and just past them,
    in 1-D and 2-D buffers: the root's values everywhere (broadcast), the reduction at the root
    and the others' inputs as they were (reduce), the sentinels around each buffer intact."""
    comm = hetcomm_make_comm(name="carried", timeout=30)
    rng = np.random.default_rng(hetcomm_shared_seed)
    carrying = introspect.check_form(comm) == "shared memory"
    for dtype in _DTYPES:
        itemsize = np.dtype(dtype).itemsize
        fits = SharedRecords.PAYLOAD // itemsize
        for count in (1, fits, fits + 1):
            for root in range(comm.size):
                nan = carrying and count <= fits and dtype != "float16"
                every = _inputs(rng, comm.size, count, dtype, nan)
                backing, x = _placed(every[comm.rank])
                what = f"broadcast {dtype} x{count} root {root}"
                if errors.run(what, comm.broadcast, x, root):
                    errors.expect(np.array_equal(x, every[root], equal_nan=True), f"{what}: {x}")
                errors.expect(_ends_untouched(backing), f"{what}: outside the buffer written")
                ops = [ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX]
                if np.dtype(dtype).kind == "f":
                    ops.append(ReduceOp.AVG)
                for op in ops:
                    backing, x = _placed(every[comm.rank])
                    shaped = x.reshape(1, -1) if count > 1 else x
                    what = f"reduce {op} {dtype} x{count} root {root}"
                    if not errors.run(what, comm.reduce, shaped, root, op):
                        continue
                    want = _reference(every, op, dtype) if comm.rank == root else every[comm.rank]
                    ok = np.array_equal(x, want, equal_nan=True)
                    if not ok and dtype in ("float16", "float32") and comm.rank == root:
                        ok = np.allclose(x, want, rtol=1e-3, equal_nan=True)  # AVG rounding
                    errors.expect(ok, f"{what}: got {x}, want {want}")
                    errors.expect(_ends_untouched(backing), f"{what}: outside the buffer written")
    # which calls rode in the records: every small one where the check has its shared form
    carried = {r["op"]: 0 for r in comm.routes()}
    for r in comm.routes():
        carried[r["op"]] += r["carried"]
    if carrying:
        errors.expect(carried["broadcast"] > 0, f"no broadcast was carried: {comm.routes()}")
        errors.expect(carried["reduce"] > 0, f"no reduce was carried: {comm.routes()}")
    else:
        errors.expect(not any(carried.values()), f"carried without the shared form: {carried}")
    errors.verify()


def _form(comm, op: str, form: str, every: np.ndarray):
    """(call, output view, backing bytes of the output, what the output must hold) of one form
    of `op` on this rank's row of `every` (size x count)."""
    size, me = comm.size, comm.rank
    count = every.shape[1]
    block = count // size
    if op == "all_gather":
        backing, flat = _placed(np.zeros(size * count, every.dtype))
        out, want = flat.reshape(size, count), every
        if form == "in-place":
            out[me] = every[me]
            return (lambda: comm.all_gather(out, out[me])), out, backing, want
        x = every[me].copy()
        return (lambda: comm.all_gather(out, x)), out, backing, want
    if op == "all_to_all":
        want = every[:, me * block : (me + 1) * block].reshape(-1)
        if form == "in-place":
            backing, out = _placed(every[me])
            return (lambda: comm.all_to_all(out, out)), out, backing, want
        backing, out = _placed(np.zeros(count, every.dtype))
        x = every[me].copy()
        return (lambda: comm.all_to_all(out, x)), out, backing, want
    raise AssertionError(op)


@pytest.mark.mpi(min_size=2)
def test_small_collectives_of_every_rank_are_right(hetcomm_make_comm, hetcomm_shared_seed, errors):
    """all_reduce, reduce_scatter, all_gather and all_to_all of every dtype at sizes that ride
    in the records and just past them, in place and out of place: right against numpy, nothing
    outside the outputs written, and an all_reduce's bits the same on every rank (each rank
    reduces the rows in rank order)."""
    comm = hetcomm_make_comm(name="carried-all", timeout=30)
    rng = np.random.default_rng(hetcomm_shared_seed)
    carrying = introspect.check_form(comm) == "shared memory"
    size, me = comm.size, comm.rank
    for dtype in _DTYPES:
        itemsize = np.dtype(dtype).itemsize
        fits = SharedRecords.PAYLOAD // itemsize // size * size  # whole blocks per rank
        for count in (size, fits, fits + size):
            nan = carrying and count <= fits and dtype != "float16"
            every = _inputs(rng, size, count, dtype, nan)
            ops = [ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX]
            if np.dtype(dtype).kind == "f":
                ops.append(ReduceOp.AVG)
            for op in ops:
                want = _reference(every, op, dtype)
                for form in ("in-place", "out-of-place"):
                    what = f"all_reduce {op} {dtype} x{count} {form}"
                    backing, x = _placed(every[me])
                    if form == "in-place":
                        ok = errors.run(what, comm.all_reduce, x, op)
                        got, outside = x, backing
                    else:
                        outside, got = _placed(np.zeros(count, dtype))
                        ok = errors.run(what, comm.all_reduce, x, op, out=got)
                        errors.expect(np.array_equal(x, every[me], equal_nan=True), f"{what}: x")
                    if ok:
                        errors.expect(_close(got, want, dtype), f"{what}: got {got}, want {want}")
                        # the same bits on every rank
                        bits = comm.mpi.allgather(got.tobytes())
                        errors.expect(len(set(bits)) == 1, f"{what}: ranks differ")
                    errors.expect(_ends_untouched(outside), f"{what}: outside the output")
                block = count // size
                mine = want[me * block : (me + 1) * block]
                for form in ("in-place", "out-of-place"):
                    what = f"reduce_scatter {op} {dtype} x{count} {form}"
                    backing, x = _placed(every[me])
                    if form == "in-place":  # out is this rank's block of x
                        out, outside = x[me * block : (me + 1) * block], backing
                    else:
                        outside, out = _placed(np.zeros(block, dtype))
                    if errors.run(what, comm.reduce_scatter, out, x, op):
                        errors.expect(_close(out, mine, dtype), f"{what}: got {out}, want {mine}")
                    errors.expect(_ends_untouched(outside), f"{what}: outside the output")
            for op_name in ("all_gather", "all_to_all"):
                for form in ("in-place", "out-of-place"):
                    what = f"{op_name} {dtype} x{count} {form}"
                    call, out, backing, want = _form(comm, op_name, form, every)
                    if errors.run(what, call):
                        errors.expect(
                            np.array_equal(out, want, equal_nan=True), f"{what}: got {out}"
                        )
                    errors.expect(_ends_untouched(backing), f"{what}: outside the output")
    carried = {r["op"]: 0 for r in comm.routes()}
    for r in comm.routes():
        carried[r["op"]] += r["carried"]
    if carrying:
        for op in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all"):
            errors.expect(carried.get(op, 0) > 0, f"no {op} was carried: {comm.routes()}")
    else:
        errors.expect(not any(carried.values()), f"carried without the shared form: {carried}")
    errors.verify()


def _close(got: np.ndarray, want: np.ndarray, dtype: str) -> bool:
    """Equal (NaNs alike), or within float rounding for an AVG of float16/float32."""
    if np.array_equal(got, want, equal_nan=True):
        return True
    return dtype in ("float16", "float32") and bool(
        np.allclose(got, want, rtol=1e-3, equal_nan=True)
    )


def _two_per_rank(comm, op: str, x: np.ndarray, root: int, every: np.ndarray):
    """(call, what it writes, what that must hold) of `op` on this rank's `x` (its row of
    `every`, two elements per rank), its output made here where it has one."""
    size, me = comm.size, comm.rank
    out = np.zeros(size * every.shape[1] if op == "all_gather" else 2)
    if op == "broadcast":
        return partial(comm.broadcast, x, root), x, every[root]
    if op == "reduce":
        want = every.sum(axis=0) if me == root else every[me]
        return partial(comm.reduce, x, root), x, want
    if op == "all_reduce":
        return partial(comm.all_reduce, x), x, every.sum(axis=0)
    if op == "reduce_scatter":
        return partial(comm.reduce_scatter, out, x), out, every.sum(axis=0)[2 * me : 2 * me + 2]
    return partial(comm.all_gather, out, x), out, every.reshape(-1)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("odd_one", ["async", "timeout", "strided"])
def test_a_rank_off_the_carried_path_takes_every_rank_off_it(
    hetcomm_make_comm, hetcomm_shared_seed, errors, odd_one
):
    """Rank 0 calls asynchronously, with a timeout of its own, or on a strided view (which
    keeps it off the carried path) while the others call plainly: every rank reads in the
    records which path every rank takes, and takes the same one with the same results."""
    comm = hetcomm_make_comm(name="offpath", timeout=30)
    rng = np.random.default_rng(hetcomm_shared_seed)
    size, me = comm.size, comm.rank
    count = 2 * size  # two elements of every rank's block
    for round_ in range(3):
        for op in ("broadcast", "reduce", "all_reduce", "reduce_scatter", "all_gather"):
            root = round_ % size
            every = rng.integers(-9, 10, (size, count)).astype(np.float64)
            wide = np.zeros(2 * count)
            x = wide[::2] if (odd_one == "strided" and me == 0) else np.zeros(count)
            x[...] = every[me]
            kwargs = {}
            if me == 0:
                kwargs = {"async_op": True} if odd_one == "async" else {}
                if odd_one == "timeout":
                    kwargs = {"timeout": 30}
            call, got, want = _two_per_rank(comm, op, x, root, every)

            def go(call=call, kwargs=kwargs):
                work = call(**kwargs)
                if work is not None:
                    work.wait()

            what = f"{op} root {root}, rank 0 {odd_one}"
            if not errors.run(what, go):
                continue
            errors.expect(np.array_equal(got, want), f"{what}: got {got}, want {want}")
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_an_asynchronous_collective_progresses_while_its_rank_waits_in_the_next_check(
    hetcomm_make_comm, errors
):
    """Rank 0 starts an all_reduce asynchronously and calls the next one blocking; the others
    call both blocking. They wait in the first for rank 0's part, which MPI moves only inside
    an MPI call: rank 0, waiting in the second's check (shared memory: no MPI call of its
    own), must still give MPI those calls, or every rank waits for the timeout."""
    comm = hetcomm_make_comm(name="progress", timeout=10)
    x, y = np.ones(4), np.ones(4)
    for i in range(3):
        if comm.rank == 0:

            def go():
                work = comm.all_reduce(x, async_op=True)
                comm.all_reduce(y)
                work.wait()

            ok = errors.run(f"round {i}", go)
        else:
            ok = errors.run(f"round {i}", lambda: (comm.all_reduce(x), comm.all_reduce(y)))
        if not ok:
            break
        want = float(comm.size ** (i + 1))
        errors.expect((x == want).all() and (y == want).all(), f"round {i}: {x}, {y}")
    errors.verify()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("shape", [(0,), (2, 0)], ids=["0", "2x0"])
def test_empty_broadcasts_and_reduces(hetcomm_make_comm, errors, shape):
    """Nothing to carry: the operations complete (numpy can view an empty 2-D array's bytes
    only through a copy, so they take the transport) and the next call is right."""
    comm = hetcomm_make_comm(name="empty", timeout=30)
    for call in (comm.broadcast, comm.reduce):
        errors.run(f"{call.__name__} of {shape}", call, np.zeros(shape), 0)
    x = np.full(3, comm.rank + 1.0)
    if errors.run("broadcast afterwards", comm.broadcast, x, 1):
        errors.expect((x == 2.0).all(), f"broadcast afterwards gave {x}")
    errors.verify()


def _async_case(comm, op: str, i: int, every: np.ndarray):
    """(call, output, backing bytes around the output, what the output must hold) of
    collective `i` of the asynchronous test: `op` on this rank's row of `every`, in place on
    even `i`, out of place on odd."""
    size, me = comm.size, comm.rank
    count, root = every.shape[1], i % size
    block = count // size
    total = every.astype(np.float64).sum(axis=0)
    if op == "all_gather":
        backing, flat = _placed(np.zeros(size * count))
        out = flat.reshape(size, count)
        if i % 2 == 0:
            out[me] = every[me]
            return partial(comm.all_gather, out, out[me]), out, backing, every
        return partial(comm.all_gather, out, every[me].copy()), out, backing, every
    if op == "all_to_all":
        want = every[:, me * block : (me + 1) * block].reshape(-1)
        if i % 2 == 0:
            backing, out = _placed(every[me])
            return partial(comm.all_to_all, out, out), out, backing, want
        backing, out = _placed(np.zeros(count))
        return partial(comm.all_to_all, out, every[me].copy()), out, backing, want
    if op == "broadcast":
        backing, x = _placed(every[me])
        return partial(comm.broadcast, x, root), x, backing, every[root]
    if op == "reduce":
        backing, x = _placed(every[me])
        want = total if me == root else every[me]
        return partial(comm.reduce, x, root), x, backing, want
    if op == "all_reduce":
        backing, x = _placed(every[me])
        if i % 2 == 0:
            return partial(comm.all_reduce, x), x, backing, total
        backing, out = _placed(np.zeros(count))
        return partial(comm.all_reduce, x, out=out), out, backing, total
    # reduce_scatter
    mine = total[me * block : (me + 1) * block]
    backing, x = _placed(every[me])
    if i % 2 == 0:
        return (
            partial(comm.reduce_scatter, x[me * block : (me + 1) * block], x),
            x[me * block : (me + 1) * block],
            backing,
            mine,
        )
    backing, out = _placed(np.zeros(block))
    return partial(comm.reduce_scatter, out, x), out, backing, mine


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("starts", ["prepared", "general"])
def test_asynchronous_small_collectives_ride_in_the_records(
    hetcomm_make_comm, hetcomm_shared_seed, errors, monkeypatch, starts
):
    """Many small asynchronous collectives in flight at once (more than the records' ring, so
    records are written again while earlier calls have not landed), every op and form, some
    ranks calling a collective blocking where others call it asynchronously, waited for in a
    different order on each rank: each lands right (against float64 numpy), nothing outside
    its output written, and where the check has its shared form every one rode in the records
    (the transport moved none of them). `general`: transports without prepared asynchronous
    starts (as the mpi transport over an MPI without persistent collectives)."""
    comm = hetcomm_make_comm(name="carried-async", timeout=30)
    if starts == "general":
        introspect.transport_of(comm, "all_reduce", np.zeros(1))  # made now, before any route
        for t in introspect.transports(comm).values():
            monkeypatch.setattr(t, "prepare_async", None, raising=False)
    rng = np.random.default_rng(hetcomm_shared_seed)
    carrying = introspect.check_form(comm) == "shared memory"
    size, me = comm.size, comm.rank
    ops = ("broadcast", "reduce", "all_reduce", "reduce_scatter", "all_gather", "all_to_all")
    count = 4 * size  # float64: 32 * size bytes, within a record for every size tested
    n = 3 * Agreement.SHARED_RING + 5
    cases, works = [], []
    for i in range(n):
        op = ops[i % len(ops)]
        every = rng.integers(-9, 10, (size, count)).astype(np.float64)
        call, out, backing, want = _async_case(comm, op, i, every)
        blocking = (i + me) % 7 == 0  # some ranks blocking where the others are not
        what = f"#{i} {op} ({'blocking' if blocking else 'async'})"
        try:
            work = call() if blocking else call(async_op=True)
        except Exception as exc:
            errors.append(f"{what}: {type(exc).__name__}: {exc}")
            break
        cases.append((what, out, backing, want))
        if work is not None:
            works.append((what, work))
    order = np.random.default_rng(me).permutation(len(works))
    for k in order:
        what, work = works[k]
        errors.run(f"{what}: wait", work.wait)
    for what, out, backing, want in cases:
        errors.expect(np.array_equal(out, want), f"{what}: got {out}, want {want}")
        errors.expect(_ends_untouched(backing), f"{what}: outside the output written")
    carried = sum(r["carried"] for r in comm.routes())
    if carrying:
        errors.expect(carried == len(cases), f"{carried} of {len(cases)} carried: {comm.routes()}")
    else:
        errors.expect(carried == 0, f"carried without the shared form: {comm.routes()}")
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_an_asynchronous_mismatch_is_caught_on_every_rank(hetcomm_make_comm, errors):
    """Rank 1 all_reduces twice the elements the others do, every rank asynchronously: a
    MismatchError on every rank (at the call or at its wait), every buffer as it was, and
    the next agreeing collective right."""
    comm = hetcomm_make_comm(name="async-mismatch", timeout=30)
    x = np.full(6 if comm.rank == 1 else 3, comm.rank + 1.0)

    def call():
        work = comm.all_reduce(x, async_op=True)
        work.wait()

    _mismatch_everywhere(comm, errors, "async all_reduce", call, x)
    y = np.full(3, comm.rank + 1.0)
    if errors.run("all_reduce after", lambda: comm.all_reduce(y, async_op=True).wait()):
        want = sum(range(1, comm.size + 1))
        errors.expect((y == want).all(), f"all_reduce after the mismatch: {y}")
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_asynchronous_calls_whose_records_are_not_carried_take_the_general_path(
    hetcomm_make_comm, hetcomm_shared_seed, errors, monkeypatch
):
    """Transports without prepared asynchronous starts; rank 0 calls each collective on a
    strided view (off the records' path), the others asynchronously: they read that in the
    records after their check and start the general path then, with the sequence number they
    entered; every result right against numpy."""
    comm = hetcomm_make_comm(name="carried-general", timeout=30)
    introspect.transport_of(comm, "all_reduce", np.zeros(1))
    for t in introspect.transports(comm).values():
        monkeypatch.setattr(t, "prepare_async", None, raising=False)
    rng = np.random.default_rng(hetcomm_shared_seed)
    size, me = comm.size, comm.rank
    count = 2 * size
    for round_ in range(2):
        for op in ("broadcast", "reduce", "all_reduce", "reduce_scatter", "all_gather"):
            root = round_ % size
            every = rng.integers(-9, 10, (size, count)).astype(np.float64)
            wide = np.zeros(2 * count)
            x = wide[::2] if me == 0 else np.zeros(count)
            x[...] = every[me]
            call, got, want = _two_per_rank(comm, op, x, root, every)

            def go(call=call):
                work = call() if me == 0 else call(async_op=True)
                if work is not None:
                    work.wait()

            what = f"{op} root {root}"
            if errors.run(what, go):
                errors.expect(np.array_equal(got, want), f"{what}: got {got}, want {want}")
    carried = sum(r["carried"] for r in comm.routes())
    errors.expect(carried == 0, f"{carried} carried with rank 0 off the path: {comm.routes()}")
    errors.verify()
