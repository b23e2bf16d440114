"""Events in the torch profiler: each operation as `hetcomm:<op>` with its input shapes.

gloo's operations show as `gloo:all_reduce` and so on: an asynchronous event that starts when
the operation is issued, carries the shapes of its input tensors (with `record_shapes=True`) and
ends when the operation completes. hetcomm's do the same under the same operation names, so a
trace or a test that looks for `<backend>:all_reduce` finds them. With no profiler active the
only cost is `active()`, one call into torch per operation.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

#: torch's name for whether a profiler is recording (the check torch's own record_function uses)
active = torch._C._autograd._profiler_enabled

# the ProcessGroup's name for an operation -> the name its event carries (gloo's names)
_EVENT_NAMES = {
    "allreduce": "all_reduce",
    "allreduce_coalesced": "all_reduce_coalesced",
    "allgather": "all_gather",
    "allgather_coalesced": "all_gather_coalesced",
    "all_to_all_single": "all_to_all",
    "alltoall": "all_to_all",
    "recv_anysource": "recvAnySource",
}


def event_name(name: str) -> str:
    """The profiler event of the ProcessGroup operation `name` (`hetcomm:all_reduce`...)."""
    return "hetcomm:" + _EVENT_NAMES.get(name, name)


class Record:
    """One open profiler event: started on the issuing thread, ended by `end()`."""

    __slots__ = ("_handle", "thread")

    def __init__(self, name: str, inputs: Sequence[torch.Tensor]) -> None:
        self._handle: Any = torch._C._autograd._record_function_with_args_enter(
            event_name(name), *inputs
        )
        self.thread = threading.get_ident()

    def end(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            torch._C._autograd._record_function_with_args_exit(handle)
