"""Pure parts of `hetcomm tune`: choosing from medians, the cache file, keying, precedence."""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import pytest

from hetcomm import tune, tuning
from hetcomm.config import Config
from hetcomm.errors import ConfigError
from hetcomm.plan import DIRECT_MIN_BYTES
from hetcomm.transports.staged.links import RailSpec
from hetcomm.transports.staged.schedule import RAIL_DEPTH, rail_key, rail_windows
from hetcomm.tuning import Tuning

FP = "0123456789abcdef"


def good_file(**changes: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "schema": tuning.SCHEMA,
        "fingerprint": FP,
        "hetcomm": "0.1.0",
        "measured": "2026-11-29T10:00:00+00:00",
        "ranks": 2,
        "hosts": ["vm"],
        "vendors": ["cpu"],
        "memory": "host",
        "repeats": 3,
        "message_bytes": 4 << 20,
        "chunk_bytes": {"value": 1 << 20, "median_s": {"262144": 0.02, "1048576": 0.01}},
        "slots": {"value": 4, "median_s": {"2": 0.03, "4": 0.02}},
        "rails": {
            "tcp 10.0.0.1->10.0.0.2": {"GBps": 2.0, "weight": 1.0},
            "tcp 10.1.0.1->10.1.0.2": {"GBps": 0.5, "weight": 0.25},
        },
        "direct_min": {
            "value": 65536,
            "sizes": [4096, 65536, 1 << 20],
            "direct_s": [2.0, 1.0, 0.1],
            "staged_s": [1.0, 0.5, 0.2],
        },
    }
    data.update(changes)
    return data


class FakeComm:
    """The two calls lookup() makes, as rank `rank` of a job whose rank 0 found `root_value`."""

    def __init__(self, rank: int, root_value: Any = None) -> None:
        self.rank, self.root_value = rank, root_value
        self.sent: list[Any] = []

    def Get_rank(self) -> int:
        return self.rank

    def bcast(self, value: Any, root: int) -> Any:
        assert root == 0
        self.sent.append(value)
        return value if self.rank == 0 else self.root_value


# ---- choosing ---------------------------------------------------------------------------------


def test_fastest_picks_the_smallest_median_and_the_smaller_setting_on_a_tie() -> None:
    assert tune.fastest({1 << 20: 0.5, 2 << 20: 0.3, 4 << 20: 0.4}) == 2 << 20
    assert tune.fastest({8: 0.2, 4: 0.2, 16: 0.3}) == 4


@pytest.mark.parametrize("bad", [{}, {1: 0.0}, {1: -1.0}, {1: float("nan")}, {1: float("inf")}])
def test_fastest_refuses_missing_or_impossible_times(bad: dict[int, float]) -> None:
    with pytest.raises(ValueError, match="fastest"):
        tune.fastest(bad)


SIZES = [4096, 65536, 1 << 20, 16 << 20]


@pytest.mark.parametrize(
    "direct, staged, expected",
    [
        ([1, 1, 1, 1], [2, 2, 2, 2], 0),  # direct always wins
        ([3, 1, 1, 1], [2, 2, 2, 2], 4096),  # staged wins only at the smallest size
        ([3, 3, 1, 1], [2, 2, 2, 2], 65536),
        ([1, 3, 1, 1], [2, 2, 2, 2], 65536),  # a win below a loss does not count
        ([3, 3, 3, 3], [2, 2, 2, 2], 16 << 20),  # direct never wins: everything tried stays
        ([1, 1, 1, 3], [2, 2, 2, 2], 16 << 20),  # direct loses at the top
        ([2, 2, 1, 1], [2, 2, 2, 2], 65536),  # a tie is no win
    ],
)
def test_crossover_is_the_largest_size_staged_still_won(
    direct: list[float], staged: list[float], expected: int
) -> None:
    assert tune.crossover(SIZES, direct, staged) == expected


@pytest.mark.parametrize(
    "sizes, direct, staged, match",
    [
        ([], [], [], "one time of each"),
        ([1, 2], [1.0], [1.0, 2.0], "one time of each"),
        ([2, 1], [1.0, 1.0], [1.0, 1.0], "ascending"),
        ([1, 1], [1.0, 1.0], [1.0, 1.0], "distinct"),
    ],
)
def test_crossover_refuses_bad_input(
    sizes: list[int], direct: list[float], staged: list[float], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        tune.crossover(sizes, direct, staged)


@pytest.mark.parametrize(
    "lane_s, caller_s, expected",
    [
        ([2.0, 3.0, 4.0], [1.0, 2.0, 3.0], None),  # the caller's call wins everywhere
        ([2.0, 1.0, 1.0], [1.0, 2.0, 3.0], 64),  # the lane wins from 1 KiB on
        ([1.0, 1.0, 1.0], [2.0, 2.0, 2.0], 32),  # everywhere: from half the smallest size
        ([1.0, 3.0, 1.0], [2.0, 2.0, 2.0], 1024),  # only the run of wins to the top counts
        ([1.0, 1.0, 3.0], [2.0, 2.0, 2.0], None),  # the caller wins at the top
    ],
)
def test_lane_min_is_where_the_lane_wins_up_to_the_largest_size(
    lane_s: list[float], caller_s: list[float], expected: int | None
) -> None:
    assert tune.lane_min([64, 1024, 65536], lane_s, caller_s) == expected


def test_lane_min_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="one time of each"):
        tune.lane_min([64, 1024], [1.0], [1.0, 2.0])


def test_rail_weights_are_relative_to_the_fastest_rail_of_each_kind() -> None:
    w = tune.rail_weights({"tcp a->b": 4.0, "tcp c->d": 1.0, "shm": 10.0, "mpi": 0.5})
    assert w == {"tcp a->b": 1.0, "tcp c->d": 0.25, "shm": 1.0, "mpi": 1.0}


def test_rail_windows_bound_several_tcp_rails_by_their_weights() -> None:
    keys = ["tcp a->b", "tcp c->d"]
    assert rail_windows(keys, {"tcp a->b": 1.0, "tcp c->d": 0.25}) == [RAIL_DEPTH, 1]
    assert rail_windows(keys, {"tcp a->b": 0.5, "tcp c->d": 0.5}) == [RAIL_DEPTH, RAIL_DEPTH]
    assert rail_windows(keys, {"tcp a->b": 1.0, "tcp c->d": 0.01}) == [RAIL_DEPTH, 1]
    # a rail without a weight: equal windows, so that no rail takes every chunk
    assert rail_windows(keys, {"tcp a->b": 1.0}) == [RAIL_DEPTH, RAIL_DEPTH]
    assert rail_windows(["tcp a->b"], {"tcp a->b": 1.0}) == [None]
    assert rail_windows(["shm"], {"shm": 1.0}) == [None]
    assert rail_windows(keys, {}) == [RAIL_DEPTH, RAIL_DEPTH]


def test_rail_key_drops_the_port() -> None:
    assert rail_key(RailSpec("tcp", 0, "10.0.0.1", "10.0.0.2", 40001)) == "tcp 10.0.0.1->10.0.0.2"
    assert rail_key(RailSpec("shm", 0)) == "shm"
    assert rail_key(RailSpec("mpi", 0)) == "mpi"


# ---- precedence ---------------------------------------------------------------------------------


def tuned(direct_min: int | None = 65536) -> Tuning:
    return Tuning(
        FP,
        1 << 20,
        4,
        {},
        direct_min,
        "" if direct_min is not None else "not measured",
        path="/x/f.json",
    )


def test_explicit_direct_min_beats_tuned_which_beats_the_default() -> None:
    assert tuning.resolve_direct_min(None, None) == (DIRECT_MIN_BYTES, "built-in default")
    assert tuning.resolve_direct_min(None, tuned()) == (65536, "tuned (/x/f.json)")
    assert tuning.resolve_direct_min(None, tuned(None)) == (DIRECT_MIN_BYTES, "built-in default")
    assert tuning.resolve_direct_min(123, tuned()) == (123, "HETCOMM_DIRECT_MIN")
    assert tuning.resolve_direct_min(0, tuned()) == (0, "HETCOMM_DIRECT_MIN")  # 0 is explicit too


def test_adopt_resolves_direct_min_from_the_environment_first() -> None:
    assert tuning.adopt(Config.load({}), tuned()).direct_min == 65536
    assert tuning.adopt(Config.load({"HETCOMM_DIRECT_MIN": "7"}), tuned()).direct_min == 7
    assert tuning.adopt(Config.load({}), None).direct_min == DIRECT_MIN_BYTES
    c = tuning.adopt(Config.load({}), tuned())
    assert c.tuned is not None and c.tuned.chunk_bytes == 1 << 20
    assert c.with_options(timeout=5).tuned is c.tuned  # sub-communicators' configs keep it


def test_tune_dir_option() -> None:
    assert Config().tune_dir == "~/.cache/hetcomm/tune"
    assert Config.load({"HETCOMM_TUNE_DIR": " /tmp/t "}).tune_dir == "/tmp/t"
    assert Config.load({"HETCOMM_TUNE_DIR": ""}).tune_dir == "off"
    assert tuning.cache_dir(Config(tune_dir="OFF")) is None
    assert tuning.cache_dir(Config(tune_dir="~/t")) == Path(os.path.expanduser("~/t"))
    for bad in ("", "  ", 3):
        with pytest.raises(ConfigError, match="tune_dir: expected a directory"):
            Config(tune_dir=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="direct_min: expected a number of bytes >= 0"):
        Config(direct_min=-1)


# ---- the file -----------------------------------------------------------------------------------


def test_a_written_file_reads_back(tmp_path: Path) -> None:
    path = tuning.cache_path(tmp_path / "new" / "dir", FP)
    tune.write(path, good_file())
    assert path.name == f"{FP}.json"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left
    t = tuning.read(path, FP)
    assert t == Tuning(
        FP,
        1 << 20,
        4,
        {"tcp 10.0.0.1->10.0.0.2": 1.0, "tcp 10.1.0.1->10.1.0.2": 0.25},
        65536,
        "",
        "2026-11-29T10:00:00+00:00",
        "0.1.0",
        str(path),
    )
    assert "chunk bytes:  1048576" in t.summary() and "direct_min:   65536" in t.summary()
    assert "lane_min:     not measured (built-in)" in t.summary()


def test_a_measured_lane_min_reads_back(tmp_path: Path) -> None:
    path = tuning.cache_path(tmp_path, FP)
    lanes = {"value": {"all_reduce": 262144, "broadcast": None}, "sizes": [262144]}
    tune.write(path, good_file(lane_min=lanes))
    t = tuning.read(path, FP)
    assert t is not None and t.lane_min == {"all_reduce": 262144, "broadcast": None}
    assert "lane_min:     all_reduce 262144, broadcast never" in t.summary()
    assert "lane_min     all_reduce 262144, broadcast never" in tune.describe(
        good_file(lane_min=lanes)
    )


def test_a_direct_min_not_measured_keeps_its_reason(tmp_path: Path) -> None:
    path = tuning.cache_path(tmp_path, FP)
    tune.write(path, good_file(direct_min={"value": None, "note": "not measured: no GPU"}))
    t = tuning.read(path, FP)
    assert t is not None and t.direct_min is None and t.direct_note == "not measured: no GPU"
    assert "direct_min:   not measured: no GPU" in t.summary()


def test_the_file_is_keyed_by_the_fingerprint(tmp_path: Path) -> None:
    assert tuning.cache_path(tmp_path, FP) != tuning.cache_path(tmp_path, "fedcba9876543210")
    for bad in ("", "../etc/passwd", "ABC", "a/b"):
        with pytest.raises(ValueError, match="fingerprint"):
            tuning.cache_path(tmp_path, bad)


def test_a_missing_file_is_silently_absent(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="hetcomm"):
        assert tuning.read(tmp_path / f"{FP}.json", FP) is None
    assert caplog.records == []


BAD_FILES = [
    ("{not json", "Expecting"),
    ("[1, 2]", "expected a JSON object"),
    (json.dumps(good_file(schema=99)), "schema 99"),
    (json.dumps(good_file(fingerprint="fedcba9876543210")), "measured for topology 'fedcba"),
    (json.dumps(good_file(chunk_bytes={"value": 100})), "chunk_bytes: expected an int >= 4096"),
    (json.dumps(good_file(chunk_bytes={"value": "8M"})), "chunk_bytes"),
    (json.dumps(good_file(chunk_bytes=8 << 20)), "chunk_bytes"),
    (json.dumps(good_file(slots={"value": 1})), "slots: expected an int >= 2"),
    (json.dumps(good_file(slots={"value": True})), "slots"),
    (json.dumps(good_file(rails={"shm": {"weight": 0}})), r"rails\['shm'\]"),
    (json.dumps(good_file(rails={"shm": {"weight": 1.5}})), r"rails\['shm'\]"),
    (json.dumps(good_file(rails=[])), "rails: expected an object"),
    (json.dumps(good_file(direct_min={"value": -1})), "direct_min: expected bytes >= 0"),
    (json.dumps(good_file(direct_min={"value": None})), "null without a note"),
    (json.dumps(good_file(direct_min=5)), "direct_min: expected an object"),
    (json.dumps(good_file(measured=None)), "measured: expected a string"),
    (json.dumps(good_file(lane_min={"value": [1]})), "lane_min: expected an object"),
    (json.dumps(good_file(lane_min={"value": {"gather": 1}})), "unknown collective 'gather'"),
    (json.dumps(good_file(lane_min={"value": {"reduce": -1}})), r"lane_min\['reduce'\]"),
    (json.dumps(good_file(lane_min={"value": {"reduce": True}})), r"lane_min\['reduce'\]"),
]


@pytest.mark.parametrize("text, reason", BAD_FILES)
def test_a_corrupt_or_mismatched_file_is_ignored_with_one_warning_naming_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, text: str, reason: str
) -> None:
    path = tmp_path / f"{FP}.json"
    path.write_text(text)
    with caplog.at_level(logging.WARNING, logger="hetcomm"):
        assert tuning.read(path, FP) is None
        assert tuning.read(path, FP) is None  # the same file again: no second warning
    assert len(caplog.records) == 1, caplog.records
    message = caplog.records[0].getMessage()
    assert str(path) in message and message.startswith("ignoring tuning file")
    assert re.search(reason, message), message


def test_an_unreadable_file_is_ignored_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / f"{FP}.json"
    path.mkdir()  # reading a directory fails with an OSError
    with caplog.at_level(logging.WARNING, logger="hetcomm"):
        assert tuning.read(path, FP) is None
    assert len(caplog.records) == 1 and str(path) in caplog.records[0].getMessage()


def test_lookup_reads_on_rank_0_only_and_broadcasts(tmp_path: Path) -> None:
    config = Config(tune_dir=str(tmp_path))
    tune.write(tuning.cache_path(tmp_path, FP), good_file())
    root = FakeComm(0)
    found = tuning.lookup(root, FP, config)
    assert found is not None and found.chunk_bytes == 1 << 20 and root.sent == [found]
    # another rank takes what rank 0 sent, whatever its own file system says now
    tune.write(tuning.cache_path(tmp_path, FP), good_file(chunk_bytes={"value": 4096}))
    other = FakeComm(1, root_value=found)
    assert tuning.lookup(other, FP, config) is found and other.sent == [None]


def test_lookup_with_the_directory_off_reads_nothing(tmp_path: Path) -> None:
    tune.write(tuning.cache_path(tmp_path, FP), good_file())
    assert tuning.lookup(FakeComm(0), FP, Config(tune_dir="off")) is None
    assert tuning.lookup(FakeComm(0), "fedcba9876543210", Config(tune_dir=str(tmp_path))) is None


def test_write_replaces_atomically_and_cleans_up_on_failure(tmp_path: Path) -> None:
    path = tuning.cache_path(tmp_path, FP)
    tune.write(path, good_file())
    with pytest.raises(TypeError):
        tune.write(path, {"bad": object()})  # not JSON: the old file stays whole
    assert tuning.read(path, FP) is not None
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_describe_shows_every_value() -> None:
    text = tune.describe(good_file())
    for part in (
        "chunk_bytes  1048576",
        "slots        4",
        "tcp 10.1.0.1->10.1.0.2",
        "weight 0.25",
        "direct_min   65536",
    ):
        assert part in text, text
