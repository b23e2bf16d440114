"""Rank arithmetic for tensor, context, expert, data and pipeline parallel groups."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from .errors import TopologyError

__all__ = ["DEFAULT_ORDER", "DIMENSIONS", "LayoutError", "ParallelLayout"]

DIMENSIONS: tuple[str, ...] = ("tp", "cp", "ep", "dp", "pp")
DEFAULT_ORDER = "tp-cp-ep-dp-pp"


class LayoutError(TopologyError, ValueError):
    """An impossible or inconsistent parallel layout, rank or group request."""


def _check_int(what: str, value: object, *, minimum: int | None = None) -> int:
    """Return ``value`` if it is an int (not a bool) >= ``minimum``, else raise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise LayoutError(f"{what} must be an int, got {value!r} ({type(value).__name__})")
    if minimum is not None and value < minimum:
        raise LayoutError(f"{what} must be >= {minimum}, got {value}")
    return value


def _split_names(spec: str | Iterable[str], what: str) -> tuple[str, ...]:
    """Split ``"tp-pp"`` (or an iterable of names) and reject unknown or repeated names."""
    names = tuple(spec.split("-")) if isinstance(spec, str) else tuple(spec)
    if not names or any(not isinstance(n, str) for n in names):
        raise LayoutError(f"{what} must be names from {DIMENSIONS} joined by '-', got {spec!r}")
    unknown = [n for n in names if n not in DIMENSIONS]
    if unknown:
        raise LayoutError(
            f"{what} {spec!r} has unknown dimension(s) {unknown}; expected names from {DIMENSIONS}"
        )
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise LayoutError(f"{what} {spec!r} repeats dimension(s) {repeated}")
    return names


@dataclass(frozen=True)
class ParallelLayout:
    """A world of ``world_size`` ranks viewed as a grid over :data:`DIMENSIONS`.

    ``order`` lists the dimensions fastest-varying first: with the default order,
    ``rank = tp + TP*(cp + CP*(ep + EP*(dp + DP*pp)))`` as in Megatron-LM's RankGenerator.
    The constructor accepts a partial ``sizes`` mapping and an order given as a string;
    both are normalised (missing sizes become 1, omitted size-1 dims go to the end).
    """

    world_size: int
    sizes: Mapping[str, int]
    order: tuple[str, ...] = tuple(DEFAULT_ORDER.split("-"))

    def __post_init__(self) -> None:
        world = _check_int("world_size", self.world_size, minimum=1)
        if not isinstance(self.sizes, Mapping):
            raise LayoutError(f"sizes must be a mapping, got {type(self.sizes).__name__}")
        unknown = [k for k in self.sizes if k not in DIMENSIONS]
        if unknown:
            raise LayoutError(f"sizes has unknown dimension(s) {unknown}; expected {DIMENSIONS}")
        sizes = {d: _check_int(f"{d} size", self.sizes.get(d, 1), minimum=1) for d in DIMENSIONS}
        product = math.prod(sizes.values())
        if product != world:
            names = "*".join(DIMENSIONS)
            factors = "*".join(str(sizes[d]) for d in DIMENSIONS)
            raise LayoutError(f"{names} = {factors} = {product}, but the world has {world} ranks")
        order = _split_names(self.order, "order")
        missing = [d for d in DIMENSIONS if d not in order]
        too_big = [d for d in missing if sizes[d] != 1]
        if too_big:
            raise LayoutError(
                f"order {self.order!r} omits dimension(s) {too_big} whose size is not 1; "
                f"expected a permutation of {DIMENSIONS} joined by '-'"
            )
        object.__setattr__(self, "sizes", MappingProxyType(sizes))
        object.__setattr__(self, "order", order + tuple(missing))

    def __hash__(self) -> int:
        return hash((self.world_size, tuple(self.sizes.items()), self.order))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ParallelLayout):
            return NotImplemented
        return (self.world_size, dict(self.sizes), self.order) == (
            other.world_size,
            dict(other.sizes),
            other.order,
        )

    @classmethod
    def build(
        cls,
        world_size: int,
        *,
        tp: int = 1,
        cp: int = 1,
        ep: int = 1,
        dp: int | None = None,
        pp: int = 1,
        order: str | Iterable[str] = DEFAULT_ORDER,
    ) -> ParallelLayout:
        """Make a layout; ``dp=None`` takes whatever ``tp*cp*ep*pp`` leaves of the world."""
        world = _check_int("world_size", world_size, minimum=1)
        given = {"tp": tp, "cp": cp, "ep": ep, "pp": pp}
        for name, value in given.items():
            _check_int(f"{name} size", value, minimum=1)
        if dp is None:
            rest = math.prod(given.values())
            if world % rest:
                raise LayoutError(
                    f"tp*cp*ep*pp = {tp}*{cp}*{ep}*{pp} = {rest} does not divide "
                    f"the world of {world} ranks, so dp cannot be inferred"
                )
            dp = world // rest
        order_t = tuple(order.split("-")) if isinstance(order, str) else tuple(order)
        return cls(world, {**given, "dp": dp}, order_t)

    # -- geometry -------------------------------------------------------------------------

    @property
    def strides(self) -> dict[str, int]:
        """Rank distance between neighbours along each dimension."""
        strides: dict[str, int] = {}
        step = 1
        for d in self.order:
            strides[d] = step
            step *= self.sizes[d]
        return strides

    def _check_rank(self, rank: int) -> int:
        _check_int("rank", rank)
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank must be in [0, {self.world_size}), got {rank}")
        return rank

    def _dims(self, dims: str) -> tuple[str, ...]:
        """Parse a group kind such as ``"tp-pp"`` into its dims, in layout order."""
        names = set(_split_names(dims, "dims"))
        return tuple(d for d in self.order if d in names)

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinate of ``rank`` along every dimension (keys in :data:`DIMENSIONS` order)."""
        rest = self._check_rank(rank)
        by_order: dict[str, int] = {}
        for d in self.order:
            rest, by_order[d] = divmod(rest, self.sizes[d])
        return {d: by_order[d] for d in DIMENSIONS}

    def rank_of(self, **coords: int) -> int:
        """Inverse of :meth:`coords`; dimensions not given are taken as 0."""
        unknown = [k for k in coords if k not in DIMENSIONS]
        if unknown:
            raise LayoutError(f"unknown dimension(s) {unknown}; expected names from {DIMENSIONS}")
        strides = self.strides
        rank = 0
        for d, c in coords.items():
            _check_int(f"{d} coordinate", c, minimum=0)
            if c >= self.sizes[d]:
                raise LayoutError(f"{d} coordinate must be in [0, {self.sizes[d]}), got {c}")
            rank += c * strides[d]
        return rank

    def group_size(self, dims: str) -> int:
        """Number of ranks in each group of kind ``dims``."""
        return math.prod(self.sizes[d] for d in self._dims(dims))

    def num_groups(self, dims: str) -> int:
        """Number of groups of kind ``dims``."""
        return self.world_size // self.group_size(dims)

    def group_ranks(self, dims: str, rank: int) -> tuple[int, ...]:
        """Ranks that differ from ``rank`` only along ``dims``, by rank within the group."""
        inside = self._dims(dims)
        strides = self.strides
        c = self.coords(rank)
        base = rank - sum(c[d] * strides[d] for d in inside)
        members = [base]
        for d in inside:  # layout order: first dim fastest within the group
            members = [m + i * strides[d] for i in range(self.sizes[d]) for m in members]
        return tuple(members)

    def rank_in_group(self, dims: str, rank: int) -> int:
        """Position of ``rank`` within its group of kind ``dims`` (usable as an MPI Split key)."""
        c = self.coords(rank)
        pos, step = 0, 1
        for d in self._dims(dims):
            pos += c[d] * step
            step *= self.sizes[d]
        return pos

    def group_index(self, dims: str, rank: int) -> int:
        """Dense index of ``rank``'s group of kind ``dims`` (an MPI Split color).

        Groups are numbered in increasing order of their smallest member rank, which is
        the mixed-radix number of the coordinates outside ``dims`` in layout order.
        """
        inside = set(self._dims(dims))
        c = self.coords(rank)
        index, step = 0, 1
        for d in self.order:
            if d not in inside:
                index += c[d] * step
                step *= self.sizes[d]
        return index

    def groups(self, dims: str) -> list[tuple[int, ...]]:
        """All groups of kind ``dims``, ordered by :meth:`group_index`."""
        inside = self._dims(dims)
        seen: dict[int, tuple[int, ...]] = {}
        for r in range(self.world_size):
            if all(v == 0 for d, v in self.coords(r).items() if d in inside):
                seen[self.group_index(dims, r)] = self.group_ranks(dims, r)
        return [seen[i] for i in range(len(seen))]

    def __str__(self) -> str:
        parts = " x ".join(f"{d}{self.sizes[d]}" for d in self.order)
        return f"world {self.world_size} = {parts} (order {'-'.join(self.order)})"
