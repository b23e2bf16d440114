"""The DDP study (`hetcomm bench --study ddp`): a DDP training step on torch.distributed backend
"hetcomm" against gloo, CPU, in one run.

Both backends train the same ~10M-parameter MLP: the default process group is hetcomm's, a
second group made with `dist.new_group(backend="gloo")` is gloo's (its rendezvous runs over
hetcomm's MPI store). A third way, "none", is the same step without communication (DDP's
no_sync()), so each backend's cost over the computation shows; beside the steps, a bare
all_reduce of the model's gradient size per backend. Interleaved rounds (timing.py), a
sample being `--steps` steps; rows: median per step, spread and the ratio to gloo.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from typing import Any

from .timing import Interleaved, Run, paired_ratio, share_cores


def add_arguments(group: Any) -> None:
    """The options of the DDP study."""
    group.add_argument("--steps", type=int, default=5, help="--study ddp: steps per sample (5)")
    group.add_argument("--batch", type=int, default=32, help="--study ddp: batch size (32)")
    group.add_argument(
        "--width", type=int, default=1024, help="--study ddp: MLP width (1024: ~9.4M parameters)"
    )


def make_model(width: int) -> Any:
    """The benchmarked MLP, the same weights on every rank."""
    import torch

    torch.manual_seed(1234)
    return torch.nn.Sequential(
        torch.nn.Linear(width, 2 * width),
        torch.nn.ReLU(),
        torch.nn.Linear(2 * width, 2 * width),
        torch.nn.ReLU(),
        torch.nn.Linear(2 * width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, width),
    )


def run(args: argparse.Namespace) -> int:
    """`hetcomm bench --study ddp [--rounds N] [--steps N] [--batch N] [--width N]`."""
    import torch
    import torch.distributed as dist
    from mpi4py import MPI
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hetcomm.torch  # noqa: F401  (registers the backend)

    dist.init_process_group("hetcomm")
    rank, size = dist.get_rank(), dist.get_world_size()
    ctl = MPI.COMM_WORLD.Dup()
    share_cores(torch, ctl)
    groups = {"hetcomm": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    models = {name: DDP(make_model(args.width), process_group=g) for name, g in groups.items()}
    opts = {name: torch.optim.SGD(m.parameters(), lr=1e-3) for name, m in models.items()}
    params = sum(p.numel() for p in models["hetcomm"].parameters())
    torch.manual_seed(rank)
    x = torch.randn(args.batch, args.width)
    grads = torch.randn(params)

    def steps(name: str) -> Run:
        model = models["hetcomm" if name == "none" else name]
        opt = opts["hetcomm" if name == "none" else name]

        def run_steps(calls: int) -> None:
            for _ in range(calls * args.steps):
                quiet = model.no_sync() if name == "none" else contextlib.nullcontext()
                with quiet:
                    model(x).square().mean().backward()
                if name != "none":
                    opt.step()
                opt.zero_grad(set_to_none=False)

        return run_steps

    def all_reduce(name: str) -> Run:
        def run_all_reduce(calls: int) -> None:
            for _ in range(calls):
                dist.all_reduce(grads, group=groups[name])

        return run_all_reduce

    timing = Interleaved(ctl, args.rounds)
    step_stats = timing.measure({n: steps(n) for n in ("hetcomm", "gloo", "none")}, 1, warmup=2)
    reduce_stats = timing.measure({n: all_reduce(n) for n in groups}, 1, warmup=2)
    diff = max(
        float((a.detach() - b.detach()).abs().max())
        for a, b in zip(models["hetcomm"].parameters(), models["gloo"].parameters())
    )
    diff = ctl.allreduce(diff, op=MPI.MAX)
    ctl.Free()
    dist.destroy_process_group()
    if rank == 0:
        print(
            f"# --study ddp: {size} ranks, {torch.get_num_threads()} torch threads per rank, "
            f"{params / 1e6:.1f}M parameters, batch {args.batch}, {args.rounds} rounds of "
            f"{args.steps} steps; parameters differ between the backends by at most {diff:.2g}"
        )
        print("| what | backend | median ms | spread | vs gloo (per round) |")
        print("| --- | --- | ---: | ---: | ---: |")
        rows = []
        for what, stats, per in (
            ("DDP step", step_stats, args.steps),
            ("all_reduce", reduce_stats, 1),
        ):
            for name, stat in stats.items():
                ratio = paired_ratio(stat, stats["gloo"])
                label = "none (no_sync)" if name == "none" else name
                print(
                    f"| {what} | {label} | {stat.median / per * 1e3:.1f} | {stat.spread:.0%} | "
                    f"{'-' if ratio is None else f'{ratio:.2f}'} |"
                )
                rows.append(
                    {
                        "what": what,
                        "backend": name,
                        "median_ms": stat.median / per * 1e3,
                        "spread": stat.spread,
                        "vs_gloo": ratio,
                    }
                )
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ranks": size, "params": params, "rows": rows, "max_diff": diff}, f)
        sys.stdout.flush()
    MPI.COMM_WORLD.Barrier()
    return 0
