"""Configuration: the one reader of HETCOMM_* variables (argument > environment > default)."""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from .errors import ConfigError

if TYPE_CHECKING:
    from .tuning import Tuning

VENDORS = ("nvidia", "amd", "cpu")
TRANSPORT_NAMES = ("auto", "mpi", "nccl", "direct", "staged", "hier")
LOG_LEVELS = ("debug", "info", "warning", "error")

# name of the field -> (environment variable, one-line help); the README's table is made from this
OPTIONS: dict[str, tuple[str, str]] = {
    "timeout": ("HETCOMM_TIMEOUT", "seconds any wait may last before CommTimeout (default 300)"),
    "transport": (
        "HETCOMM_TRANSPORT",
        "'auto', one transport for every group ('mpi'), or per group ('dp:nccl,pp:staged')",
    ),
    "check": (
        "HETCOMM_CHECK",
        "1 (default) = compare each collective's operation, dtype, count, reduce op and root "
        "across the group before any byte moves; 0 = off (set the same on every rank)",
    ),
    "debug": ("HETCOMM_DEBUG", "1 = the check also compares each collective's sequence number"),
    "vendor": ("HETCOMM_VENDOR", "this rank's vendor: nvidia, amd or cpu (simulation override)"),
    "host": ("HETCOMM_HOST", "this rank's host name (simulates several hosts on one machine)"),
    "rails": ("HETCOMM_RAILS", "'auto' or interface names / IPv4 addresses for staged rails"),
    "log": ("HETCOMM_LOG", "log level: debug, info, warning (default), error"),
    "stall": ("HETCOMM_STALL", "seconds a wait may last before one stall warning (default 60)"),
    "trace": ("HETCOMM_TRACE", "directory for per-rank Chrome traces of every operation (off)"),
    "direct_min": (
        "HETCOMM_DIRECT_MIN",
        "bytes above which device messages use direct rather than staged (default: tuned, else 0)",
    ),
    "persistent_max": (
        "HETCOMM_PERSISTENT_MAX",
        "bytes up to which the small collectives of the mpi transport run as cached MPI-4 "
        "persistent requests (0: off; set the same on every rank)",
    ),
    "tune_dir": (
        "HETCOMM_TUNE_DIR",
        "directory of `hetcomm tune` results, one file per topology ('off': never read)",
    ),
}
DEFAULT_TUNE_DIR = "~/.cache/hetcomm/tune"
# Measured on 2 ranks of one host (Open MPI 5.0): a cached persistent all-reduce, copied in and
# out of its own scratch array, beat an Iallreduce on the caller's array in place at every size
# up to 64 KiB (by 0.5 us at 8 bytes, 1 us at 16 KiB); out of place the copies made it lose from
# 4 KiB on (by 1.5 us at 16 KiB, 6 us at 64 KiB).
PERSISTENT_MAX_BYTES = 16 * 1024
ENV_NAMES = {env: name for name, (env, _) in OPTIONS.items()}


@dataclass(frozen=True)
class Config:
    """Every hetcomm option with its default; build with Config.load() to read the environment."""

    timeout: float = 300.0
    transport: str = "auto"
    check: bool = True
    debug: bool = False
    vendor: str | None = None
    host: str | None = None
    rails: str = "auto"
    log: str = "warning"
    stall: float = 60.0
    trace: str | None = None
    direct_min: int | None = None  # None: the tuned value, else plan.DIRECT_MIN_BYTES
    persistent_max: int = PERSISTENT_MAX_BYTES
    tune_dir: str = DEFAULT_TUNE_DIR
    # what `hetcomm tune` measured for this topology: set by hetcomm.init(), not an option
    _tuned: Tuning | None = field(default=None, repr=False, compare=False)
    _transport_map: tuple[tuple[str, str], ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        # names are case-insensitive wherever they come from
        for name in ("vendor", "log", "transport"):
            value = getattr(self, name)
            if isinstance(value, str):
                value = value.lower() if name == "transport" else value.strip().lower()
                object.__setattr__(self, name, value)
        _check_timeout(self.timeout)
        object.__setattr__(self, "timeout", float(self.timeout))
        _check_timeout(self.stall, "stall")
        object.__setattr__(self, "stall", float(self.stall))
        if self.trace is not None and (not isinstance(self.trace, str) or not self.trace.strip()):
            raise ConfigError(f"trace: expected a directory name or None, got {self.trace!r}")
        for name in ("check", "debug"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}: expected a bool, got {getattr(self, name)!r}")
        if self.vendor is not None and self.vendor not in VENDORS:
            raise ConfigError(f"vendor: expected one of {', '.join(VENDORS)}, got {self.vendor!r}")
        if self.host is not None and (not isinstance(self.host, str) or not self.host.strip()):
            raise ConfigError(f"host: expected a non-empty name, got {self.host!r}")
        if not isinstance(self.rails, str) or not self.rails.strip():
            raise ConfigError(f"rails: expected 'auto' or a list of interfaces, got {self.rails!r}")
        if self.direct_min is not None and (
            isinstance(self.direct_min, bool)
            or not isinstance(self.direct_min, int)
            or self.direct_min < 0
        ):
            raise ConfigError(
                f"direct_min: expected a number of bytes >= 0, got {self.direct_min!r}"
            )
        if (
            isinstance(self.persistent_max, bool)
            or not isinstance(self.persistent_max, int)
            or self.persistent_max < 0
        ):
            raise ConfigError(
                f"persistent_max: expected a number of bytes >= 0, got {self.persistent_max!r}"
            )
        if not isinstance(self.tune_dir, str) or not self.tune_dir.strip():
            raise ConfigError(
                f"tune_dir: expected a directory name or 'off', got {self.tune_dir!r}"
            )
        if self.log not in LOG_LEVELS:
            raise ConfigError(f"log: expected one of {', '.join(LOG_LEVELS)}, got {self.log!r}")
        object.__setattr__(self, "_transport_map", parse_transport(self.transport))

    @classmethod
    def load(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Config:
        """Defaults, then HETCOMM_* variables of `environ` (os.environ), then `overrides`."""
        unknown = [k for k in overrides if k not in OPTIONS]
        if unknown:
            raise TypeError(
                f"Config.load() got unknown option(s) {unknown}; known: {', '.join(OPTIONS)}"
            )
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for key, raw in env.items():
            if not key.startswith("HETCOMM_"):
                continue
            if key not in ENV_NAMES:
                hint = difflib.get_close_matches(key, list(ENV_NAMES), n=1)
                extra = f" (did you mean {hint[0]}?)" if hint else ""
                raise ConfigError(
                    f"unknown variable {key}{extra}; hetcomm reads {', '.join(sorted(ENV_NAMES))}"
                )
            name = ENV_NAMES[key]
            values[name] = _from_env(name, key, raw)
        values.update(overrides)
        return cls(**values)

    def with_options(self, **changes: Any) -> Config:
        """A copy with some options changed (unknown names raise TypeError)."""
        unknown = [k for k in changes if k not in OPTIONS]
        if unknown:
            raise TypeError(f"unknown option(s) {unknown}; known: {', '.join(OPTIONS)}")
        return replace(self, **changes)

    @property
    def tuned(self) -> Tuning | None:
        """The values `hetcomm tune` measured for this topology, or None (built-in defaults)."""
        return self._tuned

    def transport_for(self, group: str) -> str:
        """The transport asked for `group` ('auto' unless configured)."""
        default = "auto"
        for name, transport in self._transport_map:
            if name == group:
                return transport
            if name == "*":
                default = transport
        return default

    def describe(self) -> str:
        """One line per option: name, value, environment variable."""
        return "\n".join(
            f"{env:18} {getattr(self, name)!s:12} {text}" for name, (env, text) in OPTIONS.items()
        )


def parse_transport(spec: str) -> tuple[tuple[str, str], ...]:
    """'staged' -> (('*','staged'),); 'dp:nccl,pp:staged' -> (('dp','nccl'),('pp','staged'))."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"transport: expected a transport name or 'group:name,...', got {spec!r}")
    entries: list[tuple[str, str]] = []
    seen: set[str] = set()
    for part in spec.split(","):
        part = part.strip()
        group, _, name = part.rpartition(":")
        group = group.strip() or "*"
        name = name.strip()
        if name not in TRANSPORT_NAMES:
            raise ConfigError(
                f"transport: unknown transport {name!r} in {spec!r}; "
                f"expected one of {', '.join(TRANSPORT_NAMES)}"
            )
        if group in seen:
            what = "a default transport" if group == "*" else f"group {group!r}"
            raise ConfigError(f"transport: {what} is given twice in {spec!r}")
        seen.add(group)
        entries.append((group, name))
    return tuple(entries)


def _check_timeout(value: Any, name: str = "timeout") -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{name}: expected a positive number of seconds, got {value!r}")


def _from_env(name: str, key: str, raw: str) -> Any:
    raw = raw.strip()
    if name in ("timeout", "stall"):
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(f"{key}: expected seconds as a number, got {raw!r}") from None
    if name in ("check", "debug"):
        low = raw.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off", ""):
            return False
        raise ConfigError(f"{key}: expected 0 or 1, got {raw!r}")
    if name in ("vendor", "host"):
        return raw.lower() if name == "vendor" else raw
    if name == "log":
        return raw.lower()
    if name == "trace":
        return raw or None  # HETCOMM_TRACE= (empty) leaves tracing off
    if name in ("direct_min", "persistent_max"):
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"{key}: expected a number of bytes, got {raw!r}") from None
    if name == "tune_dir":
        return raw or "off"  # HETCOMM_TUNE_DIR= (empty) reads no tuning
    return raw


def option_table() -> list[tuple[str, str, str]]:
    """(variable, default, meaning) for every option, for docs and `hetcomm info`."""
    shown = {
        "vendor": "detected",
        "host": "host name",
        "check": "1",
        "debug": "0",
        "trace": "off",
        "direct_min": "tuned, else 0",
    }
    defaults = {
        f.name: shown.get(f.name, str(f.default)) for f in fields(Config) if f.name in OPTIONS
    }
    return [(env, defaults[name], text) for name, (env, text) in OPTIONS.items()]
