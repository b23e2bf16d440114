"""ParallelGroups: the tp, cp, ep, dp and pp communicators of a job, split in one fixed order."""

from __future__ import annotations

from .comm import Communicator
from .layout import DEFAULT_ORDER, DIMENSIONS, ParallelLayout


class ParallelGroups:
    """Splits `world` into the groups of a `ParallelLayout` and names each one.

    Every rank must build the same ParallelGroups (it is collective). The splits run in the
    order of DIMENSIONS, the same on every rank, so no two ranks can interleave them
    differently. `groups.tp`, `groups.dp`, ... are Communicators named after their dimension;
    close them with `close()` or a `with` block.
    """

    def __init__(
        self,
        world: Communicator,
        *,
        tp: int = 1,
        cp: int = 1,
        ep: int = 1,
        dp: int | None = None,
        pp: int = 1,
        order: str = DEFAULT_ORDER,
    ) -> None:
        self.world = world
        self.layout = ParallelLayout.build(
            world.size, tp=tp, cp=cp, ep=ep, dp=dp, pp=pp, order=order
        )
        self._comms: dict[str, Communicator] = {}
        try:
            for dim in DIMENSIONS:
                comm = world.split(
                    self.layout.group_index(dim, world.rank),
                    key=self.layout.rank_in_group(dim, world.rank),
                    name=dim,
                )
                assert comm is not None
                self._comms[dim] = comm
        except BaseException:
            self.close()
            raise

    def __getattr__(self, name: str) -> Communicator:
        comms = self.__dict__.get("_comms", {})
        if name in comms:
            return comms[name]
        raise AttributeError(
            f"ParallelGroups has no group {name!r}; groups: {', '.join(DIMENSIONS)}"
        )

    def __getitem__(self, name: str) -> Communicator:
        try:
            return self._comms[name]
        except KeyError:
            raise KeyError(f"no group {name!r}; groups: {', '.join(DIMENSIONS)}") from None

    @property
    def coords(self) -> dict[str, int]:
        """This rank's coordinate along every dimension."""
        return self.layout.coords(self.world.rank)

    def items(self) -> list[tuple[str, Communicator]]:
        """(name, communicator) of every group, in the layout's order."""
        return list(self._comms.items())

    def close(self) -> None:
        """Close every group communicator (the world stays open)."""
        for comm in self._comms.values():
            comm.close()

    def __enter__(self) -> ParallelGroups:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<ParallelGroups {self.layout}>"
