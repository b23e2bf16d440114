"""`hetcomm bench --latency` without MPI: rows, table, parser, JSON, timing and the check."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hetcomm.bench.latency_calls import Arrays, Buffers, fill, pingpong_peer, result, wrong
from hetcomm.bench.latency_table import (
    COLUMNS,
    FORMS,
    TORCH_FORMS,
    LatencyRow,
    iterations,
    parse_table,
    pingpong,
    select_forms,
    table,
    to_json,
    torch_goal_us,
)
from hetcomm.bench.timing import (
    Interleaved,
    Stat,
    paired_difference,
    paired_ratio,
    round_orders,
    summarize,
)


def _rows(rng: np.random.Generator) -> list[LatencyRow]:
    rows = []
    for op, form in FORMS:
        h, f = rng.uniform(1, 500, 2)
        rows.append(LatencyRow("host", op, form, 8, h, f, "mpi4py", 0.25, 0, None))
    rows.append(LatencyRow("torch", "all_reduce", "in-place", 8, 40.0, 5.0, "trivial-pg"))
    rows.append(LatencyRow("device", "sendrecv", "ping-pong", 65536, None, 24.4, "two-copies"))
    return rows


def test_row_ratio_is_hetcomm_over_floor_unless_given():
    row = LatencyRow("host", "barrier", "-", 0, 6.0, 1.5, "mpi4py")
    assert row.ratio == pytest.approx(4.0)
    assert LatencyRow("host", "barrier", "-", 0, 6.0, 1.5, "mpi4py", ratio=3.0).ratio == 3.0
    assert LatencyRow("host", "barrier", "-", 0, None, 1.5, "mpi4py").ratio is None
    assert LatencyRow("host", "barrier", "-", 0, 2.0, 0.0, "mpi4py").ratio is None
    with pytest.raises(ValueError, match="section must be one of"):
        LatencyRow("gpu", "barrier", "-", 0, 1.0, 1.0, "mpi4py")


def test_table_parses_back_cell_for_cell():
    rng = np.random.default_rng()
    rows = _rows(rng)
    meta = {"command": "hetcomm bench --latency -b 8", "date": "2026-12-01", "rounds": 7}
    text = table(rows, meta)
    lines = text.splitlines()
    assert lines[0] == "# hetcomm bench --latency: hetcomm bench --latency -b 8"
    assert "# date: 2026-12-01" in lines
    assert any("median over 7 interleaved rounds" in ln for ln in lines)
    assert any("one way = round trip / 2" in ln for ln in lines)
    parsed = parse_table(text)
    assert len(parsed) == len(rows)
    assert [p["section"] for p in parsed] == [r.section for r in rows]
    for p, r in zip(parsed, rows):
        assert set(p) == {"section"} | {name for name, _ in COLUMNS}
        assert (p["op"], p["form"], int(p["bytes"])) == (r.op, r.form, r.bytes)
        if r.hetcomm_us is None:
            assert p["hetcomm(us)"] == "-" and p["ratio"] == "-"
        else:
            assert float(p["hetcomm(us)"]) == pytest.approx(r.hetcomm_us, rel=0.01, abs=0.01)
            assert float(p["ratio"]) == pytest.approx(r.hetcomm_us / r.floor_us, rel=0.01, abs=0.01)
        assert float(p["floor(us)"]) == pytest.approx(r.floor_us, rel=0.01, abs=0.01)
        assert p["floor"] == r.floor
        assert p["gloo(us)"] == "-"
    # one column line per section present, none for an absent one
    assert sum(ln.startswith("#") and "floor(us)" in ln for ln in lines) == 3


def test_parse_table_rejects_a_short_line():
    with pytest.raises(ValueError, match="cells in a data line"):
        parse_table("# section host: x\n  all_reduce in-place 8 1.0\n")


def test_json_holds_meta_and_every_field():
    rows = _rows(np.random.default_rng())
    data = json.loads(to_json(rows, {"ranks": 2, "transport": "mpi"}))
    assert data["meta"] == {"ranks": 2, "transport": "mpi"}
    assert len(data["rows"]) == len(rows)
    first = data["rows"][0]
    assert first["op"] == FORMS[0][0] and first["form"] == FORMS[0][1]
    assert first["ratio"] == pytest.approx(rows[0].ratio)
    assert set(first) >= {"section", "bytes", "hetcomm_us", "floor_us", "spread", "wrong"}


def test_every_api_op_form_has_a_row():
    ops = {op for op, _ in FORMS}
    assert ops == {
        "all_reduce",
        "reduce",
        "broadcast",
        "all_gather",
        "reduce_scatter",
        "all_to_all",
        "sendrecv",
        "barrier",
        "all_reduce_coalesced",
    }
    assert ("all_reduce", "out-of-place") in FORMS and ("all_reduce", "in-place") in FORMS
    # send/recv as a ping-pong of blocking and of asynchronous calls, and Communicator.sendrecv
    forms = [f for op, f in FORMS if op == "sendrecv"]
    assert forms == ["ping-pong", "async", "exchange", "exchange-async"]
    assert [pingpong(*f) for f in FORMS if f[0] == "sendrecv"] == [True, True, False, False]
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert (op, "in-place") in FORMS and (op, "out-of-place") in FORMS
    assert {op for op, _ in TORCH_FORMS} == {
        "all_reduce",
        "broadcast",
        "all_gather_single",
        "sendrecv",
    }


def test_select_forms_and_iterations():
    assert select_forms(None, FORMS) == list(FORMS)
    assert select_forms("sendrecv, barrier", FORMS) == [
        ("sendrecv", "ping-pong"),
        ("sendrecv", "async"),
        ("sendrecv", "exchange"),
        ("sendrecv", "exchange-async"),
        ("barrier", "-"),
    ]
    assert select_forms("barrier", TORCH_FORMS) == []
    with pytest.raises(ValueError, match="unknown op"):
        select_forms("allreduce2", FORMS)
    assert iterations(8, 100, 10) == 100
    assert iterations(8192, 100, 10) == 100
    assert iterations(8193, 100, 10) == 10
    with pytest.raises(ValueError):
        iterations(8, 0, 10)


def test_torch_goal():
    assert torch_goal_us(1.0) == 10.0
    assert torch_goal_us(5.0) == 15.0


def test_pingpong_pairs():
    assert [pingpong_peer(r, 4) for r in range(4)] == [1, 0, 3, 2]
    assert [pingpong_peer(r, 3) for r in range(3)] == [1, 0, None]


# ---- timing ------------------------------------------------------------------------------------


def test_summarize_takes_the_slowest_rank_of_each_round():
    rng = np.random.default_rng()
    per_rank = rng.uniform(1e-6, 1e-3, (3, 9))
    stat = summarize(per_rank.tolist())
    worst = per_rank.max(axis=0)
    assert stat.rounds == pytest.approx(tuple(worst))
    assert stat.median == pytest.approx(float(np.median(worst)))
    assert stat.spread == pytest.approx((worst.max() - worst.min()) / np.median(worst))
    with pytest.raises(ValueError, match="same number of rounds"):
        summarize([[1.0, 2.0], [1.0]])
    assert summarize([]).median == 0.0 and summarize([[]]).spread == 0.0


def test_paired_ratio_and_difference_per_round():
    a, b = Stat((2.0, 9.0, 4.0)), Stat((1.0, 3.0, 4.0))
    assert paired_ratio(a, b) == pytest.approx(2.0)  # ratios 2, 3, 1
    assert paired_difference(a, b) == pytest.approx(1.0)  # differences 1, 6, 0
    assert paired_ratio(a, Stat((1.0, 0.0, 1.0))) is None
    with pytest.raises(ValueError, match="paired rounds differ"):
        paired_ratio(a, Stat((1.0,)))


def test_round_orders_are_fresh_permutations_and_repeatable():
    names = [f"impl{i}" for i in range(5)]
    orders = round_orders(names, 30, seed=3)
    assert orders == round_orders(names, 30, seed=3)
    assert all(sorted(o) == sorted(names) for o in orders)
    assert len({tuple(o) for o in orders}) > 1
    assert {o[0] for o in orders} == set(names)  # every implementation gets to go first


class _OneRank:
    """The part of an mpi4py communicator Interleaved uses, for a single process."""

    def __init__(self) -> None:
        self.barriers = 0

    def Barrier(self) -> None:
        self.barriers += 1

    def allgather(self, value):
        return [value]


def test_interleaved_runs_every_implementation_every_round():
    comm = _OneRank()
    calls: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    seen: list[str] = []

    def make(name):
        def run(n):
            calls[name].append(n)
            seen.append(name)

        return run

    synced = []
    timing = Interleaved(comm, 6, sync=lambda: synced.append(1))
    stats = timing.measure({k: make(k) for k in calls}, calls=7, warmup=2)
    assert set(stats) == {"a", "b", "c"}
    for name in calls:
        assert calls[name] == [2] + [7] * 6  # the warm-up, then one sample per round
        assert len(stats[name].rounds) == 6 and all(v >= 0 for v in stats[name].rounds)
    timed = seen[3:]
    assert [sorted(timed[i : i + 3]) for i in range(0, 18, 3)] == [["a", "b", "c"]] * 6
    assert comm.barriers == 18
    assert len(synced) == 1 + 18
    with pytest.raises(ValueError):
        timing.measure({"a": make("a")}, calls=0)
    with pytest.raises(ValueError):
        Interleaved(comm, 0)


# ---- the correctness check: every form against a numpy reference of the filled inputs -------

RANKS = 3


def _reference(op: str, form: str, inputs: list[np.ndarray], rank: int) -> np.ndarray:
    """rank's correct result from every rank's inputs, in float64."""
    n, total = len(inputs), np.sum(inputs, axis=0, dtype=np.float64)
    if op in ("all_reduce", "all_reduce_coalesced"):
        return total
    if op == "reduce":
        return total if rank == 0 else inputs[rank]
    if op == "broadcast":
        return inputs[0]
    if op in ("all_gather", "all_gather_single"):
        return np.concatenate(inputs)
    if op == "reduce_scatter":
        return np.split(total, n)[rank]
    if op == "all_to_all":
        return np.concatenate([np.split(x, n)[rank] for x in inputs])
    if op == "sendrecv":
        return inputs[pingpong_peer(rank, n) or 0]
    raise AssertionError(op)


def _inputs(b: Buffers) -> np.ndarray:
    if b.op == "all_reduce_coalesced":
        return np.concatenate(b.pieces).astype(np.float64)
    if b.op in ("all_gather", "all_gather_single"):
        return np.asarray(b.x, dtype=np.float64).copy()
    return np.asarray(b.x, dtype=np.float64).copy()


def _write(b: Buffers, values: np.ndarray) -> None:
    if b.op == "all_reduce_coalesced":
        for piece, v in zip(b.pieces, np.array_split(values, len(b.pieces))):
            piece[...] = v
    else:
        result(b)[...] = values


@pytest.mark.parametrize(("op", "form"), [f for f in FORMS + TORCH_FORMS if f[0] != "barrier"])
@pytest.mark.parametrize("dtype", ["float32", "int32"])
def test_check_counts_exactly_the_wrong_elements(op, form, dtype):
    host = Arrays("cpu")
    count = 4 * RANKS
    sets = [Buffers(host, op, form, count, dtype, r, RANKS) for r in range(RANKS)]
    for b in sets:
        fill(host, b, dtype)
    if form == "in-place" and op == "all_gather":  # the other blocks start as -1
        assert np.count_nonzero(sets[0].y == -1) == count - count // RANKS
    inputs = [_inputs(b) for b in sets]
    for rank in (0, RANKS - 1):
        b = sets[rank]
        peer = pingpong_peer(rank, RANKS) if op == "sendrecv" else None
        if op == "sendrecv" and peer is None:
            assert wrong(host, b, dtype, None) == 0
            continue
        want = _reference(op, form, inputs, rank)
        _write(b, want)
        assert wrong(host, b, dtype, peer) == 0
        if op == "reduce" and rank != 0:
            continue  # off the root reduce defines no result
        bad = np.random.default_rng().choice(want.size, size=min(2, want.size), replace=False)
        broken = want.copy()
        broken[bad] += 1
        _write(b, broken)
        assert wrong(host, b, dtype, peer) == len(bad)


def test_in_place_buffers_are_views_of_one_array():
    host = Arrays("cpu")
    ag = Buffers(host, "all_gather", "in-place", 12, "float32", 1, 3)
    assert np.shares_memory(ag.x, ag.y) and ag.x.size == 4
    rs = Buffers(host, "reduce_scatter", "in-place", 12, "float32", 2, 3)
    assert np.shares_memory(rs.x, rs.y) and rs.y.size == 4
    out = Buffers(host, "all_gather", "out-of-place", 12, "float32", 1, 3)
    assert not np.shares_memory(out.x, out.y)
    co = Buffers(host, "all_reduce_coalesced", "in-place", 10, "float32", 0, 2)
    assert [p.size for p in co.pieces] == [3, 3, 2, 2]
    assert Buffers(host, "barrier", "-", 0, "float32", 0, 2).x is None
    with pytest.raises(ValueError, match="no buffers"):
        Buffers(host, "scatter", "-", 4, "float32", 0, 2)


def test_mismatch_switch_follows_the_config_field():
    import dataclasses

    import hetcomm
    from hetcomm.bench.latency import MISMATCH_CHECK_FIELD, mismatch_config

    config, state = mismatch_config("mpi", mismatch_check=False)
    assert config.transport == "mpi"
    if MISMATCH_CHECK_FIELD in {f.name for f in dataclasses.fields(hetcomm.Config)}:
        assert getattr(config, MISMATCH_CHECK_FIELD) is False and state.startswith("off")
        on, on_state = mismatch_config("staged", mismatch_check=True)
        assert on.transport == "staged" and on_state.startswith("on")
    else:
        assert f"no Config field {MISMATCH_CHECK_FIELD!r}" in state
        assert "nothing to switch off" in state
