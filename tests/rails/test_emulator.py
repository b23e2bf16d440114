"""scripts/emulate-rails: namespaces, tc classes, per-rank hosts, clean-up, and rail scaling.

Skipped (with the reason) when not root, without iproute2, or where network namespaces cannot
be made (an unprivileged container).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest
from _rails import (
    ROOT,
    MiB,
    clean_environ,
    close,
    first_difference,
    open_comm,
    pattern,
    rail_bytes,
    run,
    staged,
)
from test_rail_kinds import stripe

from hetcomm import introspect
from hetcomm.testing import scenario_command


def namespaces() -> set[str]:
    out = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, timeout=30, check=False
    ).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def emulate(emulator, *args: str, limit: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["timeout", "--kill-after=10", str(int(limit)), str(emulator), *args],
        capture_output=True,
        text=True,
        timeout=limit + 30,
        check=False,
        stdin=subprocess.DEVNULL,
        env=clean_environ(),
    )


def test_rails_addresses_and_classes(emulator):
    before = namespaces()
    done = emulate(
        emulator,
        "--rails",
        "3",
        "--rate",
        "123mbit",
        "--",
        "sh",
        "-c",
        'echo "rails=$HETCOMM_RAILS ns=$EMULATE_RAILS_NETNS"; ip -4 -o addr show dev lo;'
        " tc class show dev lo; tc filter show dev lo",
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "rails=127.0.1.1,127.0.2.1,127.0.3.1 ns=hetcomm-rails-" in out
    for i in (1, 2, 3):
        assert f"127.0.{i}.1/24" in out
        assert f"class htb 1:{i} " in out
        assert f"7f000{i}00/ffffff00" in out  # u32 match on destination 127.0.i.0/24
    assert out.count("rate 123Mbit") == 3
    assert namespaces() == before, "the namespace was left behind"


def test_failing_command_status_and_cleanup(emulator):
    before = namespaces()
    done = emulate(emulator, "--rails", "1", "--rate", "1gbit", "--", "sh", "-c", "exit 7")
    assert done.returncode == 7
    assert namespaces() == before


def test_bad_arguments_are_explained(emulator):
    for args, word in (
        (["--rails", "0", "--rate", "1gbit", "--", "true"], "--rails"),
        (["--rails", "2", "--rate", "fast", "--", "true"], "--rate"),
        (["--rails", "2", "--rate", "1gbit"], "no command"),
    ):
        done = emulate(emulator, *args)
        assert done.returncode == 2 and word in done.stderr, (args, done.stderr)


def test_sigterm_ends_the_command_and_removes_the_namespace(emulator, tmp_path):
    before = namespaces()
    marker = tmp_path / "pid"
    proc = subprocess.Popen(
        [
            str(emulator),
            "--rails",
            "1",
            "--rate",
            "1gbit",
            "--",
            "sh",
            "-c",
            f"echo $$ > {marker}; exec sleep 60",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_environ(),
        stdin=subprocess.DEVNULL,
    )
    try:
        end = time.monotonic() + 30
        while not (marker.exists() and marker.read_text().strip()) and time.monotonic() < end:
            time.sleep(0.05)
        inner = int(marker.read_text())
        assert any(ns.startswith("hetcomm-rails-") for ns in namespaces() - before)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 143
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert namespaces() == before
    with pytest.raises(ProcessLookupError):
        os.kill(inner, 0)  # the command (sleep) is gone too


@pytest.mark.parametrize("launch", ["rank-host-shim", "hetcomm-run"])
def test_ranks_are_hosts_joined_by_the_emulated_rails(emulator, hetcomm_mpirun, launch):
    prefix, mpi_env = hetcomm_mpirun
    job = [
        "env",
        "HETCOMM_TRANSPORT=staged",
        "HETCOMM_TIMEOUT=30",
        *scenario_command(hello),
    ]
    if launch == "hetcomm-run":
        argv = [
            sys.executable,
            "-m",
            "hetcomm",
            "run",
            "-n",
            "2",
            "--simulate-hosts",
            "2",
            "--timeout",
            "60",
            "--",
            *job,
        ]
        hosts = ["sim0", "sim1"]
    else:
        argv = [*prefix, "-n", "2", str(emulator), "--rank-host", "--", *job]
        hosts = ["host0", "host1"]
    done = run(
        [str(emulator), "--rails", "2", "--rate", "1gbit", "--", *argv], clean_environ(**mpi_env)
    )
    for r in done.ranks():
        assert r["hosts"] == hosts
        assert r["rails_config"] == "127.0.1.1,127.0.2.1"
        assert [s.split(":")[0] for s in r["specs"]] == [
            "tcp0 127.0.1.1 -> 127.0.1.1",
            "tcp1 127.0.2.1 -> 127.0.2.1",
        ]
        assert r["mismatch"] == ""
    assert done.returncode == 0, done.explain()


def test_two_rails_beat_one(emulator, hetcomm_mpirun):
    """16 MiB over 1 and over 2 rails of 200 Mbit/s (`hetcomm bench --study rails`): loosely, since
    the machine is shared, 2 rails at least 1.4x one."""
    prefix, mpi_env = hetcomm_mpirun
    argv = [
        str(emulator),
        "--rails",
        "2",
        "--rate",
        "200mbit",
        "--",
        *prefix,
        "-n",
        "2",
        sys.executable,
        "-m",
        "mpi4py",
        "-m",
        "hetcomm",
        "bench",
        "--study",
        "rails",
        "--rails",
        "1,2",
        "--mib",
        "16",
        "--repeats",
        "3",
        "--json",
        "-",
    ]
    done = run(argv, clean_environ(**mpi_env), limit=120)
    assert done.returncode == 0, done.explain()
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, done.explain()
    result = json.loads(lines[-1])
    rows = result["rows"]
    assert result["correct"], rows
    one, two = rows
    assert one["rails"] == 1 and two["rails"] == 2
    # one rail near its rate (a sanity check of the emulation): 200 Mbit/s, with a wide margin
    assert 0.1 < one["gbit_s"] < 0.25, rows
    assert two["ratio"] >= 1.4, f"2 rails gave {two['ratio']:.2f}x one rail: {rows}"
    assert min(two["shares"]) > 0.25, f"bytes per rail: {rows}"


def test_tuned_rail_weights_keep_the_slow_rails_share_near_its_speed(emulator, hetcomm_mpirun):
    """A 400 Mbit/s and a 100 Mbit/s rail with the weights `hetcomm tune` would give them (1 and
    0.25): the slow rail may hold one unacknowledged 1 MiB chunk against the fast rail's four,
    so it carries at most a quarter of 16 MiB (without weights it took 5-6 chunks of 16)."""
    prefix, mpi_env = hetcomm_mpirun
    params = {"hosts": True, "mib": 16, "chunk_bytes": 1 << 20, "weights": [1.0, 0.25]}
    argv = [
        str(emulator),
        "--rails",
        "2",
        "--rate",
        "400mbit,100mbit",
        "--",
        "env",
        "HETCOMM_TRANSPORT=staged",
        "HETCOMM_TIMEOUT=60",
        *prefix,
        "-n",
        "2",
        *scenario_command(stripe, params),
    ]
    done = run(argv, clean_environ(**mpi_env), limit=120)
    sender, receiver = done.ranks()
    assert receiver["errors"] == [], done.explain()
    rails = sender["rails"]
    assert sum(rails.values()) == 16 << 20, f"bytes per rail: {rails}"
    assert 0 < rails.get("tcp1", 0) <= 4 << 20, f"bytes per rail: {rails}"
    assert done.returncode == 0, done.explain()


def test_emulator_is_executable():
    assert (ROOT / "scripts" / "emulate-rails").stat().st_mode & 0o111


# ---- the rank side: scenarios run on every rank of a job (hetcomm.testing.run_scenario) ----


def hello(params: dict[str, Any]) -> dict[str, Any]:
    """What the launch gave this rank: its host, its rails, and the rails to the other rank."""
    comm = open_comm(params)
    t = staged(comm)
    data = pattern(1 * MiB + 3, 8)
    got = np.zeros_like(data)
    if comm.rank == 0:
        comm.send(data, 1)
    else:
        comm.recv(got, 0)
    result = {
        "hosts": [r.host for r in comm.topology],
        "rails_config": comm.config.rails,
        "specs": [str(s) for s in introspect.channels(t)[1 - comm.rank].specs],
        "mismatch": first_difference(got, data) if comm.rank == 1 else "",
        "rails": rail_bytes(t),
    }
    close(comm, result)
    return result
