"""Unit tests for per-rank binding (hetcomm.launch.affinity, .rankenv) over fake sysfs trees."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest
from hetcomm.launch import affinity
from hetcomm.launch.command import LaunchRequest, build
from hetcomm.launch.flavours import FLAVOURS
from hetcomm.launch.rankenv import (
    PLAN_VARIABLE,
    LaunchPlan,
    PlanError,
    RankEnvironment,
    rank_environment,
    rank_ids,
)

from hetcomm.run import describe

ADDRESSES = {
    "eth0": [("10.0.0.5", 24)],
    "eth1": [("10.0.1.5", 24)],
    "ib0": [("10.1.0.5", 16)],
    "ib1": [("10.2.0.5", 16)],
}


def addresses(name: str) -> list[tuple[str, int]]:
    return ADDRESSES.get(name, [])


class FakeHost:
    """A sysfs tree like the kernel's: devices under sys/devices, links from bus/ and class/."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "sys" / "bus" / "pci" / "devices").mkdir(parents=True)
        (root / "sys" / "class" / "net").mkdir(parents=True)

    def pci(self, path: str, numa: int | None = None) -> Path:
        """A PCI device at 'pci0000:00/0000:00:01.0/...', linked from sys/bus/pci/devices."""
        device = self.root / "sys" / "devices" / path
        device.mkdir(parents=True, exist_ok=True)
        (device / "numa_node").write_text(f"{-1 if numa is None else numa}\n")
        link = self.root / "sys" / "bus" / "pci" / "devices" / device.name
        if not link.exists():
            link.symlink_to(device)
        return device

    def nvidia(self, path: str, numa: int | None = None) -> None:
        device = self.pci(path, numa)
        (self.root / affinity.NVIDIA_GPUS / device.name).mkdir(parents=True)

    def amd(self, node: int, path: str | None, numa: int | None = None, simd: int = 304) -> None:
        (self.root / "dev").mkdir(exist_ok=True)
        (self.root / "dev" / "kfd").write_text("")
        props = [f"simd_count {simd}", "cpu_cores_count 0"]
        if path is not None:
            device = self.pci(path, numa)
            domain, bus, slot = device.name.split(":")
            dev, fn = slot.split(".")
            props += [
                f"domain {int(domain, 16)}",
                f"location_id {int(bus, 16) << 8 | int(dev, 16) << 3 | int(fn)}",
            ]
        folder = self.root / affinity.KFD_NODES / str(node)
        folder.mkdir(parents=True)
        (folder / "properties").write_text("\n".join(props) + "\n")

    def nic(
        self, name: str, path: str | None, numa: int | None = None, *, ib: str = "", up: bool = True
    ) -> None:
        if path is None:  # a virtual interface
            real = self.root / "sys" / "devices" / "virtual" / "net" / name
            real.mkdir(parents=True)
        else:
            device = self.pci(path, numa)
            real = device / "net" / name
            real.mkdir(parents=True)
            (real / "device").symlink_to(device)
            (real / "dev_port").write_text("0\n")
            if ib:
                (device / "infiniband" / ib).mkdir(parents=True)
        (real / "operstate").write_text("up\n" if up else "down\n")
        (real / "flags").write_text("0x1003\n")
        (real / "type").write_text("1\n")
        (self.root / "sys" / "class" / "net" / name).symlink_to(real)

    def numa(self, node: int, cpulist: str) -> None:
        folder = self.root / affinity.NUMA_NODES / f"node{node}"
        folder.mkdir(parents=True)
        (folder / "cpulist").write_text(cpulist + "\n")


@pytest.fixture
def dgx(tmp_path: Path) -> FakeHost:
    """4 NVIDIA GPUs on 2 NUMA nodes; GPUs 0 and 2 share a PCIe switch with an RDMA NIC."""
    h = FakeHost(tmp_path)
    sw0 = "pci0000:00/0000:00:01.0/0000:01:00.0"
    sw1 = "pci0000:80/0000:80:01.0/0000:81:00.0"
    h.nvidia(f"{sw0}/0000:02:00.0/0000:1b:00.0", numa=0)
    h.nvidia("pci0000:00/0000:00:02.0/0000:3b:00.0", numa=0)
    h.nvidia(f"{sw1}/0000:82:00.0/0000:9b:00.0", numa=1)
    h.nvidia("pci0000:80/0000:80:02.0/0000:bb:00.0", numa=1)
    h.nic("ib0", f"{sw0}/0000:02:01.0/0000:1c:00.0", numa=0, ib="mlx5_0")
    h.nic("ib1", f"{sw1}/0000:82:01.0/0000:9c:00.0", numa=1, ib="mlx5_1")
    h.nic("eth0", "pci0000:00/0000:00:03.0/0000:05:00.0", numa=0)
    h.nic("eth9", "pci0000:00/0000:00:04.0/0000:06:00.0", numa=0, up=False)
    h.nic("lo", None)
    h.nic("docker0", None)
    h.numa(0, "0-15,32-47")
    h.numa(1, "16-31,48-63")
    return h


@pytest.fixture
def mi300(tmp_path: Path) -> FakeHost:
    """2 AMD GPUs (KFD nodes 1 and 2 after CPU node 0), each on its own NUMA node and NIC."""
    h = FakeHost(tmp_path)
    h.amd(0, None, simd=0)
    h.amd(1, "pci0000:00/0000:00:01.0/0000:c1:00.0", numa=0)
    h.amd(2, "pci0000:40/0000:40:01.0/0000:e1:00.0", numa=1)
    h.nic("eth0", "pci0000:00/0000:00:05.0/0000:05:00.0", numa=0)
    h.nic("eth1", "pci0000:40/0000:40:05.0/0000:45:00.0", numa=1)
    h.numa(0, "0-7")
    h.numa(1, "8-15")
    return h


def ompi(rank: int, local: int | None = None, **extra: str) -> dict[str, str]:
    env = {
        "OMPI_COMM_WORLD_RANK": str(rank),
        "OMPI_COMM_WORLD_LOCAL_RANK": str(rank if local is None else local),
    }
    env.update(extra)
    return env


def env_of(host: FakeHost, plan: LaunchPlan, environ: dict[str, str]) -> RankEnvironment:
    return rank_environment(plan, environ, root=host.root, addresses=addresses)


# ---- sysfs reading ------------------------------------------------------------------------------


def test_nvidia_gpus_in_pci_order(dgx: FakeHost) -> None:
    vendor, gpus = affinity.gpus(dgx.root)
    assert vendor == "nvidia"
    assert [(g.index, g.pci) for g in gpus] == [
        (0, "0000:1b:00.0"),
        (1, "0000:3b:00.0"),
        (2, "0000:9b:00.0"),
        (3, "0000:bb:00.0"),
    ]
    assert affinity.numa_node(dgx.root, "0000:9b:00.0") == 1
    assert affinity.pci_path(dgx.root, "0000:3b:00.0") == (
        "pci0000:00",
        "0000:00:02.0",
        "0000:3b:00.0",
    )


def test_amd_gpus_from_kfd_nodes(mi300: FakeHost) -> None:
    vendor, gpus = affinity.gpus(mi300.root)
    assert vendor == "amd"
    assert [(g.index, g.pci) for g in gpus] == [(0, "0000:c1:00.0"), (1, "0000:e1:00.0")]


def test_no_gpu_and_device_nodes_only(tmp_path: Path) -> None:
    assert affinity.gpus(tmp_path) == ("cpu", [])
    (tmp_path / "dev").mkdir()
    for i in (0, 1):
        (tmp_path / "dev" / f"nvidia{i}").write_text("")
    (tmp_path / "dev" / "nvidiactl").write_text("")
    vendor, gpus = affinity.gpus(tmp_path)
    assert vendor == "nvidia" and [(g.index, g.pci) for g in gpus] == [(0, None), (1, None)]


def test_net_devices_skip_virtual_and_down(dgx: FakeHost) -> None:
    nics = {n.name: n for n in affinity.net_devices(dgx.root)}
    assert sorted(nics) == ["eth0", "ib0", "ib1"]
    assert nics["ib0"].ucx_name == "mlx5_0:1" and nics["eth0"].ucx_name == "eth0"
    assert nics["ib1"].numa == 1


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("0-3,8,10-11", {0, 1, 2, 3, 8, 10, 11}), ("5", {5}), ("", set()), ("0-1,", {0, 1})],
)
def test_parse_cpulist(text: str, cpus: set[int]) -> None:
    assert affinity.parse_cpulist(text) == cpus


@pytest.mark.parametrize(
    ("gpu", "nics", "why"),
    [
        (0, ["ib0"], "same PCIe switch"),
        (1, ["eth0", "ib0"], "NUMA node 0"),
        (2, ["ib1"], "same PCIe switch"),
        (3, ["ib1"], "NUMA node 1"),
    ],
)
def test_nearest_nics(dgx: FakeHost, gpu: int, nics: list[str], why: str) -> None:
    devices = affinity.gpus(dgx.root)[1]
    near, reason = affinity.nearest_nics(dgx.root, devices[gpu], affinity.net_devices(dgx.root))
    assert [n.name for n in near] == nics
    assert why in reason


def test_nearest_nics_when_sysfs_cannot_tell(tmp_path: Path) -> None:
    h = FakeHost(tmp_path)
    h.nvidia("pci0000:00/0000:00:01.0/0000:01:00.0")  # numa_node -1, as in most VMs
    h.nic("eth0", "pci0000:00/0000:00:03.0/0000:03:00.0")
    gpu = affinity.gpus(tmp_path)[1][0]
    near, reason = affinity.nearest_nics(tmp_path, gpu, affinity.net_devices(tmp_path))
    assert near == [] and "no NUMA node" in reason
    h.numa(0, "0-3")
    (tmp_path / "sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/numa_node").write_text("0\n")
    (tmp_path / "sys/devices/pci0000:00/0000:00:03.0/0000:03:00.0/numa_node").write_text("0\n")
    near, reason = affinity.nearest_nics(tmp_path, gpu, affinity.net_devices(tmp_path))
    assert near == [] and "every NIC" in reason  # one NIC, as near as any: nothing to narrow


# ---- the plan -----------------------------------------------------------------------------------


def test_plan_json_round_trip() -> None:
    plan = LaunchPlan("openmpi5", 4, ("nvidia", "amd"), 2, "eth0/eth1", "numa", True)
    text = plan.to_json()
    assert LaunchPlan.from_json(text) == plan
    assert not PLAN_VARIABLE.startswith("HETCOMM_")  # config.py rejects unknown HETCOMM_* names
    assert json.loads(text)["vendors"] == ["nvidia", "amd"]


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("not json", "not JSON"),
        ("[1]", "JSON object"),
        ('{"flavour":"openmpi5","size":2,"x":1}', "unknown field"),
        ('{"flavour":"lam","size":2}', "flavour"),
        ('{"flavour":"mpich","size":0}', "size"),
        ('{"flavour":"mpich","size":2,"vendors":["intel"]}', "vendors"),
        ('{"flavour":"mpich","size":2,"hosts":3}', "hosts"),
        ('{"flavour":"mpich","size":2,"rails":"a,,b"}', "rails"),
        ('{"flavour":"mpich","size":2,"bind":"socket"}', "bind"),
    ],
)
def test_bad_plans(text: str, match: str) -> None:
    with pytest.raises(PlanError, match=match):
        LaunchPlan.from_json(text)


@pytest.mark.parametrize(
    ("flavour", "environ", "expected"),
    [
        ("openmpi5", ompi(3, 1), (3, 1)),
        ("openmpi4", {"PMIX_RANK": "2"}, (2, 2)),
        ("mpich", {"PMI_RANK": "5", "MPI_LOCALRANKID": "1"}, (5, 1)),
        ("intel", {"PMI_RANK": "5", "MPI_LOCALRANKID": "1"}, (5, 1)),
        ("slurm", {"SLURM_PROCID": "7", "SLURM_LOCALID": "3"}, (7, 3)),
        # mpirun inside a Slurm batch job: the ranks inherit the batch step's SLURM_PROCID=0
        ("openmpi5", {**ompi(6, 2), "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}, (6, 2)),
        ("slurm", {"PMIX_RANK": "4"}, (4, 4)),
    ],
)
def test_rank_ids(flavour: str, environ: dict[str, str], expected: tuple[int, int]) -> None:
    assert rank_ids(FLAVOURS[flavour], environ)[:2] == expected


def test_rank_ids_outside_a_launcher() -> None:
    with pytest.raises(PlanError, match="not started by an MPI launcher"):
        rank_ids(FLAVOURS["openmpi5"], {})


# ---- each rank's environment --------------------------------------------------------------------


def test_simulation_cycles_vendors_and_blocks_hosts(tmp_path: Path) -> None:
    plan = LaunchPlan("openmpi5", 6, ("nvidia", "amd", "cpu"), 3)
    got = [env_of(FakeHost(tmp_path / str(r)), plan, ompi(r)).variables for r in range(6)]
    assert [g["HETCOMM_VENDOR"] for g in got] == ["nvidia", "amd", "cpu"] * 2
    assert [g["HETCOMM_HOST"] for g in got] == ["sim0", "sim0", "sim1", "sim1", "sim2", "sim2"]
    assert all(set(g) == {"HETCOMM_VENDOR", "HETCOMM_HOST"} for g in got)  # CPU host: no binding


def test_uneven_host_blocks(tmp_path: Path) -> None:
    plan = LaunchPlan("openmpi5", 5, hosts=2)
    hosts = [
        env_of(FakeHost(tmp_path / str(r)), plan, ompi(r)).variables["HETCOMM_HOST"]
        for r in range(5)
    ]
    assert hosts == ["sim0", "sim0", "sim0", "sim1", "sim1"]


@pytest.mark.parametrize(
    ("local", "device", "rails", "ucx", "cpus"),
    [
        (0, "0", "ib0", "mlx5_0:1", (0, 15, 32)),
        (1, "1", "eth0,ib0", "eth0,mlx5_0:1", (0, 15, 32)),
        (2, "2", "ib1", "mlx5_1:1", (16, 31, 48)),
        (3, "3", "ib1", "mlx5_1:1", (16, 31, 48)),
        (5, "1", "eth0,ib0", "eth0,mlx5_0:1", (0, 15, 32)),
    ],  # 5 ranks on 4 GPUs: shared
)
def test_nvidia_binding(
    dgx: FakeHost, local: int, device: str, rails: str, ucx: str, cpus: tuple[int, ...]
) -> None:
    plan = LaunchPlan("openmpi5", 8, bind="numa")
    mine = env_of(dgx, plan, ompi(local))
    assert mine.variables == {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": device,
        "HETCOMM_RAILS": rails,
        "UCX_NET_DEVICES": ucx,
    }
    assert mine.cpus is not None and len(mine.cpus) == 32
    assert (mine.cpus[0], mine.cpus[15], mine.cpus[16]) == cpus


def test_amd_binding(mi300: FakeHost) -> None:
    plan = LaunchPlan("mpich", 2, bind="numa", ucx=False)
    mine = env_of(mi300, plan, {"PMI_RANK": "1", "MPI_LOCALRANKID": "1"})
    assert mine.variables == {"ROCR_VISIBLE_DEVICES": "1", "HETCOMM_RAILS": "eth1"}
    assert mine.cpus == tuple(range(8, 16))
    # a scheduler's HIP_VISIBLE_DEVICES is honoured and narrowed, not replaced
    mine = env_of(
        mi300, plan, {"PMI_RANK": "0", "MPI_LOCALRANKID": "0", "HIP_VISIBLE_DEVICES": "1"}
    )
    assert (
        mine.variables["HIP_VISIBLE_DEVICES"] == "1"
        and "ROCR_VISIBLE_DEVICES" not in mine.variables
    )
    assert mine.variables["HETCOMM_RAILS"] == "eth1"
    # HIP numbers what ROCR_VISIBLE_DEVICES left: HIP 0 of ROCR "1" is the second GPU
    both = {"ROCR_VISIBLE_DEVICES": "1", "HIP_VISIBLE_DEVICES": "0"}
    mine = env_of(mi300, plan, {"PMI_RANK": "0", "MPI_LOCALRANKID": "0", **both})
    assert mine.variables["HIP_VISIBLE_DEVICES"] == "0" and mine.cpus == tuple(range(8, 16))


def test_scheduler_visible_devices_are_narrowed(dgx: FakeHost) -> None:
    plan = LaunchPlan("slurm", 2)
    slurm = {"SLURM_PROCID": "1", "SLURM_LOCALID": "1", "CUDA_VISIBLE_DEVICES": "2,3"}
    mine = env_of(dgx, plan, slurm)
    assert mine.variables["CUDA_VISIBLE_DEVICES"] == "3"
    assert mine.variables["HETCOMM_RAILS"] == "ib1"  # GPU 3 sits on NUMA node 1
    uuids = {**slurm, "CUDA_VISIBLE_DEVICES": "GPU-aaa,GPU-bbb"}
    mine = env_of(dgx, plan, uuids)
    assert mine.variables["CUDA_VISIBLE_DEVICES"] == "GPU-bbb"
    assert "HETCOMM_RAILS" not in mine.variables  # which GPU that is, sysfs cannot say


def test_cpu_rank_on_a_gpu_host_sees_no_gpu(dgx: FakeHost) -> None:
    plan = LaunchPlan("openmpi5", 2, ("nvidia", "cpu"), bind="numa")
    mine = env_of(dgx, plan, ompi(1))
    assert mine.variables["CUDA_VISIBLE_DEVICES"] == "-1"
    assert "HETCOMM_RAILS" not in mine.variables and mine.cpus is None
    # an amd rank simulated on NVIDIA hardware still gets its NVIDIA GPU
    mine = env_of(dgx, LaunchPlan("openmpi5", 2, ("amd",)), ompi(1))
    assert (
        mine.variables["HETCOMM_VENDOR"] == "amd" and mine.variables["CUDA_VISIBLE_DEVICES"] == "1"
    )


def test_explicit_rails_by_local_rank(dgx: FakeHost) -> None:
    plan = LaunchPlan("openmpi5", 4, rails="ib0,eth0/ib1")
    got = [env_of(dgx, plan, ompi(r)).variables for r in range(3)]
    assert [g["HETCOMM_RAILS"] for g in got] == ["ib0,eth0", "ib1", "ib0,eth0"]
    assert [g["UCX_NET_DEVICES"] for g in got] == ["mlx5_0:1,eth0", "mlx5_1:1", "mlx5_0:1,eth0"]
    plan = LaunchPlan("openmpi5", 1, rails="10.0.0.5")  # addresses pass through, UCX untouched
    assert "UCX_NET_DEVICES" not in env_of(dgx, plan, ompi(0)).variables


def test_caller_settings_stand(dgx: FakeHost) -> None:
    plan = LaunchPlan("openmpi5", 1)
    mine = env_of(
        dgx,
        plan,
        ompi(0, HETCOMM_RAILS="eth0", UCX_NET_DEVICES="mlx5_9:1", CUDA_DEVICE_ORDER="PCI_BUS_ID"),
    )
    assert mine.variables == {"CUDA_VISIBLE_DEVICES": "0"}


def test_numa_binding_respects_allowed_cpus(dgx: FakeHost) -> None:
    plan = LaunchPlan("openmpi5", 1, bind="numa")
    mine = rank_environment(plan, ompi(0), root=dgx.root, allowed_cpus={1, 2, 20})
    assert mine.cpus == (1, 2)
    mine = rank_environment(plan, ompi(0), root=dgx.root, allowed_cpus={20})
    assert mine.cpus is None and "not allowed" in mine.notes[-1]
    assert env_of(dgx, LaunchPlan("openmpi5", 1, bind="core"), ompi(0)).cpus is None


# ---- dry run over a fake GPU host ---------------------------------------------------------------


def test_dry_run_shows_each_ranks_binding(dgx: FakeHost) -> None:
    request = LaunchRequest(
        command=("python", "train.py"), n=4, vendors=("nvidia", "amd"), simulate_hosts=2
    )
    launch = build(
        request,
        FLAVOURS["openmpi5"],
        "/opt/ompi/bin/mpirun",
        environ={},
        is_root=False,
        python="/venv/bin/python",
        root=dgx.root,
    )
    assert launch.plan.bind == "numa"  # GPUs here: pin by NUMA node, the launcher binds nothing
    assert "--bind-to" in launch.argv and launch.argv[launch.argv.index("--bind-to") + 1] == "none"
    out = io.StringIO()
    describe(launch, {}, "Open MPI 5.0.11", out, root=dgx.root, addresses=addresses)
    lines = out.getvalue().splitlines()
    ranks = [line for line in lines if line.startswith("rank ")]
    assert ranks == [
        "rank 0 (localhost, local rank 0): HETCOMM_VENDOR=nvidia HETCOMM_HOST=sim0 "
        "CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=0 HETCOMM_RAILS=ib0 "
        "UCX_NET_DEVICES=mlx5_0:1 cpus=0-15,32-47",
        "rank 1 (localhost, local rank 1): HETCOMM_VENDOR=amd HETCOMM_HOST=sim0 "
        "CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=1 HETCOMM_RAILS=eth0,ib0 "
        "UCX_NET_DEVICES=eth0,mlx5_0:1 cpus=0-15,32-47",
        "rank 2 (localhost, local rank 2): HETCOMM_VENDOR=nvidia HETCOMM_HOST=sim1 "
        "CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=2 HETCOMM_RAILS=ib1 "
        "UCX_NET_DEVICES=mlx5_1:1 cpus=16-31,48-63",
        "rank 3 (localhost, local rank 3): HETCOMM_VENDOR=amd HETCOMM_HOST=sim1 "
        "CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=3 HETCOMM_RAILS=ib1 "
        "UCX_NET_DEVICES=mlx5_1:1 cpus=16-31,48-63",
    ]
    assert any("same PCIe switch" in line for line in lines)
    assert os.path.basename(launch.argv[0]) == "mpirun"


def test_rank_ids_must_be_numbers() -> None:
    with pytest.raises(PlanError, match="OMPI_COMM_WORLD_LOCAL_RANK: expected a rank number"):
        rank_ids(FLAVOURS["openmpi5"], ompi(1, OMPI_COMM_WORLD_LOCAL_RANK="x"))
