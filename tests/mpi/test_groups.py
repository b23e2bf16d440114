"""ParallelGroups over real MPI: membership, names and reductions of every group of a layout."""

from __future__ import annotations

import numpy as np
import pytest

from hetcomm import LayoutError, ParallelGroups, ParallelLayout
from hetcomm.layout import DIMENSIONS

# (world size, sizes and order): every layout runs on the world size it is written for
LAYOUTS = [
    (4, {"tp": 2, "dp": 2}),
    (4, {"pp": 2, "dp": 2}),
    (4, {"tp": 2, "pp": 2}),
    (4, {"dp": 4}),
    (4, {"tp": 4}),
    (4, {"tp": 2, "pp": 2, "order": "tp-pp-dp"}),
    (4, {"tp": 2, "pp": 2, "order": "pp-tp"}),
    (4, {"tp": 2, "dp": 2, "order": "dp-tp"}),
    (4, {"cp": 2, "ep": 2, "order": "ep-cp"}),
    (2, {"tp": 2}),
    (2, {"pp": 2}),
    (2, {"dp": 2}),
]


def _id(world: int, sizes: dict) -> str:
    dims = "-".join(f"{k}{v}" for k, v in sizes.items() if k != "order")
    return f"{world}ranks-{dims}" + (f"-order-{sizes['order']}" if "order" in sizes else "")


@pytest.mark.parametrize(
    ("world", "sizes"),
    [pytest.param(w, s, id=_id(w, s), marks=pytest.mark.mpi(min_size=w)) for w, s in LAYOUTS],
)
def test_groups_match_the_layout(hetcomm_comm, errors, world, sizes):
    if hetcomm_comm.size != world:
        pytest.skip(f"layout for {world} ranks, running on {hetcomm_comm.size}")
    layout = ParallelLayout.build(world, **sizes)
    rank = hetcomm_comm.rank
    with ParallelGroups(hetcomm_comm, **sizes) as groups:
        errors.expect(groups.layout == layout, f"layout {groups.layout}, expected {layout}")
        errors.expect(groups.coords == layout.coords(rank), f"coords {groups.coords}")
        for dim in DIMENSIONS:
            g = groups[dim]
            errors.expect(getattr(groups, dim) is g, f"groups.{dim} is not groups[{dim!r}]")
            want = layout.group_ranks(dim, rank)
            got = tuple(g.mpi.allgather(rank))
            errors.expect(got == want, f"{dim}: members {got}, expected {want}")
            errors.expect(g.name == dim, f"{dim}: named {g.name!r}")
            errors.expect(
                (g.rank, g.size) == (layout.rank_in_group(dim, rank), len(want)),
                f"{dim}: rank {g.rank} of {g.size}",
            )
            x = np.array([rank, 1], dtype=np.int64)
            g.all_reduce(x)
            errors.expect(x.tolist() == [sum(want), len(want)], f"{dim}: all_reduce gave {x}")
        comms = [c for _, c in groups.items()]
    errors.expect(all(c.closed for c in comms), "a group stayed open after the with block")
    errors.expect(not hetcomm_comm.closed, "the world was closed with its groups")
    errors.verify()


@pytest.mark.mpi(min_size=2)
def test_impossible_layout_raises_on_every_rank(hetcomm_comm, errors):
    for sizes in (
        {"tp": hetcomm_comm.size + 1},
        {"tp": hetcomm_comm.size, "pp": 2},
        {"tp": 2, "order": "pp-dp"},
    ):
        try:
            ParallelGroups(hetcomm_comm, **sizes)
        except LayoutError:
            pass
        else:
            errors.append(f"{sizes} on {hetcomm_comm.size} ranks did not raise LayoutError")
    x = np.ones(1)
    hetcomm_comm.all_reduce(x)  # and the world is still in step
    errors.expect(x[0] == hetcomm_comm.size, f"all_reduce after gave {x}")
    errors.verify()
