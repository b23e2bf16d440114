"""The transports this installation has: the registry the plan chooses from."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .base import Transport


def registry() -> dict[str, type[Transport]]:
    """Transport name -> class, for the transports this installation has."""
    from .direct import DirectTransport
    from .hier import HierTransport
    from .mpi import MpiTransport
    from .nccl import NcclTransport
    from .staged import StagedTransport

    found: list[type[Transport]] = [
        DirectTransport,
        HierTransport,
        MpiTransport,
        NcclTransport,
        StagedTransport,
    ]
    return {cls.name: cls for cls in found}
