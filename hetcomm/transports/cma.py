"""Reading another process's memory: Linux cross-memory attach (`process_vm_readv`).

A staged message between two ranks of one host can be one copy instead of two: the receiver
reads the sender's array straight into its own (staged/eager.py's PULL messages), as Open
MPI's shared-memory transport does with the same call. The kernel allows it where the
reader may ptrace the other process (same user, and Yama's `ptrace_scope` permitting: Open
MPI relaxes that for its ranks with `PR_SET_PTRACER`, hetcomm does not); a container's
seccomp profile may forbid the call. Nobody can tell in advance, so a pair finds out by a
probe (`probe`): the receiver reads a word whose value the sender published beside its
address, and the pair copies through shared memory where that fails.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys


class _Iovec(ctypes.Structure):
    _fields_ = (("base", ctypes.c_void_p), ("len", ctypes.c_size_t))


def _bind() -> tuple[ctypes._CFuncPtr | None, str | None]:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None, f"process_vm_readv is Linux's ({sys.platform} has none)"
    try:
        fn = ctypes.CDLL(None, use_errno=True).process_vm_readv
    except (OSError, AttributeError) as exc:
        return None, f"the C library has no process_vm_readv ({exc})"
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = (
        ctypes.c_int,
        ctypes.POINTER(_Iovec),
        ctypes.c_ulong,
        ctypes.POINTER(_Iovec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    )
    return fn, None


_READV, _WHY = _bind()


def unavailable() -> str | None:
    """Why this process cannot read others' memory at all, or None."""
    return _WHY


def read(pid: int, remote: int, local: int, nbytes: int) -> None:
    """Copy `nbytes` at address `remote` of process `pid` to address `local` of this one.

    OSError on failure: ESRCH (the process is gone), EFAULT (the range is not mapped there
    any more), EPERM (not allowed)."""
    if _READV is None:
        raise OSError(errno.ENOSYS, _WHY)
    done = 0
    mine, theirs = _Iovec(), _Iovec()
    while done < nbytes:
        mine.base, mine.len = local + done, nbytes - done
        theirs.base, theirs.len = remote + done, nbytes - done
        got = _READV(pid, ctypes.byref(mine), 1, ctypes.byref(theirs), 1, 0)
        if got < 0:
            code = ctypes.get_errno()
            raise OSError(code, f"process_vm_readv from pid {pid}: {os.strerror(code)}")
        if got == 0:
            raise OSError(errno.EFAULT, f"process_vm_readv from pid {pid}: nothing read")
        done += got  # a read stops early at the end of a mapping: the next one goes on


def probe(pid: int, remote: int, expected: int) -> str | None:
    """Why this process cannot read process `pid`'s memory, or None: reads the int64 at
    `remote`, which that process set to `expected`."""
    if _READV is None:
        return _WHY
    word = ctypes.c_int64(0)
    try:
        read(pid, remote, ctypes.addressof(word), 8)
    except OSError as exc:
        return str(exc)
    if word.value != expected:
        # another process of that number (ranks in separate pid namespaces)
        return f"pid {pid} is another process here"
    return None
