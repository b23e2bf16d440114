"""The resolved route is the rule: every op form, called again, takes the route its first call
made (counted by Communicator.routes()), and stays right when the signature changes between
calls, under asynchronous use beside blocking calls, and refuses at once after an abort."""

from __future__ import annotations

import time

import numpy as np
import pytest

import hetcomm

_PAD = 4  # sentinel elements before and after each array handed to hetcomm
_SENTINEL = 777  # exact in every dtype used here, and no result is as large


def _placed(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(backing, view): `values` inside a backing array whose ends hold the sentinel."""
    backing = np.full(values.size + 2 * _PAD, _SENTINEL, values.dtype)
    view = backing[_PAD : _PAD + values.size]
    view[...] = values
    return backing, view


def _ends_untouched(backing: np.ndarray) -> bool:
    return bool((backing[:_PAD] == _SENTINEL).all() and (backing[-_PAD:] == _SENTINEL).all())


def _stack(rng: np.random.Generator, size: int, count: int, dtype: str) -> np.ndarray:
    """Every rank's input (small integers: exact in every dtype used here)."""
    return rng.integers(-50, 50, (size, count)).astype(dtype)


class _Form:
    """One op form: `call(comm, arrays)` and the numpy result it must give this rank."""

    def __init__(self, name, op, build, call, expect):
        self.name, self.op, self.build, self.call, self.expect = name, op, build, call, expect


def _forms(size: int, rank: int) -> list[_Form]:
    def ar_build(stack):
        return {"x": _placed(stack[rank].copy())}

    def scatter_inplace_build(stack):
        return {"x": _placed(stack[rank].copy()), "block": block(stack, rank)}

    def ar_out_build(stack):
        return {"x": _placed(stack[rank].copy()), "out": _placed(np.zeros_like(stack[rank]))}

    def gather_build(stack):
        return {"x": _placed(stack[rank].copy()), "out": _placed(np.zeros(stack.size, stack.dtype))}

    def gather_inplace_build(stack):
        out = _placed(np.zeros(stack.size, stack.dtype))
        n = stack.shape[1]
        out[1][rank * n : (rank + 1) * n] = stack[rank]
        return {"out": out, "x_block": (rank * n, (rank + 1) * n)}

    def scatter_build(stack):
        n = stack.shape[1] // size
        return {"x": _placed(stack[rank].copy()), "out": _placed(np.zeros(n, stack.dtype))}

    def a2a_inplace_build(stack):
        return {"x": _placed(stack[rank].copy())}

    def x(a):
        return a["x"][1]

    def out(a):
        return a["out"][1]

    def block(stack, r):
        n = stack.shape[1] // size
        return slice(r * n, (r + 1) * n)

    def scatter_inplace_expect(stack):
        # out is x's own block: it takes the reduction, the rest of x stays as it was
        got = stack[rank].copy()
        got[block(stack, rank)] = stack.sum(0)[block(stack, rank)]
        return got

    def a2a_expect(stack):
        return np.concatenate([stack[r][block(stack, rank)] for r in range(size)])

    return [
        _Form(
            "all_reduce in place",
            "all_reduce",
            ar_build,
            lambda c, a, **kw: c.all_reduce(x(a), **kw),
            lambda s: ("x", s.sum(0)),
        ),
        _Form(
            "all_reduce out of place",
            "all_reduce",
            ar_out_build,
            lambda c, a, **kw: c.all_reduce(x(a), "max", out=out(a), **kw),
            lambda s: ("out", s.max(0)),
        ),
        _Form(
            "reduce",
            "reduce",
            ar_build,
            lambda c, a, **kw: c.reduce(x(a), size - 1, "sum", **kw),
            lambda s: ("x", s.sum(0) if rank == size - 1 else s[rank]),
        ),
        _Form(
            "broadcast",
            "broadcast",
            ar_build,
            lambda c, a, **kw: c.broadcast(x(a), root=size - 1, **kw),
            lambda s: ("x", s[size - 1]),
        ),
        _Form(
            "all_gather",
            "all_gather",
            gather_build,
            lambda c, a, **kw: c.all_gather(out(a), x(a), **kw),
            lambda s: ("out", s.reshape(-1)),
        ),
        _Form(
            "all_gather in place",
            "all_gather",
            gather_inplace_build,
            lambda c, a, **kw: c.all_gather(out(a), out(a)[slice(*a["x_block"])], **kw),
            lambda s: ("out", s.reshape(-1)),
        ),
        _Form(
            "reduce_scatter",
            "reduce_scatter",
            scatter_build,
            lambda c, a, **kw: c.reduce_scatter(out(a), x(a), **kw),
            lambda s: ("out", s.sum(0)[block(s, rank)]),
        ),
        _Form(
            "reduce_scatter in place",
            "reduce_scatter",
            scatter_inplace_build,
            lambda c, a, **kw: c.reduce_scatter(x(a)[a["block"]], x(a), **kw),
            lambda s: ("x", scatter_inplace_expect(s)),
        ),
        _Form(
            "all_to_all",
            "all_to_all",
            ar_out_build,
            lambda c, a, **kw: c.all_to_all(out(a), x(a), **kw),
            lambda s: ("out", a2a_expect(s)),
        ),
        _Form(
            "all_to_all in place",
            "all_to_all",
            a2a_inplace_build,
            lambda c, a, **kw: c.all_to_all(x(a), x(a), **kw),
            lambda s: ("x", a2a_expect(s)),
        ),
    ]


def _check(form, arrays, stack, errors, what):
    which, want = form.expect(stack)
    _, view = arrays[which]
    errors.expect(np.array_equal(view, want), f"{what}: {which} = {view} != {want}")
    for name, value in arrays.items():
        if isinstance(value, tuple) and isinstance(value[0], np.ndarray):
            errors.expect(_ends_untouched(value[0]), f"{what}: wrote outside {name}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("own", [None, 45.0], ids=["config-timeout", "own-timeout"])
def test_every_form_repeated_takes_its_route(hetcomm_comm, rng, errors, own):
    """Three calls of each form: one route, made once, serving all three (the prepared call
    where the transport has one), each result right and nothing outside it touched; a call
    with a timeout of its own takes the same route."""
    comm = hetcomm_comm
    size, rank = comm.size, comm.rank
    count = 4 * size
    kw = {} if own is None else {"timeout": own}
    for form in _forms(size, rank):
        keys_before = len(comm.routes())
        for i in range(3):
            stack = _stack(rng, size, count, "float64")
            arrays = form.build(stack)
            form.call(comm, arrays, **kw)
            _check(form, arrays, stack, errors, f"{form.name} call {i}")
        routes = [r for r in comm.routes() if r["op"] == form.op]
        errors.expect(
            len(comm.routes()) <= keys_before + 1,
            f"{form.name}: {len(comm.routes()) - keys_before} routes made for one signature",
        )
        served = [r for r in routes if r["runs"] + r["uses"] >= 3]
        errors.expect(bool(served), f"{form.name}: no route served three calls: {routes}")
        for r in served:
            if r["prepared"]:
                errors.expect(r["runs"] >= 3, f"{form.name}: prepared route ran {r['runs']} of 3")
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_every_form_async_takes_its_prepared_start(hetcomm_comm, rng, errors):
    """Each form asynchronous, three calls per signature and two signatures (dtype and count
    change between them), then every form in flight at once, waited for last to first: each
    result right, nothing outside it touched; where the route has a prepared start (the mpi
    transport's persistent collectives, staged's shared segment), every call takes it and none the
    general path."""
    comm = hetcomm_comm
    size, rank = comm.size, comm.rank
    forms = _forms(size, rank)
    for form in forms:
        for count, dtype in ((4 * size, "float64"), (2 * size, "int32")):
            for i in range(3):
                stack = _stack(rng, size, count, dtype)
                arrays = form.build(stack)
                form.call(comm, arrays, async_op=True).wait()
                _check(form, arrays, stack, errors, f"{form.name} {dtype} async call {i}")
    segment = _staged_segment(comm)
    for r in comm.routes():  # forms of one signature (in place or not) share a route
        if r["prepared_async"]:
            errors.expect(r["runs"] in (3, 6) and r["uses"] == 0, f"start not taken: {r}")
        elif r["transport"] == "mpi" or (r["transport"] == "staged" and segment):
            errors.expect(False, f"a route without a prepared start: {r}")
    stacks = [_stack(rng, size, 4 * size, "float64") for _ in forms]
    built = [form.build(stack) for form, stack in zip(forms, stacks, strict=True)]
    works = [form.call(comm, a, async_op=True) for form, a in zip(forms, built, strict=True)]
    for w in reversed(works):
        w.wait()
    for form, arrays, stack in zip(forms, built, stacks, strict=True):
        _check(form, arrays, stack, errors, f"{form.name} in flight with the others")
    errors.verify()


def _waited(form, comm, arrays):
    form.call(comm, arrays, async_op=True).wait()


def _staged_segment(comm) -> bool:
    """Whether `comm` runs collectives on the staged transport through its shared segment
    (every rank on one host, the rails not MPI's): the same answer on every rank."""
    from hetcomm import introspect
    from hetcomm.transports import hostcoll

    staged = introspect.transport_of(comm, "all_reduce", np.zeros(1))
    if staged.name != "staged" or staged.mode == "mpi":
        return False
    return hostcoll.unavailable(comm.topology) is None


@pytest.mark.mpi(min_size=2)
def test_async_starts_where_the_segment_cannot_grow(
    hetcomm_make_comm, hetcomm_transport, rng, errors, monkeypatch
):
    """staged: every form asynchronous through its prepared start where the shared segment
    cannot be made at its size (as with /dev/shm full, on every rank): each call's turn
    comes on a driver thread, which finds the segment cannot take it and runs the general
    path's ring, on a copy of an input that overlaps its output; each result right,
    nothing outside it touched, every call through the prepared start."""
    from hetcomm.transports import hostcoll

    if hetcomm_transport not in ("staged", "auto"):
        pytest.skip(f"a staged test; this run's transport is {hetcomm_transport}")
    comm = hetcomm_make_comm(transport="staged", timeout=60)
    if not _staged_segment(comm):
        pytest.skip("the staged transport has no shared segment here (ranks on two hosts)")
    grew = []
    monkeypatch.setattr(hostcoll.HostGroup, "_grow", lambda *a: grew.append(a) or False)
    size, rank = comm.size, comm.rank
    for form in _forms(size, rank):
        for i in range(2):
            # above what rides in the check's records (hetcomm.carried)
            stack = _stack(rng, size, 48 * size, "float64")
            arrays = form.build(stack)
            if errors.run(f"{form.name} call {i}", _waited, form, comm, arrays):
                _check(form, arrays, stack, errors, f"{form.name} call {i}")
    errors.expect(
        len(grew) >= 2 * len(_forms(size, rank)), f"the segment was asked to grow {len(grew)} times"
    )
    for r in comm.routes():
        errors.expect(r["prepared_async"] and r["uses"] == 0, f"start not taken: {r}")
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_in_place_forms_take_the_prepared_call(hetcomm_comm, rng, errors):
    """On the mpi transport the in-place all_gather, reduce_scatter and all_to_all are
    MPI_IN_PLACE calls of the prepared route, and on the staged transport's shared segment
    its prepared calls (they copy the input in before writing the output), not the general
    path's packed copies."""
    comm = hetcomm_comm
    size, rank = comm.size, comm.rank
    forms = [f for f in _forms(size, rank) if f.name.endswith("in place") and f.op != "all_reduce"]
    for form in forms:
        stack = _stack(rng, size, 2 * size, "int32")
        arrays = form.build(stack)
        form.call(comm, arrays)
        _check(form, arrays, stack, errors, form.name)
        (route,) = [r for r in comm.routes() if r["op"] == form.op]
        if route["transport"] == "mpi" or (route["transport"] == "staged" and route["prepared"]):
            errors.expect(
                route["runs"] == 1 and route["uses"] == 0,
                f"{form.name}: runs {route['runs']}, general {route['uses']}",
            )
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_signature_changes_between_calls(hetcomm_comm, rng, errors):
    """Calls alternating count, dtype and buffer each get their own route and the right
    result; going back to an earlier signature takes its route again."""
    comm = hetcomm_comm
    size, rank = comm.size, comm.rank
    signatures = [(5, "float64"), (6, "int32"), (5, "float32"), (1, "float64"), (5, "float64")]
    for count, dtype in signatures * 2:
        stack = _stack(rng, size, count, dtype)
        backing, x = _placed(stack[rank].copy())
        comm.all_reduce(x)
        errors.expect(np.array_equal(x, stack.sum(0)), f"{count} x {dtype}: {x}")
        errors.expect(_ends_untouched(backing), f"{count} x {dtype}: wrote outside x")
    routes = [r for r in comm.routes() if r["op"] == "all_reduce"]
    errors.expect(len(routes) == 4, f"{len(routes)} all_reduce routes for 4 signatures")
    calls = sorted(r["runs"] + r["uses"] for r in routes)
    errors.expect(calls == [2, 2, 2, 4], f"calls per route {calls}")
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_async_sends_beside_blocking_collectives(hetcomm_comm, rng, errors):
    """Asynchronous sends and receives in a ring, started before blocking collectives and
    waited for after them, in several rounds: every message and every reduction right; the
    prepared asynchronous start serves them where the transport has one."""
    comm = hetcomm_comm
    size, rank = comm.size, comm.rank
    right, left = (rank + 1) % size, (rank - 1) % size
    for i in range(4):
        msgs = rng.standard_normal((size, 9))
        got = np.full(9, np.nan)
        recv = comm.recv(got, left, tag=3, async_op=True)
        send = comm.send(msgs[rank].copy(), right, tag=3, async_op=True)
        stack = _stack(rng, size, 3, "int64")
        y = stack[rank].copy()
        comm.all_reduce(y)
        errors.expect(np.array_equal(y, stack.sum(0)), f"round {i}: all_reduce {y}")
        send.wait()
        recv.wait()
        errors.expect(np.array_equal(got, msgs[left]), f"round {i}: received {got}")
        errors.expect(recv.source == left, f"round {i}: source {recv.source}")
    for r in comm.routes():
        if r["op"] in ("send", "recv") and r["prepared_async"]:
            errors.expect(r["runs"] == 4, f"{r['op']}: prepared start ran {r['runs']} of 4")
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_cached_routes_refuse_after_an_abort(hetcomm_comm, errors):
    """A communicator aborted by a timeout refuses its already-resolved calls, blocking and
    asynchronous, at once."""
    lonely = hetcomm_comm.dup(name="fast-abort")
    try:
        x = np.ones(3)
        lonely.all_reduce(x)
        lonely.all_reduce(x, async_op=True).wait()  # its asynchronous route resolved too
        lonely.barrier()
        if lonely.rank == 0:
            lonely.send(x, 1, async_op=True).wait()
            try:
                lonely.recv(x, src=1, tag=9, timeout=0.3)
            except hetcomm.CommTimeout:
                pass
            else:
                errors.append("recv with nobody sending returned")
            for name, call in {
                "all_reduce": lambda: lonely.all_reduce(x),
                "all_reduce async": lambda: lonely.all_reduce(x, async_op=True),
                "send async": lambda: lonely.send(x, 1, async_op=True),
                "barrier": lonely.barrier,
            }.items():
                try:
                    call()
                except hetcomm.CommAborted:
                    pass
                else:
                    errors.append(f"{name} on an aborted communicator returned")
        elif lonely.rank == 1:
            lonely.recv(np.zeros(3), 0)
        # rank 1 closes only after rank 0 timed out (a peer seen closing is PeerLost instead)
        hetcomm_comm.barrier()
    finally:
        lonely.close()
    errors.verify()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", ["all_reduce", "broadcast", "recv"])
def test_a_prepared_call_keeps_its_own_timeout(hetcomm_comm, errors, op):
    """A blocking call with `timeout=` that nobody meets ends in CommTimeout after its own
    seconds, not the group's, and says so; where its route is prepared, the prepared call
    served it; the shorter limit is not left behind for the calls after it."""
    lonely = hetcomm_comm.dup(name=f"own-timeout-{op}")
    try:
        x = np.ones(3)
        calls = {
            "all_reduce": lambda: lonely.all_reduce(x, timeout=0.4),
            "broadcast": lambda: lonely.broadcast(x, 0, timeout=0.4),
            "recv": lambda: lonely.recv(x, src=1, tag=5, timeout=0.4),
        }
        lonely.all_reduce(x)
        lonely.broadcast(x, 0)
        if lonely.rank == 0:
            t0 = time.monotonic()
            try:
                calls[op]()
            except hetcomm.CommTimeout as exc:
                took = time.monotonic() - t0
                errors.expect(exc.waited == 0.4, f"{op}: reported {exc.waited} s, not 0.4")
                errors.expect(took < 10, f"{op}: timed out after {took:.1f} s, asked 0.4 s")
                errors.expect(lonely.call_timeout is None, "limit left behind")
            else:
                errors.append(f"{op} that nobody met returned")
            route = [r for r in lonely.routes() if r["op"] == op][-1]
            if route["prepared"]:
                errors.expect(route["runs"] >= 1, f"{op}: the timed call took the general path")
        # the others close only after rank 0 timed out (a peer seen closing is PeerLost);
        # the group's own limit is longer than rank 0's wait
        hetcomm_comm.barrier()
    finally:
        lonely.close()
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_small_collectives_in_different_forms_on_different_ranks(hetcomm_comm, rng, errors):
    """One collective called blocking with a contiguous array on some ranks (the prepared
    call) and asynchronous with a strided view on the others (the general path): the forms
    meet, and every rank gets the reference, bit for bit the same as every other."""
    comm = hetcomm_comm
    size, rank = comm.size, comm.rank
    odd = rank % 2 == 1
    for count in (1, 7, 32, 33):
        stack = rng.standard_normal((size, count))
        backing = np.full(2 * count, np.nan)
        x = backing[::2] if odd else stack[rank].copy()
        x[...] = stack[rank]
        if odd:
            comm.all_reduce(x, async_op=True).wait()
        else:
            comm.all_reduce(x)
        want = stack[0].copy()
        for r in range(1, size):
            want += stack[r]
        errors.expect(np.allclose(x, want, rtol=1e-12), f"all_reduce {count}: {x} != {want}")
        every = comm.mpi.allgather(np.ascontiguousarray(x).tobytes())
        errors.expect(len(set(every)) == 1, f"all_reduce {count}: ranks' bits differ")
        errors.expect(np.isnan(backing[1::2]).all() if odd else True, "wrote between elements")
        y = np.zeros(count)
        y[...] = stack[rank] if rank == 0 else 0.0
        if odd:
            comm.broadcast(y, 0, async_op=True).wait()
        else:
            comm.broadcast(y, 0)
        errors.expect(np.array_equal(y, stack[0]), f"broadcast {count}: {y}")
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_large_forms_take_the_prepared_call_on_the_lane_or_here(hetcomm_comm, rng, errors):
    """Past 256 KiB every form stays right and takes its prepared call; on the mpi transport
    that call is made and polled by the calling thread unless its op and size run blocking on
    the lane (LANE_MIN, or what `hetcomm tune` measured), where it is queued on the lane and
    waited for: with the built-in table, the all_gather, all_to_all and reduce_scatter forms
    and the broadcast here run on the calling thread, the all-reduces and the reduce on the
    lane (one job per call)."""
    from hetcomm import introspect
    from hetcomm.transports.mpi.schedule import LANE_MIN, laned

    comm = hetcomm_comm
    size, rank = comm.size, comm.rank
    count = 40960 * size  # 320 KiB x size of float64 per rank: past 256 KiB, under 2 MiB
    for form in _forms(size, rank):
        transport = introspect.transport_of(comm, form.op, np.zeros(count))
        jobs = introspect.lane(transport).submitted if transport.name == "mpi" else 0
        for i in range(2):
            stack = _stack(rng, size, count, "float64")
            arrays = form.build(stack)
            form.call(comm, arrays)
            _check(form, arrays, stack, errors, f"{form.name} call {i} of {count}")
        (route,) = [r for r in comm.routes() if r["op"] == form.op and r["runs"] + r["uses"] >= 2][
            -1:
        ] or [None]
        if route is None or route["transport"] != "mpi":
            continue
        nbytes = count * 8 * (size if form.op == "all_gather" else 1)
        on_lane = laned(transport.lane_min, form.op, nbytes)
        if transport.lane_min == LANE_MIN:
            errors.expect(
                on_lane == (form.op in ("all_reduce", "reduce")),
                f"{form.name}: {nbytes} bytes {'on' if on_lane else 'off'} the lane",
            )
        errors.expect(route["runs"] >= 2, f"{form.name}: not prepared, yet {route}")
        queued = introspect.lane(transport).submitted - jobs
        errors.expect(
            queued == (2 if on_lane else 0), f"{form.name}: {queued} lane jobs for 2 calls"
        )
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_a_large_async_collective_moves_while_nobody_polls(hetcomm_comm, rng, errors):
    """An asynchronous all_gather of 16 MiB finishes while the caller makes no MPI call: on the
    mpi transport it runs on the lane (MPI moves a request only inside MPI calls, so one
    started from the calling thread would wait for the caller's next poll)."""
    import time

    from hetcomm import introspect

    comm = hetcomm_comm
    size, rank = comm.size, comm.rank
    count = (16 << 20) // 8 // size
    stack = rng.standard_normal((size, count))
    out = np.zeros(size * count)
    comm.barrier()
    work = comm.all_gather(out, stack[rank].copy(), async_op=True)
    time.sleep(1.0)  # about 200 times the operation's own time on a 2-core VM; no MPI call
    if introspect.transport_of(comm, "all_gather", out).name == "mpi":
        errors.expect(work.test(), "the all_gather had not finished a second after its start")
    work.wait()
    errors.expect(np.array_equal(out, stack.reshape(-1)), "all_gather result")
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_a_laned_in_place_reduce_scatter_reads_a_copy_of_its_input(hetcomm_comm, rng, errors):
    """A reduce_scatter past 4 MiB of input runs on the lane (the built-in table); its output
    inside its input (this rank's block) gets the sum of every rank's block, and the rest of
    the input stays as it was, call after call."""
    from hetcomm import introspect
    from hetcomm.transports.mpi.schedule import LANE_MIN

    comm = hetcomm_comm
    size, rank = comm.size, comm.rank
    block = (5 << 20) // 8 // size  # 5 MiB of float64 input per rank
    transport = introspect.transport_of(comm, "reduce_scatter", np.zeros(block * size))
    jobs = introspect.lane(transport).submitted if transport.name == "mpi" else 0
    for i in range(2):
        stack = _stack(rng, size, block * size, "float64")
        x = stack[rank].copy()
        comm.reduce_scatter(x[rank * block : (rank + 1) * block], x)
        want = stack.sum(axis=0, dtype=np.float64)[rank * block : (rank + 1) * block]
        mine = x[rank * block : (rank + 1) * block]
        errors.expect(np.array_equal(mine, want), f"call {i}: the block sums")
        rest = np.delete(np.arange(size * block), np.s_[rank * block : (rank + 1) * block])
        errors.expect(np.array_equal(x[rest], stack[rank][rest]), f"call {i}: x outside out")
    if transport.name == "mpi" and transport.lane_min == LANE_MIN:
        queued = introspect.lane(transport).submitted - jobs
        errors.expect(queued == 2, f"{queued} lane jobs for 2 calls")
    errors.verify()
