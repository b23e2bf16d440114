"""The overhead study (`hetcomm bench --study overhead`): in-place all_reduce of torch tensors
and numpy arrays through hetcomm beside raw mpi4py and torch gloo, float32 at 8 B and 16 MiB and
float16 / bfloat16 at 16 MiB (which MPI cannot reduce: hetcomm's own kernels against gloo's)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .impls import torch_gloo
from .timing import Interleaved, Run, paired_ratio, share_cores

# (label, dtype, bytes) of the study
OVERHEAD_CASES = (
    ("8 B float32", "float32", 8),
    ("16 MiB float32", "float32", 16 << 20),
    ("16 MiB float16", "float16", 16 << 20),
    ("16 MiB bfloat16", "bfloat16", 16 << 20),
)


def _calls_for(nbytes: int) -> int:
    return 2000 if nbytes <= 4096 else 10


def repeat(fn: Callable[..., Any], *args: Any) -> Run:
    """A Run that calls fn(*args) `calls` times."""

    def run(calls: int) -> None:
        for _ in range(calls):
            fn(*args)

    return run


def overhead(rounds: int = 15) -> list[dict[str, Any]]:
    """all_reduce: hetcomm vs raw mpi4py Allreduce vs torch gloo, per OVERHEAD_CASES."""
    import torch
    from mpi4py import MPI

    import hetcomm

    world = hetcomm.init(name="bench")
    raw = MPI.COMM_WORLD.Dup()
    ctl = MPI.COMM_WORLD.Dup()
    dist = torch_gloo(raw)
    share_cores(torch, raw)
    timing = Interleaved(ctl, rounds)
    rows: list[dict[str, Any]] = []
    for label, dtype, nbytes in OVERHEAD_CASES:
        tdtype = getattr(torch, dtype)
        count = max(1, nbytes // torch.tensor([], dtype=tdtype).element_size())
        t = (torch.rand(count) + 0.5).to(tdtype)
        impls: dict[str, Run] = {
            "hetcomm": repeat(world.all_reduce, t),
            "gloo": repeat(dist.all_reduce, t),
        }
        if dtype == "float32":
            a = np.ascontiguousarray(t.numpy())
            impls["hetcomm numpy"] = repeat(world.all_reduce, a)
            impls["mpi4py"] = repeat(raw.Allreduce, MPI.IN_PLACE, a)
        calls = _calls_for(nbytes)
        stats = timing.measure(impls, calls, warmup=3)  # warm-up: kernels, connections
        for name, stat in stats.items():
            row = {
                "case": label,
                "impl": name,
                "dtype": dtype,
                "bytes": nbytes,
                "ranks": world.size,
                "median_us": stat.median * 1e6,
                "spread": stat.spread,
                "rounds": rounds,
                "calls": calls,
            }
            if name == "hetcomm numpy":
                # the per-round ratio to mpi4py: untouched by load that changes between rounds
                row["paired_ratio"] = paired_ratio(stat, stats["mpi4py"])
            rows.append(row)
    dist.destroy_process_group()
    raw.Free()
    ctl.Free()
    world.close()
    return rows


def overhead_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown: per case, each implementation's median and its ratio to hetcomm."""
    out = [
        "| case | ranks | hetcomm (torch) | hetcomm (numpy) | mpi4py (numpy) | gloo (torch) | "
        "hetcomm numpy / mpi4py | same, per round | gloo / hetcomm torch | spread |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    by_case: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_case.setdefault(r["case"], {})[r["impl"]] = r
    for case, impls in by_case.items():
        h = impls["hetcomm"]["median_us"]
        hn = impls.get("hetcomm numpy", {}).get("median_us")
        m = impls.get("mpi4py", {}).get("median_us")
        g = impls["gloo"]["median_us"]
        paired = impls.get("hetcomm numpy", {}).get("paired_ratio")
        spread = max(v["spread"] for v in impls.values())
        out.append(
            f"| {case} | {impls['hetcomm']['ranks']} | {_us(h)} | {_us(hn) if hn else '-'} | "
            f"{_us(m) if m else '-'} | {_us(g)} | {f'{hn / m:.2f}x' if m and hn else '-'} | "
            f"{f'{paired:.2f}x' if paired else '-'} | {g / h:.2f}x | {spread:.0%} |"
        )
    return "\n".join(out)


def _us(value: float) -> str:
    return f"{value:.1f} µs" if value < 1000 else f"{value / 1000:.2f} ms"


def run(args: argparse.Namespace) -> int:
    """`hetcomm bench --study overhead [--rounds N] [--json FILE]`."""
    from mpi4py import MPI

    rows = overhead(args.rounds)
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(overhead_table(rows))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"rows": rows, "host": os.uname().nodename}, f, indent=1)
        sys.stdout.flush()
    MPI.COMM_WORLD.Barrier()
    return 0
