"""The demo job: a small model trained pipeline-parallel across a vendor boundary (pp=2, dp=2).

Stage 0 (world ranks 0-1) holds the first layer, stage 1 (ranks 2-3) the second and the loss;
activations go forward and their gradients back over the pp groups, and each stage averages its
gradients over its dp group. Run under mpirun with 4 ranks (scripts/demo does). The losses and
final weights are checked against the same model trained in one process on the whole batch.
`--steps N` trains N steps instead of 25 (scripts/soak uses it for longer runs).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

try:
    import torch
except ImportError:  # no torch in this venv (README, "Which torch"): main() runs the numpy job
    torch = None  # type: ignore[assignment]

import hetcomm
from hetcomm.cli import group_plans
from hetcomm.topology import use_local_device

STEPS, BATCH, D_IN, D_HIDDEN, D_OUT, LR = 25, 64, 16, 64, 4, 0.05


def steps_from_argv(argv: list[str]) -> int:
    """N of `--steps N` (default STEPS)."""
    if not argv:
        return STEPS
    if len(argv) != 2 or argv[0] != "--steps" or not argv[1].isdigit() or int(argv[1]) < 1:
        raise SystemExit(f"usage: pp_train.py [--steps N] (N >= 1), got {' '.join(argv)}")
    return int(argv[1])


def make_model_and_data(
    steps: int = STEPS,
) -> tuple[torch.nn.Module, torch.nn.Module, torch.Tensor, torch.Tensor]:
    """The same initial weights and data on every rank (fixed seed)."""
    gen = torch.Generator().manual_seed(1234)
    first = torch.nn.Sequential(torch.nn.Linear(D_IN, D_HIDDEN), torch.nn.Tanh())
    second = torch.nn.Linear(D_HIDDEN, D_OUT)
    with torch.no_grad():
        for p in [*first.parameters(), *second.parameters()]:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    x = torch.randn(steps, BATCH, D_IN, generator=gen)
    w_true = torch.randn(D_IN, D_OUT, generator=gen)
    y = torch.sin(x @ w_true)
    return first, second, x, y


def reference(steps: int = STEPS) -> tuple[list[float], list[torch.Tensor]]:
    """The same training in one process, on the whole batch: losses and final parameters."""
    first, second, x, y = make_model_and_data(steps)
    params = [*first.parameters(), *second.parameters()]
    losses = []
    for step in range(steps):
        loss = torch.nn.functional.mse_loss(second(first(x[step])), y[step])
        for p in params:
            p.grad = None
        loss.backward()
        with torch.no_grad():
            for p in params:
                p -= LR * p.grad
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in params]


def main() -> int:
    steps = steps_from_argv(sys.argv[1:])
    if torch is None:
        return numpy_job()
    use_local_device()  # on a machine with several GPUs, rank r takes device r % devices
    world = hetcomm.init()
    if world.size != 4:
        raise SystemExit(f"this demo runs on 4 ranks (pp=2 x dp=2), got {world.size}")
    groups = hetcomm.ParallelGroups(world, pp=2, dp=2)
    stage, dp_rank = groups.coords["pp"], groups.coords["dp"]
    report = group_plans(world, groups)
    device = pick_device(groups)
    if world.rank == 0:
        print("topology:\n" + world.topology.table() + "\n")
        print(report, "\n", flush=True)
        print(
            f"training on {device}: {steps} steps, batch {BATCH} split over dp=2, "
            f"stage 0 on ranks 0-1, stage 1 on ranks 2-3\n",
            flush=True,
        )

    first, second, x, y = make_model_and_data(steps)
    model = (first if stage == 0 else second).to(device)
    params = list(model.parameters())
    half = BATCH // 2
    rows = slice(dp_rank * half, (dp_rank + 1) * half)
    hidden = torch.empty(half, D_HIDDEN, device=device)
    losses = []
    for step in range(steps):
        for p in params:
            p.grad = None
        if stage == 0:
            h = model(x[step, rows].to(device))
            groups.pp.send(h.detach().contiguous(), dst=1)
            grad_h = torch.empty_like(h)
            groups.pp.recv(grad_h, src=1)
            h.backward(grad_h)
        else:
            groups.pp.recv(hidden, src=0)
            h = hidden.clone().requires_grad_(True)
            loss = torch.nn.functional.mse_loss(model(h), y[step, rows].to(device))
            loss.backward()
            groups.pp.send(h.grad.contiguous(), dst=0)
            mean_loss = loss.detach().reshape(1)
            groups.dp.all_reduce(mean_loss, hetcomm.ReduceOp.AVG)
            losses.append(mean_loss.item())
        for p in params:
            groups.dp.all_reduce(p.grad, hetcomm.ReduceOp.AVG)
        with torch.no_grad():
            for p in params:
                p -= LR * p.grad

    ok = check(world, groups, stage, params, losses, steps)
    groups.close()
    world.close()
    return 0 if ok else 1


def numpy_job() -> int:
    """The same model and schedule with numpy arrays (scripts/pp_train_numpy.py)."""
    path = Path(__file__).with_name("pp_train_numpy.py")
    spec = importlib.util.spec_from_file_location("pp_train_numpy", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return int(module.main())


def pick_device(groups: hetcomm.ParallelGroups) -> str:
    """cuda when a GPU is there and every group's plan can move device buffers; else cpu."""
    usable = torch.cuda.is_available()
    if usable:
        for _, comm in groups.items():
            for op in ("send", "all_reduce"):
                if comm.plan.lookup(op, "device", "large")[0] == "none":
                    usable = False
    usable = all(groups.world.mpi.allgather(usable))
    if torch.cuda.is_available() and not usable and groups.world.rank == 0:
        print(
            "GPU present, but this hetcomm has no transport for device buffers across these "
            "groups (see the plans above): training on the CPU\n",
            flush=True,
        )
    return "cuda" if usable else "cpu"


def check(
    world: hetcomm.Communicator,
    groups: hetcomm.ParallelGroups,
    stage: int,
    params: list[torch.Tensor],
    losses: list[float],
    steps: int,
) -> bool:
    """Compare losses and parameters with the one-process run; report on rank 0."""
    ref_losses, ref_params = reference(steps)
    mine = ref_params[:2] if stage == 0 else ref_params[2:]
    worst = max(
        float((p.detach().cpu() - r).abs().max() / (r.abs().max() + 1e-12))
        for p, r in zip(params, mine)
    )
    params_ok = all(
        torch.allclose(p.detach().cpu(), r, rtol=1e-5, atol=1e-6) for p, r in zip(params, mine)
    )
    verdicts = world.mpi.gather((stage, params_ok, worst, losses), root=0)
    if world.rank != 0:
        return all(world.mpi.allgather(params_ok))
    got = next(v[3] for v in verdicts if v[0] == 1)
    print(f"{'step':>4}  {'hetcomm pp=2 dp=2':>18}  {'one process':>12}  {'rel. diff':>9}")
    loss_ok = True
    for i, (a, b) in enumerate(zip(got, ref_losses)):
        rel = abs(a - b) / max(abs(b), 1e-12)
        loss_ok &= rel <= 1e-5
        print(f"{i:4d}  {a:18.8f}  {b:12.8f}  {rel:9.1e}")
    worst_all = max(v[2] for v in verdicts)
    all_params = all(v[1] for v in verdicts)
    print(f"\nlosses match the one-process run to float32 rounding: {'yes' if loss_ok else 'NO'}")
    print(
        f"final weights match (largest relative difference {worst_all:.1e}): "
        f"{'yes' if all_params else 'NO'}"
    )
    sys.stdout.flush()
    ok = loss_ok and all(world.mpi.allgather(all_params))
    return ok


if __name__ == "__main__":
    raise SystemExit(main())
