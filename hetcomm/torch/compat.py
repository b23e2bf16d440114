"""What torch calls things, across versions 2.4 .. 2.13, and hetcomm's reduce ops for torch's.

Names torch changed between 2.4 and today live in one table, `METHOD_NAMES` (group methods,
given to the group class by `install_aliases`), and `API_NAMES` (torch.distributed functions);
the other helpers find what moved. `BackendView` is what torch expects behind a group in place
of a C++ backend object.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from ..ops import ReduceOp
from .errors import ArgumentError

BACKEND = "hetcomm"  # the name torch knows this backend by

# ---- compatibility: what torch 2.4 .. 2.13 call ------------------------------------------------

#: canonical operation -> every method name a torch version calls for it (newest first). torch
#: 2.13 renamed the tensor-in/tensor-out collectives; older versions call the names after the first.
METHOD_NAMES: dict[str, tuple[str, ...]] = {
    "all_gather_single": ("all_gather_single", "_allgather_base"),
    "reduce_scatter_single": ("reduce_scatter_single", "_reduce_scatter_base"),
    "all_to_all_single": ("all_to_all_single", "alltoall_base"),
    "all_gather_single_coalesced": (
        "all_gather_single_coalesced",
        "allgather_into_tensor_coalesced",
    ),
    "reduce_scatter_single_coalesced": (
        "reduce_scatter_single_coalesced",
        "reduce_scatter_tensor_coalesced",
    ),
    "start_coalescing": ("start_coalescing", "_start_coalescing"),
    "end_coalescing": ("end_coalescing", "_end_coalescing"),
}
#: canonical torch.distributed function -> its names, newest first (2.13 deprecated the others)
API_NAMES: dict[str, tuple[str, ...]] = {
    "all_gather_single": ("all_gather_single", "all_gather_into_tensor"),
    "reduce_scatter_single": ("reduce_scatter_single", "reduce_scatter_tensor"),
}
# where FSDP2's fully_shard lives: torch >= 2.6, then 2.4 - 2.5
_FULLY_SHARD_MODULES = ("torch.distributed.fsdp", "torch.distributed._composable.fsdp")
# the module whose private table maps URL schemes to rendezvous handlers (all of 2.4 .. 2.13)
_RENDEZVOUS_MODULE, _RENDEZVOUS_TABLE = "torch.distributed.rendezvous", "_rendezvous_handlers"


def fully_shard(*args: Any, **kwargs: Any) -> Any:
    """FSDP2's `fully_shard` from wherever this torch keeps it."""
    import importlib

    for name in _FULLY_SHARD_MODULES:
        try:
            found = getattr(importlib.import_module(name), "fully_shard", None)
        except ImportError:
            continue
        if found is not None:
            return found(*args, **kwargs)
    raise RuntimeError(f"this torch ({torch.__version__}) has no FSDP2 fully_shard")


def device_being_bound() -> Any:
    """The device torch is binding the group under construction to (init_process_group(
    device_id=...), or new_group inheriting it), or None.

    torch sets `bound_device_id` on a ProcessGroup of its own and then, for a backend whose
    creator returns a ProcessGroup subclass (as hetcomm's does), uses the returned object in
    its place, so the binding is lost (torch 2.4 to 2.13). The creator reads it from the frame
    of torch's helper that calls it; any surprise there means "not bound".
    """
    import sys

    try:
        frame: Any = sys._getframe(1)
        while frame is not None:
            if frame.f_code.co_name == "_new_process_group_helper":
                return frame.f_locals.get("device_id")
            frame = frame.f_back
    except Exception:  # an interpreter without frames: no binding
        return None
    return None


def dist_function(canonical: str) -> Callable[..., Any]:
    """The torch.distributed function for `canonical` under the name this torch uses."""
    for name in API_NAMES.get(canonical, (canonical,)):
        found = getattr(dist, name, None)
        if found is not None:
            return found
    raise AttributeError(f"this torch ({torch.__version__}) has no torch.distributed.{canonical}")


def rendezvous_handlers() -> dict[str, Callable[..., Iterator[tuple[Any, int, int]]]]:
    """torch's table of rendezvous handlers (URL scheme -> handler)."""
    import importlib

    return getattr(importlib.import_module(_RENDEZVOUS_MODULE), _RENDEZVOUS_TABLE)


# ---- reduce ops ---------------------------------------------------------------------------------

_OPS = {
    "SUM": ReduceOp.SUM,
    "AVG": ReduceOp.AVG,
    "PRODUCT": ReduceOp.PROD,
    "MIN": ReduceOp.MIN,
    "MAX": ReduceOp.MAX,
}


_KIND = dist.ReduceOp.RedOpType
# by the RedOpType's value: reading a pybind enum's name costs ~2.7 us, its int ~0.3 us
_BY_VALUE = {int(getattr(_KIND, name)): op for name, op in _OPS.items()}


def _by_hash() -> dict[int, ReduceOp]:
    """hetcomm's ReduceOp by the hash of torch's ReduceOp and RedOpType objects, where both hash
    by their kind alone (as torch's do: an options object's reduceOp is a new ReduceOp at every
    read, and hashing it costs ~0.1 us where reading its .op costs ~0.4 us); empty where they do
    not, which leaves every lookup to the path by value."""
    table: dict[int, ReduceOp] = {}
    for name, op in _OPS.items():
        kind = getattr(_KIND, name)
        hashes = {hash(kind), hash(dist.ReduceOp(kind)), hash(dist.ReduceOp(kind))}
        if len(hashes) != 1 or hashes & table.keys():
            return {}
        table[hashes.pop()] = op
    premul = getattr(dist, "_make_nccl_premul_sum", None)
    if premul is None or hash(premul(2.0)) in table:
        return {}  # a PREMUL_SUM (which carries a factor) must not pass for another kind
    return table


_TORCH_OPS = (dist.ReduceOp, _KIND)
_BY_HASH = _by_hash()


def reduce_op(op: Any, what: str = "reduce") -> ReduceOp:
    """hetcomm's ReduceOp for a torch ReduceOp (or its RedOpType); ValueError naming the rest."""
    if op.__class__ in _TORCH_OPS:
        found = _BY_HASH.get(hash(op))
        if found is not None:
            return found
    kind = getattr(op, "op", op)  # ReduceOp objects carry a RedOpType in .op
    if kind.__class__ is _KIND:
        found = _BY_VALUE.get(int(kind))  # type: ignore[call-overload]
        if found is not None:
            return found
    name = getattr(kind, "name", None) or str(kind).rpartition(".")[2]
    found = _OPS.get(name)
    if found is None:
        raise ArgumentError(
            f"hetcomm {what}: ReduceOp.{name} is not supported; use SUM, AVG, PRODUCT, MIN or MAX"
        )
    return found


class BackendView:
    """Stands in for the C++ backend object torch expects a group to have: torch asks it whether
    the group can split (yes: ProcessGroupHetcomm.split_group) and calls a few hooks that have
    nothing to do here (hetcomm makes each group's communicator when torch creates the group)."""

    supports_splitting = True
    supports_coalescing = False
    supports_time_estimate = False
    options = None

    def __init__(self, group: Any) -> None:
        self._group = group

    def name(self) -> str:
        return BACKEND

    def comm_split_count(self) -> int:
        return self._group._splits

    def supports_tensor_alloc(self, device: Any) -> bool:
        return False

    def perform_nocolor_split(self, device: Any) -> None:
        pass  # non-members of a new group: nothing to do, members make it among themselves

    def eager_connect_single_device(self, device: Any) -> None:
        pass  # the communicator exists already

    def _set_sequence_number_for_group(self) -> None:
        pass


def install_aliases(cls: type) -> None:
    """Give `cls` (the group class) every other name torch has called each of its methods by
    (METHOD_NAMES), where it does not define that name itself."""
    for canonical, names in METHOD_NAMES.items():
        for name in names:
            if name not in cls.__dict__:
                setattr(cls, name, cls.__dict__[canonical])
