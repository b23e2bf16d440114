"""Benchmarks: hetcomm beside raw mpi4py and torch gloo, same ranks, same run, medians and ratios.

Run under mpirun: `mpirun -n 2 python -m mpi4py -m hetcomm.bench overhead` (scripts/bench).
Each case times every implementation in turn, round after round, so that noise on the machine
falls on all of them alike; the tables report the median per call and the spread of the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

# (label, dtype, bytes) of the overhead study
OVERHEAD_CASES = (
    ("8 B float32", "float32", 8),
    ("16 MiB float32", "float32", 16 << 20),
    ("16 MiB float16", "float16", 16 << 20),
    ("16 MiB bfloat16", "bfloat16", 16 << 20),
)


def time_calls(fn: Callable[[], Any], calls: int, sync: Callable[[], Any]) -> float:
    """Seconds per call of `fn`, over `calls` calls started together on every rank."""
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def _calls_for(nbytes: int) -> int:
    return 2000 if nbytes <= 4096 else 10


def _torch_gloo(mpi: Any) -> Any:
    """torch.distributed with gloo over loopback, rendezvous address agreed over MPI."""
    import socket

    import torch.distributed as dist

    port = None
    if mpi.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = mpi.bcast(port, root=0)
    store = dist.TCPStore("127.0.0.1", port, mpi.Get_size(), mpi.Get_rank() == 0, use_libuv=False)
    dist.init_process_group("gloo", store=store, rank=mpi.Get_rank(), world_size=mpi.Get_size())
    return dist


def _bind(fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
    return lambda: fn(*args)


def overhead(rounds: int = 7) -> list[dict[str, Any]]:
    """all_reduce: hetcomm vs raw mpi4py Allreduce vs torch gloo, per OVERHEAD_CASES."""
    import torch
    from mpi4py import MPI

    import hetcomm

    world = hetcomm.init(name="bench")
    raw = MPI.COMM_WORLD.Dup()
    dist = _torch_gloo(raw)
    rows = []
    for label, dtype, nbytes in OVERHEAD_CASES:
        tdtype = getattr(torch, dtype)
        count = max(1, nbytes // torch.tensor([], dtype=tdtype).element_size())
        t = (torch.rand(count) + 0.5).to(tdtype)
        impls: dict[str, Callable[[], Any]] = {
            "hetcomm": _bind(world.all_reduce, t),
            "gloo": _bind(dist.all_reduce, t),
        }
        if dtype == "float32":
            a = np.ascontiguousarray(t.numpy())
            impls["hetcomm numpy"] = _bind(world.all_reduce, a)
            impls["mpi4py"] = _bind(raw.Allreduce, MPI.IN_PLACE, a)
        calls = _calls_for(nbytes)
        for fn in impls.values():  # warm up: compile kernels, open connections
            for _ in range(3):
                fn()
        samples: dict[str, list[float]] = {k: [] for k in impls}
        for _ in range(rounds):
            for name, fn in impls.items():
                samples[name].append(time_calls(fn, calls, raw.Barrier))
        # every rank measured; the slowest rank's time is the operation's time
        for name, values in samples.items():
            worst = np.max(raw.allgather(values), axis=0)
            med = statistics.median(worst)
            spread = (max(worst) - min(worst)) / med if med else 0.0
            rows.append({"case": label, "impl": name, "dtype": dtype, "bytes": nbytes,
                         "ranks": world.size, "median_us": med * 1e6, "spread": spread,
                         "rounds": rounds, "calls": calls})  # fmt: skip
    dist.destroy_process_group()
    raw.Free()
    world.close()
    return rows


def overhead_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown: per case, each implementation's median and its ratio to hetcomm."""
    out = ["| case | ranks | hetcomm (torch) | hetcomm (numpy) | mpi4py (numpy) | gloo (torch) | "
           "hetcomm numpy / mpi4py | gloo / hetcomm torch | spread |",
           "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    by_case: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_case.setdefault(r["case"], {})[r["impl"]] = r
    for case, impls in by_case.items():
        h = impls["hetcomm"]["median_us"]
        hn = impls.get("hetcomm numpy", {}).get("median_us")
        m = impls.get("mpi4py", {}).get("median_us")
        g = impls["gloo"]["median_us"]
        spread = max(v["spread"] for v in impls.values())
        out.append(
            f"| {case} | {impls['hetcomm']['ranks']} | {_us(h)} | {_us(hn) if hn else '-'} | "
            f"{_us(m) if m else '-'} | {_us(g)} | {f'{hn / m:.2f}x' if m and hn else '-'} | "
            f"{g / h:.2f}x | {spread:.0%} |"
        )
    return "\n".join(out)


def _us(value: float) -> str:
    return f"{value:.1f} µs" if value < 1000 else f"{value / 1000:.2f} ms"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hetcomm.bench", description=__doc__)
    parser.add_argument("study", choices=["overhead"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", help="write the rows to this file (rank 0)")
    args = parser.parse_args(argv)
    rows = overhead(args.rounds)
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_rank() == 0:
        print(overhead_table(rows))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"rows": rows, "host": os.uname().nodename}, f, indent=1)
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
