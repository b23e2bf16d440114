"""Tests for hetcomm.layout rank arithmetic over many shapes and orders."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import Any

import pytest

from hetcomm.layout import DEFAULT_ORDER, DIMENSIONS, LayoutError, ParallelLayout

ALL_ORDERS = ["-".join(p) for p in itertools.permutations(DIMENSIONS)]


def factorizations(n: int, parts: int = len(DIMENSIONS)) -> Iterator[tuple[int, ...]]:
    """Every ordered tuple of ``parts`` positive ints whose product is ``n``."""
    if parts == 1:
        yield (n,)
        return
    for f in range(1, n + 1):
        if n % f == 0:
            for rest in factorizations(n // f, parts - 1):
                yield (f, *rest)


# Sizes are dict[str, Any] so mypy accepts them as **kwargs to ParallelLayout.build.
ALL_SHAPES: list[tuple[int, dict[str, Any]]] = [
    (w, dict(zip(DIMENSIONS, f, strict=True))) for w in range(1, 17) for f in factorizations(w)
]
# A spread of non-trivial shapes to cross with every one of the 120 orders.
ORDER_SHAPES: list[tuple[int, dict[str, Any]]] = [
    (8, {"tp": 2, "dp": 2, "pp": 2}),
    (12, {"tp": 2, "cp": 3, "pp": 2}),
    (16, {"tp": 2, "cp": 2, "ep": 2, "dp": 2}),
    (6, {"ep": 3, "dp": 2}),
]
GROUP_KINDS = ["tp", "cp", "ep", "dp", "pp", "tp-dp", "tp-pp", "cp-ep-dp", "pp-tp", DEFAULT_ORDER]


def check_layout(layout: ParallelLayout) -> None:
    """Check every structural property of ``layout``."""
    world = layout.world_size
    assert math.prod(layout.sizes.values()) == world
    for r in range(world):
        c = layout.coords(r)
        assert set(c) == set(DIMENSIONS)
        assert layout.rank_of(**c) == r
    for kind in GROUP_KINDS:
        inside = set(kind.split("-"))
        size = math.prod(layout.sizes[d] for d in inside)
        groups = layout.groups(kind)
        assert sorted(r for g in groups for r in g) == list(range(world))  # a partition
        assert all(len(g) == size for g in groups)
        assert len(groups) == world // size == layout.num_groups(kind)
        assert [min(g) for g in groups] == sorted(min(g) for g in groups)
        assert layout.group_size(kind) == size
        for r in range(world):
            idx = layout.group_index(kind, r)
            members = layout.group_ranks(kind, r)
            assert groups[idx] == members
            assert members[layout.rank_in_group(kind, r)] == r
            assert min(members) == members[0]
            cr = layout.coords(r)
            for m in members:
                cm = layout.coords(m)
                assert all(cm[d] == cr[d] for d in DIMENSIONS if d not in inside)


@pytest.mark.parametrize(("world", "sizes"), ALL_SHAPES)
def test_all_factorizations_default_order(world: int, sizes: dict[str, Any]) -> None:
    layout = ParallelLayout.build(world, **sizes)
    assert dict(layout.sizes) == sizes
    check_layout(layout)


@pytest.mark.parametrize("order", ALL_ORDERS)
def test_all_orders(order: str) -> None:
    for world, sizes in ORDER_SHAPES:
        layout = ParallelLayout.build(world, order=order, **sizes)
        assert layout.order == tuple(order.split("-"))
        check_layout(layout)
        strides = layout.strides
        first = layout.order[0]
        assert strides[first] == 1
        for prev, nxt in itertools.pairwise(layout.order):
            assert strides[nxt] == strides[prev] * layout.sizes[prev]


def test_dp_group_iff_non_dp_coords_equal() -> None:
    for world, sizes in ALL_SHAPES[::3]:
        layout = ParallelLayout.build(world, **sizes)
        for a, b in itertools.product(range(world), repeat=2):
            ca, cb = layout.coords(a), layout.coords(b)
            same = all(ca[d] == cb[d] for d in DIMENSIONS if d != "dp")
            assert (b in layout.group_ranks("dp", a)) == same
            assert (layout.group_index("dp", a) == layout.group_index("dp", b)) == same


def test_megatron_example_world8() -> None:
    layout = ParallelLayout.build(8, tp=2, pp=2)
    assert layout.sizes["dp"] == 2
    assert layout.groups("tp") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert layout.groups("dp") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert layout.groups("pp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert layout.groups("cp") == [(r,) for r in range(8)]
    assert layout.groups("tp-dp") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert layout.groups("tp-pp") == [(0, 1, 4, 5), (2, 3, 6, 7)]
    assert layout.groups("pp-tp") == layout.groups("tp-pp")
    assert layout.groups("dp-pp") == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert layout.coords(5) == {"tp": 1, "cp": 0, "ep": 0, "dp": 0, "pp": 1}
    assert layout.rank_of(tp=1, dp=1, pp=1) == 7
    assert layout.rank_of() == 0
    assert layout.group_index("dp", 5) == 3
    assert layout.rank_in_group("dp", 3) == 1
    assert layout.rank_in_group("tp-pp", 4) == 2
    assert str(layout) == "world 8 = tp2 x cp1 x ep1 x dp2 x pp2 (order tp-cp-ep-dp-pp)"


def test_megatron_example_world16_cp() -> None:
    layout = ParallelLayout.build(16, tp=2, cp=2, pp=2)
    assert layout.groups("cp")[:2] == [(0, 2), (1, 3)]
    assert layout.groups("dp") == [
        (0, 4),
        (1, 5),
        (2, 6),
        (3, 7),
        (8, 12),
        (9, 13),
        (10, 14),
        (11, 15),
    ]
    assert layout.groups("cp-dp")[0] == (0, 2, 4, 6)
    assert layout.groups("pp")[0] == (0, 8)


def test_other_order() -> None:
    layout = ParallelLayout.build(8, tp=2, dp=2, pp=2, order="tp-pp-dp")
    assert layout.order == ("tp", "pp", "dp", "cp", "ep")
    assert layout.groups("pp") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert layout.groups("dp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert str(layout) == "world 8 = tp2 x pp2 x dp2 x cp1 x ep1 (order tp-pp-dp-cp-ep)"
    assert ParallelLayout.build(8, tp=2, dp=2, pp=2, order=("tp", "pp", "dp")) == layout


def test_direct_construction_and_immutability() -> None:
    layout = ParallelLayout(4, {"tp": 2, "dp": 2})
    assert layout == ParallelLayout.build(4, tp=2)
    assert hash(layout) == hash(ParallelLayout.build(4, tp=2, dp=2))
    assert layout != ParallelLayout.build(4, tp=2, order="dp-tp")
    assert ParallelLayout(4, {"tp": 2, "dp": 2}, "dp-tp").order[:2] == ("dp", "tp")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        layout.sizes["tp"] = 4  # type: ignore[index]
    with pytest.raises(AttributeError):
        layout.world_size = 8  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"world_size": 0}, r"world_size must be >= 1, got 0"),
        ({"world_size": 8.0}, r"world_size must be an int"),
        ({"world_size": True}, r"world_size must be an int"),
        ({"world_size": 8, "tp": 0}, r"tp size must be >= 1, got 0"),
        ({"world_size": 8, "pp": True}, r"pp size must be an int, got True \(bool\)"),
        ({"world_size": 8, "cp": 2.0}, r"cp size must be an int"),
        ({"world_size": 8, "dp": 0}, r"dp size must be >= 1"),
        ({"world_size": 8, "dp": "2"}, r"dp size must be an int"),
        (
            {"world_size": 8, "tp": 2, "dp": 3, "pp": 2},
            r"tp\*cp\*ep\*dp\*pp = 2\*1\*1\*3\*2 = 12, but the world has 8 ranks",
        ),
        (
            {"world_size": 8, "tp": 3},
            r"tp\*cp\*ep\*pp = 3\*1\*1\*1 = 3 does not divide the world of 8 ranks",
        ),
        ({"world_size": 8, "tp": 16}, r"= 16 does not divide the world of 8 ranks"),
        ({"world_size": 8, "tp": 2, "order": "tp-xp-dp"}, r"unknown dimension\(s\) \['xp'\]"),
        ({"world_size": 8, "tp": 2, "order": "tp-tp-dp"}, r"repeats dimension\(s\) \['tp'\]"),
        ({"world_size": 8, "tp": 2, "order": "tp,dp"}, r"unknown dimension"),
        ({"world_size": 8, "tp": 2, "order": ""}, r"unknown dimension"),
        ({"world_size": 8, "tp": 2, "order": ()}, r"order must be names"),
        (
            {"world_size": 8, "tp": 2, "order": "dp-pp"},
            r"omits dimension\(s\) \['tp'\] whose size is not 1",
        ),
    ],
)
def test_build_errors(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(LayoutError, match=match):
        ParallelLayout.build(**kwargs)  # type: ignore[arg-type]


def test_constructor_errors() -> None:
    with pytest.raises(LayoutError, match=r"unknown dimension\(s\) \['mp'\]"):
        ParallelLayout(2, {"mp": 2})
    with pytest.raises(LayoutError, match=r"sizes must be a mapping"):
        ParallelLayout(2, [("tp", 2)])  # type: ignore[arg-type]
    with pytest.raises(LayoutError, match=r"= 2, but the world has 4 ranks"):
        ParallelLayout(4, {"tp": 2})
    assert issubclass(LayoutError, ValueError)


def test_rank_and_coord_errors() -> None:
    layout = ParallelLayout.build(8, tp=2, pp=2)
    for bad in (-1, 8, 100):
        for call in (layout.coords, lambda r: layout.group_ranks("dp", r)):
            with pytest.raises(LayoutError, match=rf"rank must be in \[0, 8\), got {bad}"):
                call(bad)
        with pytest.raises(LayoutError, match=r"rank must be in"):
            layout.group_index("tp", bad)
        with pytest.raises(LayoutError, match=r"rank must be in"):
            layout.rank_in_group("tp", bad)
    with pytest.raises(LayoutError, match=r"rank must be an int, got True \(bool\)"):
        layout.coords(True)
    with pytest.raises(LayoutError, match=r"rank must be an int"):
        layout.coords(1.0)  # type: ignore[arg-type]
    with pytest.raises(LayoutError, match=r"tp coordinate must be in \[0, 2\), got 2"):
        layout.rank_of(tp=2)
    with pytest.raises(LayoutError, match=r"cp coordinate must be in \[0, 1\), got 1"):
        layout.rank_of(cp=1)
    with pytest.raises(LayoutError, match=r"dp coordinate must be >= 0, got -1"):
        layout.rank_of(dp=-1)
    with pytest.raises(LayoutError, match=r"pp coordinate must be an int"):
        layout.rank_of(pp=1.0)  # type: ignore[arg-type]
    with pytest.raises(LayoutError, match=r"unknown dimension\(s\) \['xx'\]"):
        layout.rank_of(xx=0)


@pytest.mark.parametrize("method", ["group_ranks", "group_index", "rank_in_group"])
@pytest.mark.parametrize(
    ("dims", "match"),
    [
        ("xp", r"unknown dimension\(s\) \['xp'\]"),
        ("tp-tp", r"repeats dimension"),
        ("", r"unknown dimension"),
        ("tp-", r"unknown dimension"),
    ],
)
def test_bad_dims(method: str, dims: str, match: str) -> None:
    layout = ParallelLayout.build(8, tp=2, pp=2)
    with pytest.raises(LayoutError, match=match):
        getattr(layout, method)(dims, 0)
    with pytest.raises(LayoutError, match=match):
        layout.groups(dims)
