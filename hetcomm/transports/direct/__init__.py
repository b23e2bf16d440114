"""The direct transport: device-direct: peer memory mapping and GPU copy/reduce kernels.

`DirectTransport` lives in transport.py, loaded on first use: the pure modules beside it
(schedule.py) import without MPI.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .transport import DirectTransport

__all__ = ["DirectTransport"]


def __getattr__(name: str) -> Any:
    if name == "DirectTransport":
        from .transport import DirectTransport

        return DirectTransport
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
