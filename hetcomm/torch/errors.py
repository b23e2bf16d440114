"""The errors of the torch backend: hetcomm's failures raised the way torch's backends raise
them, with hetcomm's own error kept as `__cause__`.

What torch code catches, and what gloo raises (torch 2.4 .. 2.13):
- a timeout: `DistBackendError` (a RuntimeError) saying "Timed out waiting <n>ms"; torch's own
  tests match `" (Timed out|closed|timeout) "`. Here also a TimeoutError;
- a closed or aborted group: `DistBackendError` saying the group is " closed ";
- ranks that disagree: `DistBackendError` with "Detected mismatch between collectives", the
  words of torch's own checker (TORCH_DISTRIBUTED_DEBUG=DETAIL);
- a bad argument: gloo raises RuntimeError ("ProcessGroupGloo::allgather: invalid tensor size"),
  torch's Python layer ValueError: `ArgumentError` is both.
"""

from __future__ import annotations

import torch.distributed as dist

from ..errors import CommAborted, CommTimeout, HetcommError, InvalidArgument, MismatchError

#: torch's class for failures inside a backend (torch >= 2.1; RuntimeError before)
DistBackendError: type[RuntimeError] = getattr(dist, "DistBackendError", RuntimeError)


class ArgumentError(ValueError, RuntimeError):
    """A call the backend refuses before anything moves (a ValueError and a RuntimeError)."""


class BackendTimeout(DistBackendError, TimeoutError):  # type: ignore[valid-type,misc]
    """An operation that did not complete in time; its group is aborted."""


def torch_error(exc: BaseException, what: str) -> BaseException:
    """The exception a torch caller sees for `exc`, raised by operation `what`; anything
    that is not hetcomm's is returned as it is."""
    if not isinstance(exc, HetcommError):
        return exc
    out: BaseException
    if isinstance(exc, CommTimeout):
        ms = max(1, round(exc.waited * 1000))
        out = BackendTimeout(
            f"hetcomm {what}: Timed out waiting {ms}ms ({exc}); it timed out, so its "
            "communicator is aborted"
        )
    elif isinstance(exc, CommAborted):
        out = DistBackendError(f"hetcomm {what}: the process group is closed ({exc})")
    elif isinstance(exc, MismatchError):
        out = DistBackendError(
            f"hetcomm {what}: Detected mismatch between collectives on ranks: {exc}"
        )
    elif isinstance(exc, InvalidArgument):
        out = ArgumentError(f"hetcomm {what}: {exc}")
    else:
        out = DistBackendError(f"hetcomm {what}: {exc}")
    out.__cause__ = exc
    return out
