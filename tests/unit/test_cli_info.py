"""`hetcomm info`'s configuration table: every column starts at the same place on every line."""

from __future__ import annotations

from hetcomm import Config
from hetcomm.cli import config_table
from hetcomm.config import OPTIONS


def test_config_table_columns_line_up() -> None:
    config = Config.load(tune_dir="/a/rather/long/folder/name/for/tuned/settings", timeout=7)
    lines = config_table(config).splitlines()
    assert len(lines) == 1 + len(OPTIONS)
    head = lines[0]
    value_at, meaning_at = head.index("value"), head.index("meaning")
    for (name, (env, text)), line in zip(OPTIONS.items(), lines[1:]):
        value = str(getattr(config, name))
        assert line.startswith(env + " ")
        assert line[value_at:].startswith(value + " "), line
        assert line[meaning_at:] == text, line
        assert line[value_at - 2 : value_at] == "  " and line[meaning_at - 2 : meaning_at] == "  "
