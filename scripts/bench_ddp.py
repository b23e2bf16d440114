"""DDP step time on torch.distributed backend "hetcomm" against gloo, CPU, one mpirun job.

    mpirun -n 2 python -m mpi4py scripts/bench_ddp.py [--rounds 8 --steps 5 --batch 32]

Both backends train the same ~10M-parameter MLP in the same job: the default process group is
hetcomm's, a second group made with `dist.new_group(backend="gloo")` is gloo's (its rendezvous
runs over hetcomm's MPI store). Rounds alternate which backend goes first, so drift of the machine
hits both alike; each round runs a few steps per backend. Rank 0 prints a markdown table: the
median step time, the spread (10th-90th percentile), the ratio to gloo, and the same for a bare
all_reduce of the model's gradient size. A third row, "none", is the same step without any
communication (DDP's no_sync()), so that each backend's cost over the computation shows.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.nn.parallel import DistributedDataParallel as DDP

import hetcomm.torch  # noqa: F401  (registers the backend)


def make_model(width: int) -> torch.nn.Module:
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


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per backend and round")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--width", type=int, default=1024, help="1024: ~9.4M parameters")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: cores/ranks)")
    args = parser.parse_args()

    dist.init_process_group("hetcomm")
    rank, size = dist.get_rank(), dist.get_world_size()
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(args.threads or max(1, cores // size))
    groups = {"hetcomm": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}

    models = {name: DDP(make_model(args.width), process_group=g) for name, g in groups.items()}
    opts = {name: torch.optim.SGD(m.parameters(), lr=1e-3) for name, m in models.items()}
    params = sum(p.numel() for p in next(iter(models.values())).parameters())
    torch.manual_seed(rank)
    x = torch.randn(args.batch, args.width)
    grads = torch.randn(params)

    def step(name: str) -> float:
        model = models["hetcomm" if name == "none" else name]
        quiet = model.no_sync() if name == "none" else contextlib.nullcontext()
        t0 = time.perf_counter()
        with quiet:
            loss = model(x).square().mean()
            loss.backward()
        if name != "none":
            opts[name].step()
        opts[name if name != "none" else "hetcomm"].zero_grad(set_to_none=False)
        return time.perf_counter() - t0

    def all_reduce(name: str) -> float:
        dist.barrier(group=groups[name])
        t0 = time.perf_counter()
        dist.all_reduce(grads, group=groups[name])
        return time.perf_counter() - t0

    times: dict[tuple[str, str], list[float]] = {}
    for name in groups:  # warm up: bucket rebuild, first-touch allocations
        for _ in range(3):
            step(name)
            all_reduce(name)
    names = [*groups, "none"]
    for rnd in range(args.rounds):
        order = names if rnd % 2 == 0 else list(reversed(names))
        for name in order:
            MPI.COMM_WORLD.Barrier()
            for _ in range(args.steps):
                times.setdefault(("DDP step", name), []).append(step(name))
            if name != "none":
                times.setdefault(("all_reduce", name), []).append(all_reduce(name))

    # the slowest rank decides a step: take the per-sample maximum over ranks
    mine = {k: v for k, v in sorted(times.items())}
    every = MPI.COMM_WORLD.gather(mine, root=0)
    diff = max(
        float((a - b).abs().max())
        for a, b in zip(models["hetcomm"].parameters(), models["gloo"].parameters())
    )
    diff = MPI.COMM_WORLD.allreduce(diff, op=MPI.MAX)
    if rank == 0:
        assert every is not None
        print(
            f"\n{size} ranks, {cores} cores, {torch.get_num_threads()} torch threads per rank, "
            f"{params / 1e6:.1f}M parameters ({params * 4 / 2**20:.0f} MiB of float32 "
            f"gradients), batch {args.batch}, {args.rounds} rounds x {args.steps} steps; after "
            f"training, parameters differ between the backends by at most {diff:.2g}\n"
        )
        print("| ranks | what | backend | median ms | p10-p90 ms | vs gloo |")
        print("| ---: | --- | --- | ---: | --- | ---: |")
        for what in ("DDP step", "all_reduce"):
            rows = {}
            for name in names:
                if (what, name) not in every[0]:
                    continue
                samples = [max(col) for col in zip(*(e[(what, name)] for e in every))]
                rows[name] = (
                    statistics.median(samples),
                    percentile(samples, 0.1),
                    percentile(samples, 0.9),
                )
            for name, (median, lo, hi) in rows.items():
                label = "none (no_sync)" if name == "none" else name
                print(
                    f"| {size} | {what} | {label} | {median * 1e3:.1f} | "
                    f"{lo * 1e3:.1f}-{hi * 1e3:.1f} | {median / rows['gloo'][0]:.2f} |"
                )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
