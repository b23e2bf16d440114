"""Unit tests for hetcomm.config: defaults, HETCOMM_* variables, validation, transport specs."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np
import pytest

from hetcomm.config import (
    ENV_NAMES,
    LOG_LEVELS,
    OPTIONS,
    PERSISTENT_MAX_BYTES,
    TRANSPORT_NAMES,
    VENDORS,
    Config,
    option_table,
    parse_transport,
)
from hetcomm.errors import ConfigError, HetcommError

EVERY_VARIABLE = {
    "HETCOMM_TIMEOUT": "12.5",
    "HETCOMM_TRANSPORT": "dp:nccl,pp:staged",
    "HETCOMM_DEBUG": "1",
    "HETCOMM_VENDOR": "amd",
    "HETCOMM_HOST": "node7",
    "HETCOMM_RAILS": "eth0,ib0",
    "HETCOMM_LOG": "debug",
    "HETCOMM_STALL": "30",
    "HETCOMM_TRACE": "/tmp/traces",
}


# ---- defaults --------------------------------------------------------------------------------


def test_defaults() -> None:
    c = Config()
    assert c.timeout == 300.0
    assert isinstance(c.timeout, float)
    assert c.transport == "auto"
    assert c.debug is False
    assert c.vendor is None
    assert c.host is None
    assert c.rails == "auto"
    assert c.log == "warning"


def test_load_with_empty_environ_gives_defaults() -> None:
    assert Config.load({}) == Config()


def test_load_ignores_variables_without_the_prefix() -> None:
    env = {
        "PATH": "/usr/bin",
        "OMPI_COMM_WORLD_RANK": "3",
        "HETCOMMTIMEOUT": "x",
        "hetcomm_log": "?",
    }
    assert Config.load(env) == Config()


def test_every_option_has_a_field_and_variable() -> None:
    names = {f.name for f in dataclasses.fields(Config) if not f.name.startswith("_")}
    assert names == set(OPTIONS)
    assert {env for env, _ in OPTIONS.values()} == set(ENV_NAMES)
    assert all(env.startswith("HETCOMM_") for env in ENV_NAMES)


def test_config_is_frozen() -> None:
    c = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.timeout = 5.0  # type: ignore[misc]


# ---- the environment ---------------------------------------------------------------------------


def test_load_reads_every_variable() -> None:
    c = Config.load(EVERY_VARIABLE)
    assert c.timeout == 12.5
    assert c.transport == "dp:nccl,pp:staged"
    assert c.debug is True
    assert c.vendor == "amd"
    assert c.host == "node7"
    assert c.rails == "eth0,ib0"
    assert c.log == "debug"
    assert c.stall == 30.0
    assert c.trace == "/tmp/traces"


@pytest.mark.parametrize(
    ("variable", "raw", "field", "expected"),
    [
        ("HETCOMM_TIMEOUT", "7", "timeout", 7.0),
        ("HETCOMM_TIMEOUT", " 0.25 ", "timeout", 0.25),
        ("HETCOMM_TIMEOUT", "1e3", "timeout", 1000.0),
        ("HETCOMM_TRANSPORT", "mpi", "transport", "mpi"),
        ("HETCOMM_TRANSPORT", "staged,dp:nccl", "transport", "staged,dp:nccl"),
        ("HETCOMM_VENDOR", "nvidia", "vendor", "nvidia"),
        ("HETCOMM_VENDOR", "NVIDIA", "vendor", "nvidia"),
        ("HETCOMM_VENDOR", " Amd ", "vendor", "amd"),
        ("HETCOMM_VENDOR", "cpu", "vendor", "cpu"),
        ("HETCOMM_HOST", "nodeA", "host", "nodeA"),
        ("HETCOMM_HOST", "  nodeA  ", "host", "nodeA"),
        ("HETCOMM_RAILS", "auto", "rails", "auto"),
        ("HETCOMM_RAILS", "10.0.0.5", "rails", "10.0.0.5"),
        ("HETCOMM_LOG", "INFO", "log", "info"),
        ("HETCOMM_LOG", "error", "log", "error"),
        ("HETCOMM_LOG", " Warning ", "log", "warning"),
    ],
)
def test_load_one_variable(variable: str, raw: str, field: str, expected: Any) -> None:
    c = Config.load({variable: raw})
    assert getattr(c, field) == expected
    # every other option keeps its default
    for name in OPTIONS:
        if name != field:
            assert getattr(c, name) == getattr(Config(), name)


@pytest.mark.parametrize("raw", ["1", "true", "TRUE", "yes", "Yes", "on", " 1 "])
def test_debug_true_spellings(raw: str) -> None:
    assert Config.load({"HETCOMM_DEBUG": raw}).debug is True


@pytest.mark.parametrize("raw", ["0", "false", "False", "no", "off", "OFF", ""])
def test_debug_false_spellings(raw: str) -> None:
    assert Config.load({"HETCOMM_DEBUG": raw}).debug is False


def test_random_timeouts_round_trip() -> None:
    rng = np.random.default_rng()
    for value in rng.uniform(1e-3, 1e5, size=20):
        assert Config.load({"HETCOMM_TIMEOUT": repr(float(value))}).timeout == float(value)
        assert Config.load({}, timeout=float(value)).timeout == float(value)


# ---- precedence: argument > environment > default ---------------------------------------------


@pytest.mark.parametrize(
    ("field", "argument"),
    [
        ("timeout", 3.0),
        ("transport", "staged"),
        ("debug", False),
        ("vendor", "cpu"),
        ("host", "other"),
        ("rails", "auto"),
        ("log", "error"),
    ],
)
def test_argument_beats_environment(field: str, argument: Any) -> None:
    from_env = Config.load(EVERY_VARIABLE)
    assert getattr(from_env, field) != argument  # the environment sets something else
    c = Config.load(EVERY_VARIABLE, **{field: argument})
    assert getattr(c, field) == argument
    for name in OPTIONS:  # the other options still come from the environment
        if name != field:
            assert getattr(c, name) == getattr(from_env, name)


def test_environment_beats_default() -> None:
    c = Config.load({"HETCOMM_TIMEOUT": "9"})
    assert c.timeout == 9.0 != Config().timeout


def test_argument_alone() -> None:
    c = Config.load({}, timeout=4, debug=True, log="info")
    assert (c.timeout, c.debug, c.log) == (4.0, True, "info")
    assert isinstance(c.timeout, float)


def test_load_without_environ_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    # the only test touching os.environ, through monkeypatch (restored afterwards)
    import os

    for key in [k for k in os.environ if k.startswith("HETCOMM_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("HETCOMM_TIMEOUT", "42")
    assert Config.load().timeout == 42.0


# ---- validation --------------------------------------------------------------------------------


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)
    assert issubclass(ConfigError, HetcommError)


@pytest.mark.parametrize("bad", [0, 0.0, -1, -0.5, float("nan"), "abc", "5", True, False, None])
def test_bad_timeout_argument(bad: Any) -> None:
    msg = f"timeout: expected a positive number of seconds, got {bad!r}"
    with pytest.raises(ConfigError, match=re.escape(msg)):
        Config(timeout=bad)
    with pytest.raises(ConfigError, match=re.escape(msg)):
        Config.load({}, timeout=bad)


@pytest.mark.parametrize("raw", ["0", "-1", "-0.001", "nan"])
def test_bad_timeout_variable_out_of_range(raw: str) -> None:
    with pytest.raises(ConfigError, match="timeout: expected a positive number of seconds"):
        Config.load({"HETCOMM_TIMEOUT": raw})


@pytest.mark.parametrize("raw", ["abc", "", "1s", "5 min", "true"])
def test_bad_timeout_variable_not_a_number(raw: str) -> None:
    msg = f"HETCOMM_TIMEOUT: expected seconds as a number, got {raw.strip()!r}"
    with pytest.raises(ConfigError, match=re.escape(msg)):
        Config.load({"HETCOMM_TIMEOUT": raw})


def test_timeout_accepts_int_and_numpy_float() -> None:
    assert Config(timeout=5).timeout == 5.0
    assert Config(timeout=np.float64(2.5)).timeout == 2.5


@pytest.mark.parametrize("bad", ["intel", "", "gpu", 1])
def test_bad_vendor_argument(bad: Any) -> None:
    msg = f"vendor: expected one of {', '.join(VENDORS)}, got {bad!r}"
    with pytest.raises(ConfigError, match=re.escape(msg)):
        Config(vendor=bad)


@pytest.mark.parametrize("raw", ["intel", "cuda", "rocm", ""])
def test_bad_vendor_variable(raw: str) -> None:
    with pytest.raises(
        ConfigError, match=re.escape(f"vendor: expected one of nvidia, amd, cpu, got {raw!r}")
    ):
        Config.load({"HETCOMM_VENDOR": raw})


@pytest.mark.parametrize("bad", ["", "   ", "\t", 5])
def test_bad_host_argument(bad: Any) -> None:
    with pytest.raises(
        ConfigError, match=re.escape(f"host: expected a non-empty name, got {bad!r}")
    ):
        Config(host=bad)


@pytest.mark.parametrize("raw", ["", "   "])
def test_empty_host_variable(raw: str) -> None:
    with pytest.raises(ConfigError, match="host: expected a non-empty name, got ''"):
        Config.load({"HETCOMM_HOST": raw})


@pytest.mark.parametrize("bad", ["verbose", "critical", "", None])
def test_bad_log_argument(bad: Any) -> None:
    msg = f"log: expected one of {', '.join(LOG_LEVELS)}, got {bad!r}"
    with pytest.raises(ConfigError, match=re.escape(msg)):
        Config(log=bad)


@pytest.mark.parametrize("raw", ["verbose", "trace", "5", ""])
def test_bad_log_variable(raw: str) -> None:
    with pytest.raises(
        ConfigError,
        match=re.escape(f"log: expected one of debug, info, warning, error, got {raw.lower()!r}"),
    ):
        Config.load({"HETCOMM_LOG": raw})


@pytest.mark.parametrize("raw", ["2", "maybe", "enabled", "-1", "y"])
def test_bad_debug_variable(raw: str) -> None:
    with pytest.raises(
        ConfigError, match=re.escape(f"HETCOMM_DEBUG: expected 0 or 1, got {raw!r}")
    ):
        Config.load({"HETCOMM_DEBUG": raw})


@pytest.mark.parametrize("bad", [1, 0, "1", "true", None])
def test_bad_debug_argument(bad: Any) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"debug: expected a bool, got {bad!r}")):
        Config(debug=bad)


@pytest.mark.parametrize("bad", ["", "  ", None, 3])
def test_bad_rails_argument(bad: Any) -> None:
    with pytest.raises(
        ConfigError, match=re.escape(f"rails: expected 'auto' or a list of interfaces, got {bad!r}")
    ):
        Config(rails=bad)


def test_empty_rails_variable() -> None:
    with pytest.raises(ConfigError, match="rails: expected 'auto'"):
        Config.load({"HETCOMM_RAILS": ""})


def test_invalid_variable_raises_even_with_other_valid_ones() -> None:
    env = dict(EVERY_VARIABLE, HETCOMM_LOG="loud")
    with pytest.raises(ConfigError, match="log: expected one of"):
        Config.load(env)


@pytest.mark.parametrize(
    ("typo", "suggestion"),
    [
        ("HETCOMM_TIMEUOT", "HETCOMM_TIMEOUT"),
        ("HETCOMM_TIMEOUTS", "HETCOMM_TIMEOUT"),
        ("HETCOMM_TRANSPROT", "HETCOMM_TRANSPORT"),
        ("HETCOMM_VENDER", "HETCOMM_VENDOR"),
        ("HETCOMM_DEBGU", "HETCOMM_DEBUG"),
        ("HETCOMM_RAIL", "HETCOMM_RAILS"),
    ],
)
def test_unknown_variable_suggests_the_close_one(typo: str, suggestion: str) -> None:
    with pytest.raises(ConfigError) as info:
        Config.load({typo: "1"})
    msg = str(info.value)
    assert msg.startswith(f"unknown variable {typo} (did you mean {suggestion}?)")
    assert "hetcomm reads " + ", ".join(sorted(ENV_NAMES)) in msg


def test_unknown_variable_far_from_every_name_has_no_hint() -> None:
    with pytest.raises(ConfigError) as info:
        Config.load({"HETCOMM_ZZZZZZZZZZZZZZZZZZZ": "1"})
    msg = str(info.value)
    assert "did you mean" not in msg
    assert msg.startswith("unknown variable HETCOMM_ZZZZZZZZZZZZZZZZZZZ; hetcomm reads ")


def test_unknown_variable_is_case_sensitive() -> None:
    with pytest.raises(ConfigError, match="unknown variable HETCOMM_timeout"):
        Config.load({"HETCOMM_timeout": "5"})


@pytest.mark.parametrize("bad", ["timeuot", "_transport_map", "verbose"])
def test_unknown_keyword_is_type_error(bad: str) -> None:
    with pytest.raises(
        TypeError, match=re.escape(f"Config.load() got unknown option(s) ['{bad}']")
    ):
        Config.load({}, **{bad: 1})


def test_unknown_keyword_checked_before_environment() -> None:
    # a bad keyword is a programming error: reported even when the environment is also bad
    with pytest.raises(TypeError):
        Config.load({"HETCOMM_TIMEOUT": "abc"}, nope=1)


# ---- transport specification ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "parsed"),
    [
        ("auto", (("*", "auto"),)),
        ("mpi", (("*", "mpi"),)),
        ("dp:nccl,pp:staged", (("dp", "nccl"), ("pp", "staged"))),
        ("staged,dp:nccl", (("*", "staged"), ("dp", "nccl"))),
        (" dp : nccl , pp:staged ", (("dp", "nccl"), ("pp", "staged"))),
        (":hier", (("*", "hier"),)),
        ("dp:auto", (("dp", "auto"),)),
        ("tp-dp:direct", (("tp-dp", "direct"),)),
    ],
)
def test_parse_transport(spec: str, parsed: tuple[tuple[str, str], ...]) -> None:
    assert parse_transport(spec) == parsed


# ids are prefixed: pytest-mpi skips (without --with-mpi) any test whose keywords include a
# bare "mpi", and a parameter id of exactly "mpi" becomes such a keyword
@pytest.mark.parametrize("name", TRANSPORT_NAMES, ids=[f"t={n}" for n in TRANSPORT_NAMES])
def test_every_transport_name_parses(name: str) -> None:
    assert parse_transport(name) == (("*", name),)
    assert Config(transport=f"dp:{name}").transport_for("dp") == name


@pytest.mark.parametrize("spec", ["ucx", "MPI", "dp:gloo", "dp:nccl,pp:ucc", "dp:", "mpi,", "a:b"])
def test_unknown_transport_name(spec: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_transport(spec)
    msg = str(info.value)
    assert msg.startswith("transport: unknown transport ")
    assert f"in {spec!r}; expected one of {', '.join(TRANSPORT_NAMES)}" in msg


def test_unknown_transport_names_the_bad_entry() -> None:
    with pytest.raises(ConfigError, match=re.escape("unknown transport 'ucc' in 'dp:nccl,pp:ucc'")):
        parse_transport("dp:nccl,pp:ucc")


@pytest.mark.parametrize(
    ("spec", "what"),
    [
        ("dp:nccl,dp:mpi", "group 'dp'"),
        ("pp:staged,dp:nccl,pp:staged", "group 'pp'"),
        ("mpi,staged", "a default transport"),
        ("mpi,:staged", "a default transport"),
    ],
)
def test_duplicate_transport_entries(spec: str, what: str) -> None:
    with pytest.raises(
        ConfigError, match=re.escape(f"transport: {what} is given twice in {spec!r}")
    ):
        parse_transport(spec)


@pytest.mark.parametrize("spec", ["", "   ", None, 3])
def test_empty_transport_spec(spec: Any) -> None:
    msg = f"transport: expected a transport name or 'group:name,...', got {spec!r}"
    with pytest.raises(ConfigError, match=re.escape(msg)):
        parse_transport(spec)
    with pytest.raises(ConfigError, match=re.escape(msg)):
        Config(transport=spec)


def test_bad_transport_variable() -> None:
    with pytest.raises(ConfigError, match="unknown transport 'tcp'"):
        Config.load({"HETCOMM_TRANSPORT": "tcp"})
    with pytest.raises(ConfigError, match="is given twice"):
        Config.load({"HETCOMM_TRANSPORT": "dp:nccl,dp:nccl"})


def test_transport_for_default() -> None:
    c = Config()
    for group in ("world", "dp", "pp", "*"):
        assert c.transport_for(group) == "auto"


def test_transport_for_single_transport() -> None:
    c = Config(transport="mpi")
    assert c.transport_for("world") == "mpi"
    assert c.transport_for("dp") == "mpi"


def test_transport_for_per_group() -> None:
    c = Config.load({"HETCOMM_TRANSPORT": "dp:nccl,pp:staged"})
    assert c.transport_for("dp") == "nccl"
    assert c.transport_for("pp") == "staged"
    assert c.transport_for("tp") == "auto"  # unnamed groups stay automatic
    assert c.transport_for("dpx") == "auto"  # exact names only


@pytest.mark.parametrize("spec", ["staged,dp:nccl", "dp:nccl,staged"])
def test_transport_for_default_and_per_group(spec: str) -> None:
    c = Config(transport=spec)
    assert c.transport_for("dp") == "nccl"
    assert c.transport_for("pp") == "staged"
    assert c.transport_for("world") == "staged"


def test_transport_map_is_not_part_of_equality_but_follows_transport() -> None:
    assert Config(transport="mpi") == Config.load({"HETCOMM_TRANSPORT": "mpi"})
    assert Config(transport="mpi") != Config(transport="staged")


# ---- with_options, describe, option_table -----------------------------------------------------


def test_with_options_changes_only_what_is_named() -> None:
    base = Config.load(EVERY_VARIABLE)
    c = base.with_options(timeout=1, log="error")
    assert (c.timeout, c.log) == (1.0, "error")
    for name in OPTIONS:
        if name not in ("timeout", "log"):
            assert getattr(c, name) == getattr(base, name)
    assert base.timeout == 12.5  # the original is untouched


def test_with_options_reparses_transport() -> None:
    c = Config(transport="dp:nccl").with_options(transport="mpi,pp:staged")
    assert c.transport_for("dp") == "mpi"
    assert c.transport_for("pp") == "staged"
    c2 = Config(transport="dp:nccl").with_options(timeout=2)
    assert c2.transport_for("dp") == "nccl"


def test_with_options_validates() -> None:
    with pytest.raises(ConfigError, match="timeout"):
        Config().with_options(timeout=-2)
    with pytest.raises(ConfigError, match="unknown transport"):
        Config().with_options(transport="bogus")


def test_with_options_unknown_name() -> None:
    with pytest.raises(TypeError, match=re.escape("unknown option(s) ['timout']")):
        Config().with_options(timout=3)
    with pytest.raises(TypeError, match="unknown option"):
        Config().with_options(_transport_map=())


def test_describe_has_one_line_per_option() -> None:
    c = Config.load(EVERY_VARIABLE)
    lines = c.describe().splitlines()
    assert len(lines) == len(OPTIONS)
    for line, (name, (env, text)) in zip(lines, OPTIONS.items(), strict=True):
        assert line.startswith(env)
        assert str(getattr(c, name)) in line
        assert line.endswith(text)


def test_option_table_lists_every_option() -> None:
    table = option_table()
    assert [row[0] for row in table] == [env for env, _ in OPTIONS.values()]
    assert {row[0] for row in table} == set(ENV_NAMES)
    defaults = {row[0]: row[1] for row in table}
    assert defaults["HETCOMM_TIMEOUT"] == "300.0"
    assert defaults["HETCOMM_TRANSPORT"] == "auto"
    assert defaults["HETCOMM_RAILS"] == "auto"
    assert defaults["HETCOMM_LOG"] == "warning"
    for env, _default, text in table:
        assert text == OPTIONS[ENV_NAMES[env]][1]
        assert all(isinstance(cell, str) for cell in (env, _default, text))


def test_names_are_case_insensitive() -> None:
    c = Config(vendor="NVIDIA", log="DEBUG", transport="DP:NCCL")
    assert (c.vendor, c.log, c.transport_for("dp")) == ("nvidia", "debug", "nccl")


def test_persistent_max_from_the_environment() -> None:
    assert Config().persistent_max == PERSISTENT_MAX_BYTES
    assert Config.load({"HETCOMM_PERSISTENT_MAX": " 0 "}).persistent_max == 0
    assert Config.load({"HETCOMM_PERSISTENT_MAX": "4096"}, persistent_max=8).persistent_max == 8
    with pytest.raises(ConfigError, match="HETCOMM_PERSISTENT_MAX: expected a number of bytes"):
        Config.load({"HETCOMM_PERSISTENT_MAX": "4k"})


@pytest.mark.parametrize("bad", [-1, True, 1.5, "64"])
def test_persistent_max_must_be_bytes(bad: Any) -> None:
    with pytest.raises(ConfigError, match="persistent_max: expected a number of bytes >= 0"):
        Config(persistent_max=bad)
