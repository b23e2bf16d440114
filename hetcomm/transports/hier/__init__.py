"""The hier transport: collectives across vendor islands: native inside, staged/direct between.

`HierTransport` lives in transport.py, loaded on first use: the pure modules beside it
(schedule.py) import without MPI.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .transport import HierTransport

__all__ = ["HierTransport"]


def __getattr__(name: str) -> Any:
    if name == "HierTransport":
        from .transport import HierTransport

        return HierTransport
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
