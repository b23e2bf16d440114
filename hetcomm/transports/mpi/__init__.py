"""The mpi transport: host buffers through MPI (device buffers where the MPI is GPU-aware).

`MpiTransport` lives in transport.py, loaded on first use: the pure modules beside it
(schedule.py) import without MPI.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .transport import MpiTransport

__all__ = ["MpiTransport"]


def __getattr__(name: str) -> Any:
    if name == "MpiTransport":
        from .transport import MpiTransport

        return MpiTransport
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
