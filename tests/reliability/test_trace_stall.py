"""HETCOMM_TRACE and HETCOMM_STALL without MPI: the options, the trace writer and its merge,
the stall warning of Work.wait(). A stand-in communicator carries the name and the config."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hetcomm import trace, work
from hetcomm.config import Config, option_table
from hetcomm.errors import CommTimeout, ConfigError, InvalidArgument
from hetcomm.work import Work

ROOT = Path(__file__).resolve().parent.parent.parent


def fake_comm(name: str = "g", **options: Any) -> Any:
    aborted: list[BaseException] = []
    return SimpleNamespace(
        name=name,
        config=Config(**options),
        _abort=aborted.append,
        aborted=aborted,
        late=lambda op, seq: ([2], "ranks [3] are on other hosts"),
    )


def after(seconds: float) -> Any:
    """A poll that says complete once `seconds` have passed since its first call, which comes
    after the Work took its start time: a traced span is never shorter than `seconds`."""
    end: list[float] = []

    def poll() -> bool:
        now = time.perf_counter()
        if not end:
            end.append(now + seconds)
        return now >= end[0]

    return poll


@pytest.fixture(autouse=True)
def untraced() -> Iterator[None]:
    """Each test starts and ends with tracing undecided and no other observer, as in a fresh
    process."""

    def fresh() -> None:
        for fn in work.observers():
            work.remove_observer(fn)
        trace.reset()

    fresh()
    yield
    fresh()


# ---- the options ---------------------------------------------------------------------------


def test_stall_and_trace_defaults_and_environment() -> None:
    assert (Config().stall, Config().trace) == (60.0, None)
    c = Config.load({"HETCOMM_STALL": " 2.5 ", "HETCOMM_TRACE": "/tmp/t"})
    assert (c.stall, c.trace) == (2.5, "/tmp/t")
    assert Config.load({"HETCOMM_TRACE": ""}).trace is None
    assert Config.load({"HETCOMM_STALL": "5"}, stall=7).stall == 7.0
    table = {row[0]: row[1] for row in option_table()}
    assert (table["HETCOMM_STALL"], table["HETCOMM_TRACE"]) == ("60.0", "off")


@pytest.mark.parametrize("bad", [0, -1, True, "5", float("nan")])
def test_stall_must_be_positive_seconds(bad: Any) -> None:
    with pytest.raises(ConfigError, match="stall: expected a positive number of seconds"):
        Config(stall=bad)


@pytest.mark.parametrize("raw", ["soon", "", "1s"])
def test_stall_variable_must_be_a_number(raw: str) -> None:
    with pytest.raises(ConfigError, match="HETCOMM_STALL: expected seconds"):
        Config.load({"HETCOMM_STALL": raw})


@pytest.mark.parametrize("bad", ["", "  ", 3])
def test_trace_must_be_a_directory_name(bad: Any) -> None:
    with pytest.raises(ConfigError, match="trace: expected a directory"):
        Config(trace=bad)


# ---- the stall warning --------------------------------------------------------------------------


def _stall_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "hetcomm" and r.levelno == logging.WARNING
    ]


def test_stall_warns_once_then_completes(caplog: pytest.LogCaptureFixture) -> None:
    comm = fake_comm("dp", stall=0.05, timeout=5)
    w = Work(comm, "all_reduce", 7, after(0.4))
    with caplog.at_level(logging.WARNING, logger="hetcomm"):
        w.wait()
    warnings = _stall_warnings(caplog)
    assert len(warnings) == 1, warnings
    msg = warnings[0]
    assert msg.startswith("group 'dp': all_reduce #7 has waited 0.")
    assert "without completing (CommTimeout in 4." in msg
    # the communicator says who is late: the fake says rank 2, and that rank 3 cannot be read
    assert "ranks not arrived: [2]; ranks [3] are on other hosts" in msg
    assert w.test() and not comm.aborted


def test_stall_warns_once_then_times_out(caplog: pytest.LogCaptureFixture) -> None:
    comm = fake_comm("pp", stall=0.05, timeout=0.5)
    w = Work(comm, "recv", 3, lambda: False)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="hetcomm"), pytest.raises(CommTimeout):
        w.wait()
    assert 0.5 <= time.monotonic() - start < 2
    assert len(_stall_warnings(caplog)) == 1
    assert len(comm.aborted) == 1


def test_no_stall_warning_before_stall(caplog: pytest.LogCaptureFixture) -> None:
    comm = fake_comm(stall=5, timeout=5)
    with caplog.at_level(logging.WARNING, logger="hetcomm"):
        Work(comm, "barrier", 1, after(0.1)).wait()
        with pytest.raises(CommTimeout):
            Work(comm, "barrier", 2, lambda: False).wait(timeout=0.2)  # the limit comes first
    assert _stall_warnings(caplog) == []


def test_stall_warning_says_where_every_thread_is(caplog: pytest.LogCaptureFixture) -> None:
    """The warning carries the stack of each thread of the rank: the waiting one, and one
    blocked elsewhere (here a helper thread parked in a function of its own)."""
    release = threading.Event()

    def parked_helper() -> None:
        release.wait(5)

    helper = threading.Thread(target=parked_helper, name="hetcomm-test-helper")
    helper.start()
    try:
        comm = fake_comm(stall=0.05, timeout=5)
        with caplog.at_level(logging.WARNING, logger="hetcomm"):
            Work(comm, "send", 4, after(0.3)).wait()
    finally:
        release.set()
        helper.join()
    (msg,) = _stall_warnings(caplog)
    where = msg.split("where each thread of this rank is:\n", 1)[1]
    assert "thread 'hetcomm-test-helper':" in where and "in parked_helper" in where
    assert "thread 'MainThread':" in where and "in _warn_stall" in where


def test_stall_warning_with_a_waiter(caplog: pytest.LogCaptureFixture) -> None:
    comm = fake_comm(stall=0.05, timeout=5)
    w = Work(comm, "broadcast", 2, after(0.3), waiter=lambda s: time.sleep(min(s, 0.02)) or False)
    with caplog.at_level(logging.WARNING, logger="hetcomm"):
        w.wait()
    assert len(_stall_warnings(caplog)) == 1


# ---- the trace writer -----------------------------------------------------------------------


def _complete(comm: Any, op: str, seq: int, info: dict[str, Any] | None = None) -> Work:
    w = Work(comm, op, seq, lambda: True)
    w.info = info
    assert w.test()
    return w


def test_undecided_tracing_is_an_observer() -> None:
    # the communicator takes its Work-less blocking calls only while nobody observes: before the
    # first completion has decided, tracing's decision observes
    assert work.observing and len(work.observers()) == 1
    _complete(fake_comm(), "all_reduce", 1)
    assert not work.observing


def test_observers_see_each_completed_operation_once(tmp_path: Path) -> None:
    _complete(fake_comm(), "barrier", 1)  # decide tracing: off
    seen: list[tuple[str, int]] = []
    also: list[int] = []

    def note(w: Work) -> None:
        seen.append((w.op, w.seq))

    work.add_observer(note)
    work.add_observer(note)  # registered once
    work.add_observer(lambda w: also.append(w.seq))
    assert work.observing and len(work.observers()) == 2
    comm = fake_comm()
    _complete(comm, "all_reduce", 2)
    Work(comm, "broadcast", 3, after(0.002)).wait()
    work.wait_for(comm, "all_gather", 4, lambda: True)  # a step inside an operation: not told
    work.completed(comm, "reduce", 5)  # nothing to move: not told
    with pytest.raises(RuntimeError):
        Work(comm, "send", 6, lambda: (_ for _ in ()).throw(RuntimeError("x"))).test()
    assert seen == [("all_reduce", 2), ("broadcast", 3)] and also == [2, 3]
    assert work.remove_observer(note) and not work.remove_observer(note)
    _complete(comm, "all_reduce", 7)
    assert seen == [("all_reduce", 2), ("broadcast", 3)] and also == [2, 3, 7]
    for fn in work.observers():
        work.remove_observer(fn)
    assert not work.observing and work.observers() == ()


def test_an_observer_must_be_callable() -> None:
    with pytest.raises(InvalidArgument, match="add_observer: expected a callable, got str"):
        work.add_observer("trace")  # type: ignore[arg-type]


def test_tracing_beside_another_observer(tmp_path: Path) -> None:
    seen: list[int] = []
    work.add_observer(lambda w: seen.append(w.seq))
    comm = fake_comm("world", trace=str(tmp_path))
    _complete(comm, "all_reduce", 1)  # decides: traced
    _complete(comm, "all_reduce", 2)
    writer = trace.current()
    assert writer is not None and writer.count == 2 and seen == [1, 2]
    trace.disable()
    _complete(comm, "all_reduce", 3)
    assert writer.count == 2 and seen == [1, 2, 3] and len(work.observers()) == 1


def test_tracing_off_records_nothing(tmp_path: Path) -> None:
    _complete(fake_comm(), "all_reduce", 1)
    assert work.observers() == ()  # decided by the first completion: off
    assert not work.observing
    assert trace.current() is None
    assert list(tmp_path.iterdir()) == []


def test_tracing_decided_by_the_config(tmp_path: Path) -> None:
    d = tmp_path / "traces"
    comm = fake_comm("world", trace=str(d))
    _complete(comm, "all_reduce", 1, {"transport": "mpi", "bytes": 4096, "stages": 1})
    _complete(comm, "broadcast", 2)
    writer = trace.current()
    assert writer is not None and writer.count == 2
    trace.disable()
    data = json.loads(Path(writer.path).read_text())
    spans = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in spans] == ["all_reduce", "broadcast"]
    first = spans[0]
    assert first["args"] == {
        "op": "all_reduce",
        "seq": 1,
        "group": "world",
        "transport": "mpi",
        "bytes": 4096,
        "stages": 1,
    }
    assert {k: spans[1]["args"][k] for k in ("transport", "bytes", "stages")} == dict.fromkeys(
        ("transport", "bytes", "stages")
    )
    assert first["pid"] == 0 and first["dur"] >= 0
    assert abs(first["ts"] / 1e6 - time.time()) < 60  # wall-clock microseconds
    names = {
        e["tid"]: e["args"]["name"]
        for e in data["traceEvents"]
        if e["ph"] == "M" and e["name"] == "thread_name"
    }
    assert names == {first["tid"]: "world"}


def test_writer_flushes_every_n_events_and_stays_valid(tmp_path: Path) -> None:
    writer = trace.enable(str(tmp_path), rank=3, flush_every=4)
    a, b = fake_comm("a"), fake_comm("b")
    for i in range(10):
        w = Work(a if i % 2 else b, "all_gather", i, after(0.001))
        w.wait()

        def spans() -> list[dict[str, Any]]:
            events = json.loads(Path(writer.path).read_text())["traceEvents"]
            return [e for e in events if e["ph"] == "X"]

        # a complete JSON document after every write, at most 4 events (metadata included) behind
        assert i + 1 - 4 < len(spans()) <= i + 1
    trace.disable()
    got = spans()
    assert len(got) == 10 and {e["pid"] for e in got} == {3}
    assert all(e["dur"] >= 1000 for e in got)  # each waited at least 1 ms
    assert len({e["tid"] for e in got}) == 2
    assert Path(writer.path).name == "trace-rank00003.json"


def test_failed_and_empty_operations_are_not_traced(tmp_path: Path) -> None:
    writer = trace.enable(str(tmp_path), rank=0)
    comm = fake_comm()

    def boom() -> bool:
        raise RuntimeError("transport failed")

    with pytest.raises(RuntimeError):
        Work(comm, "all_reduce", 1, boom).test()
    work.completed(comm, "all_reduce", 2)  # nothing to move
    assert writer.count == 0


def _two_ranks(tmp_path: Path) -> Path:
    for rank in (1, 0):
        trace.enable(str(tmp_path), rank=rank)
        _complete(fake_comm("world"), "all_reduce", 1)
        _complete(fake_comm("world.0"), "barrier", 1)
        trace.disable()
    return tmp_path


def test_merge_puts_every_rank_in_one_trace(tmp_path: Path) -> None:
    d = _two_ranks(tmp_path / "t")
    out = tmp_path / "merged.json"
    assert trace.merge(str(d), str(out)) == 4
    data = json.loads(out.read_text())
    spans = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert sorted(e["pid"] for e in spans) == [0, 0, 1, 1]
    assert [e["ts"] for e in spans] == sorted(e["ts"] for e in spans)
    process_names = [e for e in data["traceEvents"] if e["name"] == "process_name"]
    assert sorted(e["pid"] for e in process_names) == [0, 1]


def test_merge_reads_a_file_cut_short(tmp_path: Path) -> None:
    d = _two_ranks(tmp_path / "t")
    path = d / "trace-rank00001.json"
    text = path.read_text()
    path.write_text(text[: text.rindex("]}")] + '{"name":"half an ev')  # a rank killed mid-write
    assert trace.merge(str(d), str(tmp_path / "m.json")) == 4


def test_merge_script(tmp_path: Path) -> None:
    d = _two_ranks(tmp_path / "t")
    out = tmp_path / "merged.json"
    done = subprocess.run(
        [str(ROOT / "scripts" / "merge-trace"), str(d), str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "PYTHONPATH": ""},
    )
    assert done.returncode == 0, done.stderr
    assert "4 operations" in done.stdout
    assert len(json.loads(out.read_text())["traceEvents"]) > 4
    bad = subprocess.run(
        [str(ROOT / "scripts" / "merge-trace"), str(tmp_path / "none"), str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert bad.returncode == 1 and "no trace-rank*.json files" in bad.stderr
