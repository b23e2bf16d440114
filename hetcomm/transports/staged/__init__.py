"""The staged transport: CPU-forwarding: chunked device<->pinned-host copies striped over rails.

`StagedTransport` lives in transport.py, loaded on first use: the pure modules beside it
(schedule.py) import without MPI.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .transport import StagedTransport

__all__ = ["StagedTransport"]


def __getattr__(name: str) -> Any:
    if name == "StagedTransport":
        from .transport import StagedTransport

        return StagedTransport
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
