"""How a rank's process is told gone from running (hetcomm.processes): ended, a zombie not
yet reaped, or a pid that now names another process."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from hetcomm import processes


def _until_zombie(child: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    while processes.start_time(child.pid) is not None and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_running_process_is_not_gone():
    started = processes.start_time(os.getpid())
    assert started
    assert not processes.gone(os.getpid())
    assert not processes.gone(os.getpid(), started)


def test_ended_and_zombie_processes_are_gone():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        _until_zombie(child)  # exited, not yet reaped: signal 0 still finds it
        assert processes.start_time(child.pid) is None
        assert processes.gone(child.pid)
    finally:
        child.wait()
    assert processes.gone(child.pid)


def test_a_pid_taken_by_another_process_is_gone():
    started = processes.start_time(os.getpid())
    assert started
    assert processes.gone(os.getpid(), started + 1)


def test_no_pid_is_gone():
    assert processes.gone(0)
    assert processes.gone(-1)
