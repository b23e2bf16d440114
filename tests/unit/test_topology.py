"""Unit tests for the pure parts of hetcomm.topology: RankInfo, Topology tables, subsets, islands.

RankInfo objects are built by hand; nothing here gathers facts over MPI.
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from hetcomm.nics import Nic
from hetcomm.plan import Member, choose
from hetcomm.plan import islands as plan_islands
from hetcomm.topology import RankInfo, Topology

UUID0 = "GPU-0a1b2c3d-4e5f-6789-abcd-ef0123456789"
UUID1 = "GPU-11111111-2222-3333-4444-555555555555"
UUID2 = "amd-6c6b4f0e9d8c7b6a"


def rank_info(rank: int, host: str, vendor: str, **kw: Any) -> RankInfo:
    fields: dict[str, Any] = {
        "rank": rank,
        "world_rank": rank,
        "host": host,
        "vendor": vendor,
        "detected_vendor": vendor,
        "device_index": None,
        "device_uuid": None,
        "local_rank": 0,
        "local_size": 1,
        "node": 0,
        "nics": (),
        "gpu_aware": False,
        "mpi_gpu": "no GPU-support query in this MPI: assumed not GPU-aware",
    }
    fields.update(kw)
    return RankInfo(**fields)


def mixed_four() -> Topology:
    """2 nvidia ranks on host a; 2 amd ranks on host b, the second simulated on a CPU."""
    return Topology(
        [
            rank_info(
                0,
                "a",
                "nvidia",
                device_index=0,
                device_uuid=UUID0,
                local_rank=0,
                local_size=2,
                node=0,
                nics=(Nic("eth0", "10.0.0.1", 24), Nic("ib0", "10.1.0.1", 16, 100000)),
                gpu_aware=True,
                mpi_gpu="MPIX_Query_cuda_support() = 1 (CUDA-aware)",
            ),
            rank_info(
                1,
                "a",
                "nvidia",
                device_index=1,
                device_uuid=UUID1,
                local_rank=1,
                local_size=2,
                node=0,
                nics=(Nic("eth0", "10.0.0.1", 24),),
                gpu_aware=True,
            ),
            rank_info(
                2,
                "b",
                "amd",
                device_index=0,
                device_uuid=UUID2,
                local_rank=0,
                local_size=2,
                node=1,
                nics=(Nic("eth0", "10.0.0.2", 24),),
            ),
            rank_info(
                3,
                "b",
                "amd",
                detected_vendor="cpu",
                local_rank=1,
                local_size=2,
                node=1,
                nics=(Nic("eth0", "10.0.0.2", 24),),
            ),
        ]
    )


# ---- MPI stays out ------------------------------------------------------------------------------


def test_importing_pure_modules_does_not_initialise_mpi() -> None:
    code = (
        "import sys\n"
        "import hetcomm, hetcomm.topology, hetcomm.plan, hetcomm.config, hetcomm.arrays\n"
        "import hetcomm.ops, hetcomm.errors, hetcomm.launch.mpi\n"
        "assert 'mpi4py.MPI' not in sys.modules, sorted(m for m in sys.modules if 'mpi4py' in m)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


# ---- RankInfo -----------------------------------------------------------------------------------


def test_simulated() -> None:
    topo = mixed_four()
    assert [r.simulated for r in topo] == [False, False, False, True]


def test_device_identity_prefers_uuid() -> None:
    r = rank_info(0, "a", "nvidia", device_index=3, device_uuid=UUID0, node=2)
    assert r.device == UUID0


def test_device_identity_without_uuid() -> None:
    r = rank_info(0, "a", "nvidia", device_index=3, node=2)
    assert r.device == "node2:nvidia:3"
    sim = rank_info(0, "a", "amd", detected_vendor="nvidia", device_index=1, node=0)
    assert sim.device == "node0:nvidia:1"  # the real device, whatever vendor is simulated


def test_device_identity_none_on_cpu() -> None:
    assert rank_info(0, "a", "cpu").device is None
    assert rank_info(0, "a", "amd", detected_vendor="cpu").device is None


def test_empty_uuid_falls_back_to_index() -> None:
    assert rank_info(0, "a", "nvidia", device_index=0, device_uuid="").device == "node0:nvidia:0"


def test_shared_device_same_identity() -> None:
    # two ranks given the same GPU: the same UUID means the same device
    a = rank_info(0, "a", "nvidia", device_index=0, device_uuid=UUID0)
    b = rank_info(1, "a", "nvidia", device_index=0, device_uuid=UUID0, local_rank=1)
    assert a.device == b.device
    # two simulated hosts on one node sharing index 0, no UUID: still the same device
    c = rank_info(0, "h0", "nvidia", device_index=0, node=0)
    d = rank_info(1, "h1", "amd", detected_vendor="nvidia", device_index=0, node=0)
    assert c.device == d.device
    # the same index on another node, or another index, is another device
    assert c.device != rank_info(2, "h2", "nvidia", device_index=0, node=1).device
    assert c.device != rank_info(3, "h0", "nvidia", device_index=1, node=0).device
    assert a.device != rank_info(4, "a", "nvidia", device_index=0, device_uuid=UUID1).device


def test_shared_device_is_not_nccl_in_the_plan() -> None:
    topo = Topology(
        [
            rank_info(0, "a", "nvidia", device_index=0, device_uuid=UUID0, gpu_aware=True),
            rank_info(1, "a", "nvidia", device_index=0, device_uuid=UUID0, gpu_aware=True),
        ]
    )
    unavailable = dict.fromkeys(("mpi", "nccl", "direct", "staged", "hier"))
    choice = choose(
        topo.members(),
        op="all_reduce",
        memory="device",
        nbytes=8,
        requested="auto",
        unavailable=unavailable,
        group="g",
    )
    assert choice.transport != "nccl"


def test_member() -> None:
    topo = mixed_four()
    assert topo[0].member() == Member(0, "a", "nvidia", UUID0, True)
    assert topo[3].member() == Member(3, "b", "amd", None, False)
    assert topo.members() == [r.member() for r in topo]


# ---- Topology -----------------------------------------------------------------------------------


def test_sequence_protocol() -> None:
    topo = mixed_four()
    assert len(topo) == 4
    assert [r.rank for r in topo] == [0, 1, 2, 3]
    assert topo[2].vendor == "amd"
    assert topo[-1].rank == 3
    assert isinstance(topo.ranks, tuple)


def test_islands_hosts_vendors() -> None:
    topo = mixed_four()
    assert topo.islands() == [(0, 1), (2, 3)]
    assert topo.islands() == plan_islands(topo.members())
    assert topo.hosts() == ["a", "b"]
    assert topo.vendors() == ["amd", "nvidia"]


def test_islands_interleaved_and_one_host() -> None:
    topo = Topology(
        [
            rank_info(0, "b", "amd"),
            rank_info(1, "a", "nvidia"),
            rank_info(2, "b", "amd"),
            rank_info(3, "a", "amd"),
            rank_info(4, "a", "nvidia"),
        ]
    )
    assert topo.islands() == [(0, 2), (1, 4), (3,)]
    assert topo.hosts() == ["a", "b"]
    assert topo.vendors() == ["amd", "nvidia"]
    one = Topology([rank_info(i, "h", "cpu") for i in range(3)])
    assert one.islands() == [(0, 1, 2)]
    assert one.hosts() == ["h"] and one.vendors() == ["cpu"]


def test_members_of_the_mixed_case() -> None:
    assert mixed_four().members() == [
        Member(0, "a", "nvidia", UUID0, True),
        Member(1, "a", "nvidia", UUID1, True),
        Member(2, "b", "amd", UUID2, False),
        Member(3, "b", "amd", None, False),
    ]


def test_subset_renumbers() -> None:
    topo = mixed_four()
    sub = topo.subset([3, 0, 2])
    assert len(sub) == 3
    assert [r.rank for r in sub] == [0, 1, 2]
    assert [r.world_rank for r in sub] == [3, 0, 2]
    assert [r.host for r in sub] == ["b", "a", "b"]
    assert [r.local_rank for r in sub] == [0, 0, 1]
    assert [r.local_size for r in sub] == [2, 1, 2]
    assert [r.device for r in sub] == [None, UUID0, UUID2]
    assert [r.vendor for r in sub] == ["amd", "nvidia", "amd"]
    assert sub.islands() == [(0, 2), (1,)]
    for r, parent in zip(sub, (3, 0, 2), strict=True):
        assert replace(r, rank=parent, local_rank=0, local_size=0) == replace(
            topo[parent], local_rank=0, local_size=0
        )
    # the parent is untouched
    assert [r.rank for r in topo] == [0, 1, 2, 3]
    assert [r.local_rank for r in topo] == [0, 1, 0, 1]


def test_subset_one_per_host() -> None:
    sub = mixed_four().subset([1, 3])
    assert [(r.rank, r.host, r.local_rank, r.local_size) for r in sub] == [
        (0, "a", 0, 1),
        (1, "b", 0, 1),
    ]
    assert sub.islands() == [(0,), (1,)]


def test_subset_empty_and_identity() -> None:
    topo = mixed_four()
    assert len(topo.subset([])) == 0
    assert topo.subset(range(4)).ranks == topo.ranks


def test_subset_of_subset() -> None:
    topo = mixed_four()
    assert topo.subset([3, 0, 2]).subset([2, 0]).ranks == topo.subset([2, 3]).ranks


def test_subset_random() -> None:
    rng = np.random.default_rng()
    for _ in range(50):
        n = int(rng.integers(1, 12))
        hosts = [f"h{int(h)}" for h in rng.integers(0, 3, size=n)]
        topo = Topology([rank_info(i, hosts[i], "nvidia", device_index=i) for i in range(n)])
        parents = [int(p) for p in rng.permutation(n)[: int(rng.integers(0, n + 1))]]
        sub = topo.subset(parents)
        assert [r.rank for r in sub] == list(range(len(parents)))
        for i, r in enumerate(sub):
            same_host_before = [p for p in parents[:i] if hosts[p] == r.host]
            assert r.local_rank == len(same_host_before)
            assert r.local_size == sum(hosts[p] == r.host for p in parents)
            assert r.device_index == parents[i]


def test_fingerprint_stable() -> None:
    fp = mixed_four().fingerprint()
    assert re.fullmatch(r"[0-9a-f]{16}", fp)
    assert mixed_four().fingerprint() == fp  # rebuilt from the same facts
    assert mixed_four().fingerprint() == mixed_four().fingerprint()


def test_fingerprint_sensitive_to_vendor() -> None:
    topo = mixed_four()
    changed = Topology([*topo.ranks[:3], replace(topo[3], vendor="nvidia")])
    assert changed.fingerprint() != topo.fingerprint()


@pytest.mark.parametrize(
    "change",
    [
        {"host": "c"},
        {"device_uuid": "GPU-ffffffff"},
        {"nics": (Nic("eth0", "10.0.0.9", 24),)},
        {"nics": ()},
    ],
)
def test_fingerprint_sensitive_to_hosts_devices_addresses(change: dict[str, Any]) -> None:
    topo = mixed_four()
    changed = Topology([replace(topo[0], **change), *topo.ranks[1:]])
    assert changed.fingerprint() != topo.fingerprint()


@pytest.mark.parametrize(
    "change",
    [
        {"gpu_aware": False},
        {"mpi_gpu": "other"},
        {"world_rank": 9},
        {"local_size": 7},
        {"nics": (Nic("eth9", "10.0.0.1", 30, 10), Nic("ib9", "10.1.0.1", 8))},
    ],
)
def test_fingerprint_ignores_other_facts(change: dict[str, Any]) -> None:
    # only hosts, vendors, devices and NIC addresses shape it
    topo = mixed_four()
    changed = Topology([replace(topo[0], **change), *topo.ranks[1:]])
    assert changed.fingerprint() == topo.fingerprint()


def test_fingerprint_depends_on_rank_order() -> None:
    topo = mixed_four()
    assert topo.subset([1, 0, 2, 3]).fingerprint() != topo.fingerprint()


def test_table() -> None:
    topo = mixed_four()
    text = topo.table()
    assert str(topo) == text
    lines = text.splitlines()
    assert len(lines) == 1 + len(topo)
    assert lines[0].split() == [
        "rank",
        "host",
        "vendor",
        "device",
        "local",
        "gpu-aware",
        "MPI",
        "NICs",
    ]
    assert lines[1].split() == [
        "0",
        "a",
        "nvidia",
        "0",
        UUID0[:12],
        "0/2",
        "yes",
        "eth0",
        "10.0.0.1/24,",
        "ib0",
        "10.1.0.1/16",
    ]
    assert lines[2].split() == [
        "1",
        "a",
        "nvidia",
        "1",
        UUID1[:12],
        "1/2",
        "yes",
        "eth0",
        "10.0.0.1/24",
    ]
    assert lines[3].split() == [
        "2",
        "b",
        "amd",
        "0",
        UUID2[:12],
        "0/2",
        "no",
        "eth0",
        "10.0.0.2/24",
    ]
    assert lines[4].split() == [
        "3",
        "b",
        "amd",
        "(sim;",
        "is",
        "cpu)",
        "-",
        "1/2",
        "no",
        "eth0",
        "10.0.0.2/24",
    ]
    assert "amd (sim; is cpu)" in lines[4]
    assert text.count("(sim;") == 1
    # columns line up: the host column starts at the same offset in every line
    offset = lines[0].index("host")
    assert [line[offset] for line in lines[1:]] == ["a", "a", "b", "b"]
    assert all(line == line.rstrip() for line in lines)


def test_table_every_rank_without_interfaces() -> None:
    topo = Topology([rank_info(i, f"host{i % 3}", "cpu", local_size=2) for i in range(7)])
    lines = topo.table().splitlines()
    assert len(lines) == 8
    for i, line in enumerate(lines[1:]):
        cells = line.split()
        assert cells[0] == str(i)
        assert cells[1] == f"host{i % 3}"
        assert cells[2] == "cpu"
        assert cells[3] == "-"  # no device
        assert cells[-1] == "-"  # no NICs
    assert "(sim;" not in topo.table()


def test_table_simulated_gpu_vendor_on_other_gpu() -> None:
    topo = Topology([rank_info(0, "a", "amd", detected_vendor="nvidia", device_index=0)])
    assert "amd (sim; is nvidia)" in topo.table()


def test_ranks_share_one_device_only_where_every_rank_is_on_the_same_one():
    def gpu(rank: int, uuid: str | None, vendor: str = "nvidia") -> RankInfo:
        index = None if uuid is None else 0
        return rank_info(rank, "a", vendor, device_index=index, device_uuid=uuid)

    assert Topology([gpu(0, UUID0), gpu(1, UUID0), gpu(2, UUID0)]).share_one_device()
    # simulated vendors on one real GPU: the device is its UUID, whatever the vendor said
    assert Topology([gpu(0, UUID0), gpu(1, UUID0, "amd")]).share_one_device()
    assert not Topology([gpu(0, UUID0), gpu(1, UUID1)]).share_one_device()
    assert not Topology([gpu(0, UUID0)]).share_one_device()  # one rank shares nothing
    assert not Topology([gpu(0, None, "cpu"), gpu(1, None, "cpu")]).share_one_device()
    assert not mixed_four().share_one_device()
