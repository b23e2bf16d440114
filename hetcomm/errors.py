"""The exceptions hetcomm raises, one class per way a call can fail.

Every class derives from HetcommError. Bad input is also a ValueError (or TypeError), as Python
callers expect; a failure of the communication itself (a mismatch, a timeout, an abort, a
missing transport or topology) is also a RuntimeError, as mpi4py's MPI.Exception and torch's
DistBackendError are, so that code written for those (`except RuntimeError`) catches hetcomm's
too. A timeout is besides a TimeoutError.
"""

from __future__ import annotations

from collections.abc import Sequence


class HetcommError(Exception):
    """Base class of every error hetcomm raises on purpose."""


class ConfigError(HetcommError, ValueError):
    """A configuration value or HETCOMM_* variable is unknown or malformed."""


class InvalidArgument(HetcommError, ValueError):
    """A call was made with arguments that cannot work; no byte has moved."""


class DtypeError(InvalidArgument, TypeError):
    """An array has a dtype the operation does not accept."""


class TopologyError(HetcommError, RuntimeError):
    """The ranks' facts do not allow what was asked (a layout, a binding, a group)."""


class TransportUnavailable(HetcommError, RuntimeError):
    """A transport was asked for (or is the only option) but cannot run here; the reason says."""


class MismatchError(HetcommError, RuntimeError):
    """Ranks of one group called different operations, or the same one with different arguments."""


class CommTimeout(HetcommError, RuntimeError, TimeoutError):
    """An operation did not complete within its time limit; the communicator is aborted."""

    def __init__(
        self,
        group: str,
        op: str,
        seq: int,
        waited: float,
        missing: Sequence[int] | None = None,
        detail: str = "",
    ) -> None:
        self.group, self.op, self.seq, self.waited = group, op, seq, waited
        self.missing = tuple(missing) if missing is not None else None
        msg = f"group '{group}': {op} #{seq} timed out: it did not complete within {waited:.1f} s"
        if self.missing is not None:
            msg += f"; ranks not arrived: {list(self.missing)}"
        if detail:
            msg += f"; {detail}"
        super().__init__(msg)


class MpiError(HetcommError, RuntimeError):
    """The MPI library failed a call of an operation; `mpi_error` is mpi4py's exception."""

    def __init__(self, group: str, op: str, seq: int, mpi_error: BaseException) -> None:
        self.group, self.op, self.seq, self.mpi_error = group, op, seq, mpi_error
        super().__init__(f"group '{group}': {op} #{seq}: the MPI library failed: {mpi_error}")


class CommAborted(HetcommError, RuntimeError):
    """The communicator was aborted by an earlier failure; every later call fails at once."""


class PeerLost(CommAborted):
    """Every connection to a peer failed in an operation (the peer died or closed them): the
    communicator is aborted; `ranks` names the peers."""

    def __init__(self, message: str, ranks: Sequence[int]) -> None:
        self.ranks = tuple(ranks)
        super().__init__(message)
