"""When the nccl transport may serve a group: pure rules, no GPU library imported."""

from __future__ import annotations

import pytest

from hetcomm import plan
from hetcomm.transports.nccl import group_unavailable


def test_one_vendor_own_devices_is_fine():
    assert group_unavailable([(0, "GPU-a"), (1, "GPU-b")], ["nvidia", "nvidia"]) is None
    assert group_unavailable([(0, "GPU-a")], ["amd"]) is None


@pytest.mark.parametrize(
    ("devices", "vendors", "words"),
    [
        (
            [(0, "GPU-a"), (1, "GPU-a")],
            ["nvidia", "nvidia"],
            ["ranks 0 and 1", "GPU-a", "duplicate"],
        ),
        ([(0, "GPU-a"), (1, "GPU-b"), (2, "GPU-b")], ["amd"] * 3, ["ranks 1 and 2"]),
        ([(0, "GPU-a"), (1, "GPU-b")], ["nvidia", "amd"], ["span vendors amd, nvidia"]),
        ([(0, "GPU-a"), (1, None)], ["nvidia", "cpu"], ["no GPU"]),
        ([(0, "GPU-a"), (1, None)], ["nvidia", "nvidia"], ["ranks [1] have no device"]),
    ],
)
def test_refusals_name_the_reason(devices, vendors, words):
    why = group_unavailable(devices, vendors)
    assert why is not None
    for w in words:
        assert w in why, (w, why)


def test_plan_passes_the_refusal_on_when_nccl_is_forced():
    members = [plan.Member(r, "h", "nvidia", "GPU-a", False) for r in range(2)]
    why = group_unavailable([(m.rank, m.device) for m in members], [m.vendor for m in members])
    unavailable = {"mpi": None, "nccl": why, "staged": None, "direct": "x", "hier": "x"}
    with pytest.raises(plan.TransportUnavailable, match="duplicate"):
        plan.choose(
            members,
            op="all_reduce",
            memory="device",
            nbytes=1 << 20,
            requested="nccl",
            unavailable=unavailable,
            group="dp",
        )
    auto = plan.choose(
        members,
        op="all_reduce",
        memory="device",
        nbytes=1 << 20,
        requested="auto",
        unavailable=unavailable,
        group="dp",
    )
    assert auto.transport == "staged"
