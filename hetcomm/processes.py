"""Whether the process of a rank on this host still runs, as far as /proc can say.

Waits between the ranks of one host (the arrival table of the check, the shared segment of
small collectives) look at the late ranks' processes, so that a rank that died is named long
before the wait's deadline. A process counts as gone where its pid names no process, a
zombie (killed, not yet reaped by its launcher: `kill -0` still finds it), or another process
than the one that started at the recorded start time (its pid was taken again).
"""

from __future__ import annotations

import os


def start_time(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot, /proc/PID/stat field 22); None where
    it is gone or a zombie; 0 where it exists but /proc cannot say when it started."""
    if pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except FileNotFoundError:
        return None
    except OSError:  # no /proc, or a process /proc will not show
        return _signal_probe(pid)
    fields = text[text.rfind(b")") + 2 :].split()
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def gone(pid: int, started: int = 0) -> bool:
    """Whether process `pid` has ended, or its pid now names another process than the one
    that started at `started` (0: not known, only whether it ended counts)."""
    now = start_time(pid)
    return now is None or (started != 0 and now != 0 and now != started)


def _signal_probe(pid: int) -> int | None:
    """Signal 0 checks that a process exists without sending anything: 0 where it does."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:  # it exists, owned by someone else
        pass
    return 0
