"""The table of service-communicator tags (hetcomm.transports.tags): no two uses overlap."""

from __future__ import annotations

import itertools

import pytest

from hetcomm.transports import tags


@pytest.mark.parametrize("tag_ub", [tags.MIN_TAG_UB, 1 << 23, (1 << 31) - 1])
def test_no_two_ranges_overlap(tag_ub: int) -> None:
    ranges = tags.service_ranges(tag_ub)
    for (a, ra), (b, rb) in itertools.combinations(ranges.items(), 2):
        assert len(ra) > 0 and len(rb) > 0, (a, b)
        assert ra.stop <= rb.start or rb.stop <= ra.start, f"{a} {ra} overlaps {b} {rb}"


@pytest.mark.parametrize("tag_ub", [tags.MIN_TAG_UB, (1 << 31) - 1])
def test_every_tag_is_valid_mpi(tag_ub: int) -> None:
    for name, r in tags.service_ranges(tag_ub).items():
        assert r.start >= 0 and r.stop - 1 <= tag_ub, name


def test_direct_user_tags_end_below_the_lead_tags() -> None:
    ub = tags.MIN_TAG_UB
    top = tags.direct_p2p_max_user_tag(ub)
    last = tags.DIRECT_P2P + tags.DIRECT_P2P_PER_TAG * top + tags.DIRECT_P2P_PER_TAG - 1
    assert last < tags.lead_base(ub) <= last + tags.DIRECT_P2P_PER_TAG
