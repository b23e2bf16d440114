"""Routes: what every call of one signature shares, and how a call's signature is read off
its arrays (cheaply: it is read at every call)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

import numpy as np

from .ops import ReduceOp

if TYPE_CHECKING:
    from .transports.base import Transport
    from .work import Work

# what a reduce op may be given as for its route to be kept (None: an op without one)
OP_TYPES = frozenset((ReduceOp, str, type(None)))
# routes kept per communicator; a program that keeps making new signatures (shapes that never
# repeat) starts over instead of growing without bound
MAX_ROUTES = 4096

Runner = Callable[..., bool]


class Route:
    """What every call of one signature shares, worked out at its first call: the transport
    the plan chose, the signature vector the default check compares across the group, and the
    transport's prepared blocking call for host arrays (None where it has none).

    The signature is everything the route's key holds (op, array type, dtype, shape, device,
    reduce op, root, the out array's): validation that depends on it ran once, when the route
    was made. What depends on the array itself (address, writability, layout) is checked at
    every call.
    """

    __slots__ = (
        "carried",
        "dtype",
        "general",
        "land",
        "op",
        "root",
        "rop",
        "run",
        "runs",
        "start",
        "transport",
        "uses",
        "vec",
        "view",
    )

    def __init__(
        self,
        op: str,
        transport: Transport,
        vec: np.ndarray,
        general: Callable[..., Work | None],
        rop: ReduceOp | None = None,
        root: int = -1,
        run: Runner | None = None,
    ) -> None:
        self.op, self.transport, self.vec, self.general = op, transport, vec, general
        self.rop, self.root, self.run = rop, root, run
        # the transport's prepared asynchronous start for host arrays (sends and receives)
        self.start: Callable[..., Work] | None = None
        # where its blocking calls on host memory ride in the check (hetcomm.carried), what
        # this rank makes of the records once every rank's input is there (carried.lander),
        # else None; and how many calls did
        self.land: Callable[..., None] | None = None
        self.carried = 0
        self.dtype: str | None = None
        # how a call's array is read for `run`: host_view, or for a route of device memory
        # device_view (an address: a prepared call of device memory that serves overlapping
        # arrays tells overlaps apart itself, `run.in_place`)
        self.view: Callable[[Any, bool], Any] = host_view
        # calls served by the prepared call, and by the general path (for tests and stats)
        self.runs = 0
        self.uses = 0


_TENSOR: type | None = None  # torch.Tensor, once a tensor has been seen (torch loads lazily)


def key_of(x: Any) -> Hashable | None:
    """What of an array decides its route: its type, dtype, shape and device. None for types
    whose routes are not kept (each call then resolves afresh, as the first call does)."""
    cls = x.__class__
    if cls is np.ndarray:
        return (cls, x.dtype, x.shape)
    if cls is _TENSOR:
        return (cls, x.dtype, x.shape, x.device)
    if _TENSOR is None and cls.__name__ == "Tensor" and cls.__module__ == "torch":
        _learn_tensor(cls)
        return (cls, x.dtype, x.shape, x.device)
    if cls.__name__ == "ndarray" and cls.__module__.startswith("cupy"):
        return (cls, x.dtype, x.shape, x.device.id)
    return None


def _learn_tensor(cls: type) -> None:
    global _TENSOR
    _TENSOR = cls


def host_view(x: Any, write: bool) -> np.ndarray | None:
    """The numpy array a prepared host call works on: `x` itself (a contiguous numpy array,
    writable where `write`), the numpy view of a contiguous CPU tensor that needs no grad, or
    None where the call takes the general path (which packs or refuses)."""
    if x.__class__ is np.ndarray:
        flags = x.flags
        if flags.c_contiguous and (flags.writeable or not write):
            return x
        return None
    if x.__class__ is _TENSOR:
        return cpu_tensor_array(x)
    return None


def device_view(x: Any, write: bool) -> int | None:
    """The device address a prepared call of device memory works on: a contiguous CuPy
    array's or CUDA tensor's data pointer (its type, dtype, shape and device are its route's),
    or None where the call takes the general path (which packs or refuses)."""
    data_ptr = getattr(x, "data_ptr", None)  # a tensor's; a CuPy array has none
    if data_ptr is not None:
        return data_ptr() if x.is_contiguous() else None
    return x.data.ptr if x.flags.c_contiguous else None


def cpu_tensor_array(x: Any) -> np.ndarray | None:
    """The numpy view of a contiguous CPU torch tensor that needs no grad, else None."""
    if not x.is_cpu or x.requires_grad or not x.is_contiguous():
        return None
    try:
        arr: np.ndarray = x.numpy()  # bfloat16 and friends raise: the general path takes them
    except (TypeError, RuntimeError):
        return None
    return arr


def no_general(*_: Any) -> Work | None:
    """The general path of routes the communicator makes for its own calls: never taken."""
    raise AssertionError("a route of the communicator's own calls has no general path")
