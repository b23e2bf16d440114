"""The demo job without torch: scripts/pp_train.py's model and schedule with numpy arrays.

scripts/pp_train.py (the demo's and scripts/soak's job) runs this one where the venv has no
torch (README, "Which torch"). The model is
the same two stages (Linear + tanh on ranks 0-1, Linear + mean squared error on ranks 2-3), its
gradients written out by hand; activations and their gradients cross the pp groups, each stage
averages its gradients over its dp group, and the losses and final weights are checked against
the same training in one process, in float64, on the whole batch.
"""

from __future__ import annotations

import sys

import numpy as np

import hetcomm
from hetcomm.cli import group_plans

STEPS, BATCH, D_IN, D_HIDDEN, D_OUT, LR = 25, 64, 16, 64, 4, 0.05


def make_params_and_data(steps: int) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """[W1, b1, W2, b2] and the batches: the same on every rank (fixed seed), float64."""
    rng = np.random.default_rng(1234)
    shapes = [(D_IN, D_HIDDEN), (D_HIDDEN,), (D_HIDDEN, D_OUT), (D_OUT,)]
    params = [rng.standard_normal(s) * 0.3 for s in shapes]
    x = rng.standard_normal((steps, BATCH, D_IN))
    y = np.sin(x @ rng.standard_normal((D_IN, D_OUT)))
    return params, x, y


def stage0_forward(p: list[np.ndarray], x: np.ndarray) -> np.ndarray:
    return np.tanh(x @ p[0] + p[1])


def stage1_loss_and_grads(
    p: list[np.ndarray], h: np.ndarray, y: np.ndarray, rows: int
) -> tuple[float, list[np.ndarray], np.ndarray]:
    """Mean squared error over `rows` x D_OUT values, its gradients (W2, b2) and dL/dh."""
    err = h @ p[0] + p[1] - y
    g = 2.0 * err / (rows * D_OUT)
    return float((err**2).mean()), [h.T @ g, g.sum(axis=0)], g @ p[0].T


def stage0_grads(p: list[np.ndarray], x: np.ndarray, grad_h: np.ndarray) -> list[np.ndarray]:
    """Gradients (W1, b1) of stage 0, given dL/dh of its output."""
    h = stage0_forward(p, x)
    g = grad_h * (1.0 - h**2)
    return [x.T @ g, g.sum(axis=0)]


def reference(steps: int) -> tuple[list[float], list[np.ndarray]]:
    """The same training in one process on the whole batch: losses and final parameters."""
    params, x, y = make_params_and_data(steps)
    losses = []
    for step in range(steps):
        h = stage0_forward(params[:2], x[step])
        loss, g1, grad_h = stage1_loss_and_grads(params[2:], h, y[step], BATCH)
        g0 = stage0_grads(params[:2], x[step], grad_h)
        for p, g in zip(params, [*g0, *g1]):
            p -= LR * g
        losses.append(loss)
    return losses, params


def main() -> int:
    steps = STEPS if len(sys.argv) < 3 else int(sys.argv[2])  # pp_train.py checked `--steps N`
    world = hetcomm.init()
    if world.size != 4:
        raise SystemExit(f"this demo runs on 4 ranks (pp=2 x dp=2), got {world.size}")
    groups = hetcomm.ParallelGroups(world, pp=2, dp=2)
    stage, dp_rank = groups.coords["pp"], groups.coords["dp"]
    report = group_plans(world, groups)
    if world.rank == 0:
        print("topology:\n" + world.topology.table() + "\n")
        print(report, "\n", flush=True)
        print(f"training with numpy (no torch here): {steps} steps, batch {BATCH} over dp=2\n")
    params, x, y = make_params_and_data(steps)
    mine = params[:2] if stage == 0 else params[2:]
    half = BATCH // 2
    rows = slice(dp_rank * half, (dp_rank + 1) * half)
    losses = []
    for step in range(steps):
        if stage == 0:
            h = stage0_forward(mine, x[step, rows])
            groups.pp.send(h, dst=1)
            grad_h = np.empty_like(h)
            groups.pp.recv(grad_h, src=1)
            grads = stage0_grads(mine, x[step, rows], grad_h)
        else:
            h = np.empty((half, D_HIDDEN))
            groups.pp.recv(h, src=0)
            loss, grads, grad_h = stage1_loss_and_grads(mine, h, y[step, rows], half)
            groups.pp.send(grad_h, dst=0)
            mean = np.array([loss])
            groups.dp.all_reduce(mean, hetcomm.ReduceOp.AVG)
            losses.append(float(mean[0]))
        for p, g in zip(mine, grads):
            groups.dp.all_reduce(g, hetcomm.ReduceOp.AVG)
            p -= LR * g
    ok = check(world, stage, mine, losses, steps)
    groups.close()
    world.close()
    return 0 if ok else 1


def check(
    world: hetcomm.Communicator,
    stage: int,
    mine: list[np.ndarray],
    losses: list[float],
    steps: int,
) -> bool:
    """Compare losses and parameters with the one-process run; report on rank 0."""
    ref_losses, ref_params = reference(steps)
    ref = ref_params[:2] if stage == 0 else ref_params[2:]
    worst = max(float(np.abs(p - r).max() / (np.abs(r).max() + 1e-300)) for p, r in zip(mine, ref))
    params_ok = all(np.allclose(p, r, rtol=1e-9, atol=1e-12) for p, r in zip(mine, ref))
    verdicts = world.mpi.gather((stage, params_ok, worst, losses), root=0)
    if world.rank != 0:
        return all(world.mpi.allgather(params_ok))
    got = next(v[3] for v in verdicts if v[0] == 1)
    print(f"{'step':>4}  {'hetcomm pp=2 dp=2':>18}  {'one process':>12}  {'rel. diff':>9}")
    loss_ok = True
    for i, (a, b) in enumerate(zip(got, ref_losses)):
        rel = abs(a - b) / max(abs(b), 1e-300)
        loss_ok &= rel < 1e-9
        if i < 3 or i >= steps - 2:
            print(f"{i:>4}  {a:>18.6f}  {b:>12.6f}  {rel:>9.1e}")
    all_ok = loss_ok and all(v[1] for v in verdicts)
    # worded as pp_train.py does (scripts/soak reads it); float64 here, so within 1e-9
    print(
        "\nlosses match the one-process run to float32 rounding: "
        f"{'yes (float64: within 1e-9)' if loss_ok else 'NO'}"
    )
    print(
        f"final weights match (largest relative difference {max(v[2] for v in verdicts):.1e}): "
        f"{'yes' if all_ok else 'NO'}",
        flush=True,
    )
    return bool(all(world.mpi.allgather(all_ok)))


if __name__ == "__main__":
    raise SystemExit(main())
