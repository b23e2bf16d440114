"""The `hetcomm bench` command and its studies (docs/bench.md).

main.py is the command: its parser, the `STUDIES` table and the handling of its arguments; the
sweep, the `--latency` table and the studies have modules of their own. The timing rules that
every one of them follows (interleaved rounds, the slowest rank's time, medians and spread)
live in timing.py.
"""
