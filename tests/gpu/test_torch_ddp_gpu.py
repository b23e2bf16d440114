"""DDP on CUDA tensors over torch.distributed backend "hetcomm" (skipped without a GPU).

Runs alone (`pytest tests/gpu`, one rank) or under mpirun (ranks share the GPUs round-robin).
CUDA tensors go through the same Communicator as CPU ones; until hetcomm has a device transport
for this machine (or the MPI is GPU-aware) that Communicator refuses them with
TransportUnavailable, raised before anything moves: the training test then reports xfail with
hetcomm's reason, and checks that the refusal left the group usable.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import hetcomm.torch as ht  # noqa: E402
from hetcomm import TransportUnavailable  # noqa: E402

STEPS, BATCH, LR = 3, 8, 0.05


@pytest.fixture(scope="module")
def device() -> Iterator[torch.device]:
    """hetcomm as the default group, bound to this rank's GPU (init_process_group(device_id=))."""
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    dist.init_process_group("hetcomm", init_method="mpi://", device_id=dev)
    yield dev
    dist.destroy_process_group()


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 3))


def test_groups_on_a_bound_device(device: torch.device) -> None:
    """With a bound device torch makes sub-groups through split_group (DeviceMesh too)."""
    from torch.distributed.device_mesh import init_device_mesh

    n, me = dist.get_world_size(), dist.get_rank()
    assert dist.group.WORLD.bound_device_id == device
    split = getattr(dist, "split_group", None)
    if split is not None:
        sub = split(split_ranks=[list(range(n))])
        assert isinstance(sub, ht.ProcessGroupHetcomm) and sub.size() == n
    mesh = init_device_mesh("cuda", (n,))
    assert isinstance(mesh.get_group(), ht.ProcessGroupHetcomm)
    t = torch.tensor([float(me)])
    dist.all_reduce(t, group=mesh.get_group())  # CPU tensors always have a transport
    assert t.item() == n * (n - 1) / 2


def test_ddp_on_cuda_matches_a_cpu_reference(device: torch.device) -> None:
    n, me = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(7)
    data = [
        [
            (torch.randn(BATCH, 12, generator=g), torch.randn(BATCH, 3, generator=g))
            for _ in range(n)
        ]
        for _ in range(STEPS)
    ]
    try:
        model = torch.nn.parallel.DistributedDataParallel(
            make_model(1).to(device), device_ids=[device]
        )
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        for step in data:
            x, y = step[me]
            torch.nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize(device)
    except TransportUnavailable as exc:
        t = torch.ones(2)
        dist.all_reduce(t)  # the refusal moved nothing and broke nothing
        assert t.tolist() == [float(n)] * 2
        pytest.xfail(f"hetcomm has no transport for CUDA tensors here: {exc}")
    reference = make_model(1).double()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    for step in data:
        loss = sum(torch.nn.functional.mse_loss(reference(x.double()), y.double()) for x, y in step)
        (loss / n).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for got, want in zip(model.module.parameters(), reference.parameters()):
        torch.testing.assert_close(got.detach().cpu().double(), want.detach(), rtol=1e-4, atol=1e-5)
