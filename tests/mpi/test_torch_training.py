"""torch.distributed backend "hetcomm" under mpirun: training with DDP (comm hooks included) and
FSDP2 reaches gloo's parameters, and both reach a float64 reference computed on one rank.

Inputs come from the shared seed, so every rank draws every rank's batches. Findings are
collected in `errors` and checked together (`errors.verify()`), so that a mismatch on one rank
cannot leave the others waiting.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hetcomm.torch as ht

pytestmark = pytest.mark.mpi(min_size=2)

STEPS, BATCH, LR = 4, 8, 0.05


@pytest.fixture(scope="class")
def gloo(pg) -> dist.ProcessGroup:
    """A gloo group beside the hetcomm default group (rendezvous over hetcomm's MPI store)."""
    return dist.new_group(backend="gloo")


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(12, 24),
        torch.nn.Tanh(),
        torch.nn.Linear(24, 24),
        torch.nn.Tanh(),
        torch.nn.Linear(24, 3),
    )


def batches(seed: int, n: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """batches[step][rank] = (inputs, targets), the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    return [
        [
            (torch.randn(BATCH, 12, generator=g), torch.randn(BATCH, 3, generator=g))
            for _ in range(n)
        ]
        for _ in range(STEPS)
    ]


def train(model: torch.nn.Module, data, me: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for step in data:
        x, y = step[me]
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def reference_params(seed: int, data) -> list[torch.Tensor]:
    """What data-parallel training computes, on one process in float64: the gradient is the mean
    over ranks of each rank's gradient."""
    model = make_model(seed).double()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for step in data:
        loss = sum(torch.nn.functional.mse_loss(model(x.double()), y.double()) for x, y in step)
        (loss / len(step)).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in model.parameters()]


def close(
    got: list[torch.Tensor], want: list[torch.Tensor], what: str, rtol: float, atol: float
) -> list[str]:
    worst = max(float((g.double() - w.double()).abs().max()) for g, w in zip(got, want))
    ok = all(
        torch.allclose(g.double(), w.double(), rtol=rtol, atol=atol) for g, w in zip(got, want)
    )
    return [] if ok else [f"{what}: parameters differ by up to {worst:.3g}"]


@pytest.mark.usefixtures("pg")
class TestTraining:
    def test_ddp_matches_gloo_and_reference(self, hetcomm_shared_seed, errors, gloo) -> None:
        n, me = dist.get_world_size(), dist.get_rank()
        seed = hetcomm_shared_seed % 2**31
        data = batches(seed + 1, n)
        params = {}
        # tiny buckets: several all-reduces in flight per step, completed through futures
        for name, group in (("hetcomm", dist.group.WORLD), ("gloo", gloo)):
            model = DDP(make_model(seed), process_group=group, bucket_cap_mb=0.001)
            train(model, data, me)
            params[name] = [p.detach() for p in model.module.parameters()]
        errors += close(params["hetcomm"], params["gloo"], "DDP hetcomm vs gloo", 1e-5, 1e-6)
        errors += close(
            params["hetcomm"], reference_params(seed, data), "DDP vs float64", 1e-4, 1e-5
        )
        errors.verify()

    def test_ddp_comm_hooks(self, hetcomm_shared_seed, errors, gloo) -> None:
        """Python comm hooks chain on get_future(): allreduce, and fp16 compression (float16
        sums in hetcomm's own kernels)."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        n, me = dist.get_world_size(), dist.get_rank()
        seed = hetcomm_shared_seed % 2**31
        data = batches(seed + 2, n)
        for hook, rtol in (
            (default_hooks.allreduce_hook, 1e-5),
            (default_hooks.fp16_compress_hook, 1e-2),
        ):
            params = {}
            for name, group in (("hetcomm", dist.group.WORLD), ("gloo", gloo)):
                model = DDP(make_model(seed), process_group=group)
                model.register_comm_hook(group, hook)
                train(model, data, me)
                params[name] = [p.detach() for p in model.module.parameters()]
            errors += close(params["hetcomm"], params["gloo"], hook.__name__, rtol, rtol / 10)
        errors.verify()

    def test_fsdp2_matches_gloo_and_reference(self, hetcomm_shared_seed, errors, gloo) -> None:
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        n, me = dist.get_world_size(), dist.get_rank()
        seed = hetcomm_shared_seed % 2**31
        data = batches(seed + 3, n)
        meshes = {
            "hetcomm": init_device_mesh("cpu", (n,)),
            "gloo": DeviceMesh.from_group(gloo, "cpu"),
        }
        params = {}
        for name, mesh in meshes.items():
            model = make_model(seed)
            for layer in model:
                if isinstance(layer, torch.nn.Linear):
                    ht.fully_shard(layer, mesh=mesh)
            ht.fully_shard(model, mesh=mesh)
            train(model, data, me)
            params[name] = [p.full_tensor().detach() for p in model.parameters()]
        errors += close(params["hetcomm"], params["gloo"], "FSDP2 hetcomm vs gloo", 1e-5, 1e-6)
        errors += close(
            params["hetcomm"], reference_params(seed, data), "FSDP2 vs float64", 1e-4, 1e-5
        )
        errors.verify()

    def test_model_copies_stay_equal(self, errors) -> None:
        """DDP's init broadcast makes every rank's parameters rank 0's."""
        me = dist.get_rank()
        model = DDP(make_model(1000 + me))
        flat = torch.cat([p.detach().flatten() for p in model.module.parameters()])
        want = torch.cat([p.detach().flatten() for p in make_model(1000).parameters()])
        errors.expect(torch.equal(flat, want), "DDP broadcast rank 0's parameters")
        errors.verify()
