"""Benchmarks: hetcomm beside raw mpi4py and torch gloo, same ranks, same run, medians and ratios.

`hetcomm bench` (or `python -m hetcomm.bench --op ...`) sweeps sizes nccl-tests style over
hetcomm's transports and the baselines; see docs/bench.md. The overhead study runs under mpirun:
`mpirun -n 2 python -m mpi4py -m hetcomm.bench overhead` (scripts/bench).
Each case times every implementation in turn, round after round (each round in a random order,
the same on every rank), so that noise on the machine falls on all of them alike; the tables
report the median per call and the spread of the rounds.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .bench_impls import (
    Case,
    Gloo,
    Hetcomm,
    Impl,
    Mpi4py,
    Naive,
    Skip,
    TorchNccl,
    to_tensor,
    torch_gloo,
)
from .bench_report import (
    REDUCING,
    ROOTED,
    add_ratios,
    canonical_op,
    element_count,
    make_row,
    parse_size,
    plot,
    size_steps,
    table,
    to_json,
)
from .bench_timing import share_cores

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


def _bind(fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
    return lambda: fn(*args)


def overhead(rounds: int = 15) -> list[dict[str, Any]]:
    """all_reduce: hetcomm vs raw mpi4py Allreduce vs torch gloo, per OVERHEAD_CASES."""
    import torch
    from mpi4py import MPI

    import hetcomm

    world = hetcomm.init(name="bench")
    raw = MPI.COMM_WORLD.Dup()
    dist = torch_gloo(raw)
    share_cores(torch, raw)
    rows: list[dict[str, Any]] = []
    orders = np.random.default_rng(0)  # one seed on every rank: every rank runs the same order
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
        names = list(impls)
        for _ in range(rounds):
            # each round in its own random order: no implementation keeps running right after
            # another (after gloo's calls, the next implementation ran 5-10% slower here)
            for k in orders.permutation(len(names)):
                samples[names[k]].append(time_calls(impls[names[k]], calls, raw.Barrier))
        # every rank measured; the slowest rank's time is the operation's time
        worst_of = {name: np.max(raw.allgather(values), axis=0) for name, values in samples.items()}
        for name, worst in worst_of.items():
            med = statistics.median(worst)
            spread = (max(worst) - min(worst)) / med if med else 0.0
            row = {
                "case": label,
                "impl": name,
                "dtype": dtype,
                "bytes": nbytes,
                "ranks": world.size,
                "median_us": med * 1e6,
                "spread": spread,
                "rounds": rounds,
                "calls": calls,
            }
            if name == "hetcomm numpy":
                # hetcomm and mpi4py run one after the other in each round: the ratio of each
                # round's pair is untouched by load that changes between rounds
                row["paired_ratio"] = statistics.median(worst / worst_of["mpi4py"])
            rows.append(row)
    dist.destroy_process_group()
    raw.Free()
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


# ---- the sweep of `hetcomm bench`: nccl-tests' columns for hetcomm's transports and baselines --

TRANSPORTS = ("auto", "mpi", "staged", "direct", "nccl", "hier")
BASELINES = ("mpi4py", "gloo", "naive", "nccl")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `hetcomm bench` (and of `python -m hetcomm.bench` without a study)."""
    from .arrays import DTYPES

    p.add_argument(
        "--latency",
        action="store_true",
        help="the OSU-style latency table: every op form beside its floor, measured in the "
        "same interleaved rounds (docs/bench.md)",
    )
    p.add_argument(
        "--op",
        default=None,
        help="one op or a comma list: all_reduce, all_gather, reduce_scatter, "
        "broadcast, reduce, all_to_all, sendrecv (nccl-tests names such as "
        "allreduce, allgather, reducescatter, alltoall too); default all_reduce, with "
        "--latency every op (also barrier, all_reduce_coalesced, all_gather_single)",
    )
    p.add_argument("-b", "--minbytes", default=None, help="smallest size (8, 64K, 1M, ...); 8")
    p.add_argument("-e", "--maxbytes", default=None, help="largest size; 256M (16M with --latency)")
    p.add_argument("-f", "--stepfactor", type=float, default=2.0, help="size step factor")
    p.add_argument("-d", "--dtype", default="float32", choices=DTYPES)
    p.add_argument("--redop", default="sum", help="sum, prod, min, max or avg (default sum)")
    p.add_argument("--root", type=int, default=0, help="root of broadcast and reduce")
    p.add_argument(
        "-n",
        "--iters",
        type=int,
        default=None,
        help="timed iterations per size (20); with --latency calls per sample up to 8 KiB (100)",
    )
    p.add_argument(
        "--iters-large",
        type=int,
        default=10,
        help="--latency: calls per sample above 8 KiB (default 10)",
    )
    p.add_argument(
        "--rounds", type=int, default=10, help="--latency: interleaved rounds (default 10)"
    )
    p.add_argument("-w", "--warmup", type=int, default=None, help="untimed iterations first (5)")
    p.add_argument(
        "-c",
        "--check",
        type=int,
        nargs="?",
        const=1,
        default=0,
        help="check results against a float64 numpy reference (#wrong); '-c', '-c 1' on, "
        "'-c 0' off (nccl-tests' spelling)",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument(
        "--transport",
        default="auto",
        help="hetcomm transport(s): auto, mpi, staged, direct, nccl, hier; the sweep takes a "
        "comma list, each in its own communicator, or 'none' for baselines only; --latency "
        "takes one (Config(transport=...) on every rank)",
    )
    p.add_argument(
        "--no-mismatch-check",
        "--no-check",
        action="store_true",
        help="--latency: switch off hetcomm's default mismatch check (Config field "
        "'check') where this hetcomm has one, to measure the control path alone",
    )
    p.add_argument(
        "--baselines",
        default="mpi4py,gloo,naive,nccl",
        help="comma list of mpi4py, gloo, naive; 'none' for none",
    )
    p.add_argument("--json", help="write {'rows': [...]} to this file (rank 0)")
    p.add_argument("--plot", help="draw busbw against size into this PNG (rank 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _names(text: str, known: Sequence[str], what: str) -> list[str]:
    names = [t.strip().lower() for t in text.split(",") if t.strip()]
    if names == ["none"]:
        return []
    bad = [t for t in names if t not in known]
    if bad:
        raise SystemExit(
            f"hetcomm bench: unknown {what} {', '.join(bad)}; expected {', '.join(known)}"
        )
    return list(dict.fromkeys(names))


def _agree(raw: Any, reason: str | None) -> str | None:
    """The first rank's reason to skip, on every rank (None when no rank has one)."""
    return next((r for r in raw.allgather(reason) if r is not None), None)


def _timer(device: str) -> Callable[[Callable[[], Any]], float]:
    """Seconds of one call: device events on a GPU, perf_counter on the CPU."""
    if device == "cuda":
        import torch

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def events(fn: Callable[[], Any]) -> float:
            start.record()
            fn()
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end)) / 1e3

        return events

    def wall(fn: Callable[[], Any]) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return wall


def _progress(total: int, enabled: bool) -> Any:
    """A rich progress bar on stderr (a no-op object when disabled or not a tty)."""
    if enabled and sys.stderr.isatty():
        try:
            from rich.console import Console
            from rich.progress import Progress

            bar = Progress(console=Console(stderr=True), transient=True)
            bar.start()
            bar.add_task("hetcomm bench", total=total)
            return bar
        except ImportError:
            pass
    return None


def sweep(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run the sweep that `args` describes on every rank; rows (with ratios) on every rank."""
    import torch
    from mpi4py import MPI

    from .errors import TransportUnavailable

    raw = MPI.COMM_WORLD.Dup()
    rank, ranks = raw.Get_rank(), raw.Get_size()
    share_cores(torch, raw)
    ops = [canonical_op(o) for o in args.op.split(",") if o.strip()]
    sizes = size_steps(parse_size(args.minbytes), parse_size(args.maxbytes), args.stepfactor)
    redop = args.redop.lower()
    if redop not in ("sum", "prod", "min", "max", "avg"):
        raise SystemExit(f"hetcomm bench: unknown --redop {args.redop!r}")
    if not 0 <= args.root < ranks:
        raise SystemExit(f"hetcomm bench: --root {args.root} is not a rank of {ranks}")
    device = args.device
    if device == "cuda":
        local = raw.Split_type(MPI.COMM_TYPE_SHARED)
        torch.cuda.set_device(local.Get_rank() % torch.cuda.device_count())
        local.Free()
        device = f"cuda:{torch.cuda.current_device()}"
    say = print if rank == 0 else (lambda *a, **k: None)
    impls: list[Impl] = []
    for t in _names(args.transport, TRANSPORTS, "transport"):
        try:
            impls.append(Hetcomm(t))
        except TransportUnavailable as exc:
            say(f"# skipping transport {t}: {exc}")
    for b in _names(args.baselines, BASELINES, "baseline"):
        why = None
        try:
            impl = {"mpi4py": Mpi4py, "gloo": Gloo, "naive": Naive, "nccl": TorchNccl}[b](raw)
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
        if _agree(raw, why) is None:
            impls.append(impl)
        else:
            say(f"# skipping baseline {b}: {why}")
    timer = _timer(args.device)
    itemsize = torch.tensor([], dtype=getattr(torch, args.dtype)).element_size()
    rows: list[dict[str, Any]] = []
    skipped: set[tuple[str, str]] = set()
    bar = _progress(len(ops) * len(sizes) * len(impls), rank == 0 and not args.no_progress)
    try:
        for op in ops:
            root = args.root if op in ROOTED else None
            for size in sizes:
                count = element_count(op, size, itemsize, ranks)
                case = Case(op, count, args.dtype, redop, args.root, rank, ranks)
                for impl in impls:
                    if (impl.name, op) not in skipped:
                        row = _measure(raw, impl, case, device, timer, args)
                        if isinstance(row, str):
                            skipped.add((impl.name, op))
                            say(f"# skipping {impl.name} for {op}: {row}")
                        else:
                            rows.append(
                                make_row(
                                    op=op,
                                    transport=impl.name,
                                    kind=impl.kind,
                                    count=count,
                                    itemsize=itemsize,
                                    dtype=args.dtype,
                                    redop=redop if op in REDUCING else None,
                                    root=root,
                                    ranks=ranks,
                                    time_s=row[0],
                                    wrong=row[1],
                                )
                            )
                    if bar is not None:
                        bar.advance(bar.task_ids[0])
    finally:
        if bar is not None:
            bar.stop()
        for impl in impls:
            impl.close()
        raw.Free()
    add_ratios(rows)
    return rows


def _measure(
    raw: Any,
    impl: Impl,
    case: Case,
    device: str,
    timer: Callable[[Callable[[], Any]], float],
    args: argparse.Namespace,
) -> tuple[float, int | None] | str:
    """(median over iterations of the slowest rank's seconds, #wrong or None), or why not."""
    from .errors import HetcommError

    where = device if impl.on_device else "cpu"
    x = to_tensor(case.input(case.rank), case.dtype, where)
    y = to_tensor(np.zeros(case.out_count), case.dtype, where)
    why = None
    try:
        call, out = impl.prepare(case, x, y)
        call()  # the first call: opens connections, and tells whether this can run at all
        if args.check:  # again from fresh inputs (in-place ops changed them)
            x.copy_(to_tensor(case.input(case.rank), case.dtype, where))
            y.zero_()
            raw.Barrier()
            call()
            if where != "cpu":
                import torch

                torch.cuda.synchronize()
    except (Skip, HetcommError, RuntimeError, NotImplementedError, ValueError, TypeError) as exc:
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    why = _agree(raw, why)
    if why is not None:
        return why
    wrong = raw.allreduce(case.wrong(out), op=_sum()) if args.check else None
    for _ in range(args.warmup):
        call()
    samples = []
    for _ in range(args.iters):
        raw.Barrier()
        samples.append(timer(call))
    worst = np.max(raw.allgather(samples), axis=0) if samples else [0.0]
    return float(statistics.median(worst)), wrong


def _sum() -> Any:
    from mpi4py import MPI

    return MPI.SUM


def _sweep_defaults(args: argparse.Namespace) -> None:
    """The sweep's defaults for the options that --latency defaults otherwise."""
    for name, value in (("op", "all_reduce"), ("minbytes", "8"), ("maxbytes", "256M")):
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.iters = 20 if args.iters is None else args.iters
    args.warmup = 5 if args.warmup is None else args.warmup


def _latency_defaults(args: argparse.Namespace) -> None:
    args.iters = 100 if args.iters is None else args.iters
    args.warmup = 10 if args.warmup is None else args.warmup


def run_args(args: argparse.Namespace) -> int:
    """`hetcomm bench`: sweep, then the table (and JSON, plot) on rank 0; 1 if any #wrong."""
    from mpi4py import MPI

    if args.latency:
        from .bench_latency import run_latency

        _latency_defaults(args)
        argv = getattr(args, "argv", None)
        if argv is None:
            argv = sys.argv[sys.argv.index("bench") + 1 :] if "bench" in sys.argv else []
        return run_latency(args, argv)
    _sweep_defaults(args)
    rows = sweep(args)
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(table(rows))
        if args.json:
            with open(args.json, "w") as f:
                f.write(
                    to_json(
                        rows,
                        ranks=MPI.COMM_WORLD.Get_size(),
                        device=args.device,
                        host=os.uname().nodename,
                        date=datetime.datetime.now().isoformat(timespec="seconds"),
                    )
                )
        if args.plot:
            plot(rows, args.plot, MPI.COMM_WORLD.Get_size())
        sys.stdout.flush()
    MPI.COMM_WORLD.Barrier()  # the files exist once any rank returns
    return 1 if any(r["wrong"] for r in rows) else 0


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register `hetcomm bench` on the subparsers object of the `hetcomm` command."""
    p: argparse.ArgumentParser = sub.add_parser(
        "bench",
        help="nccl-tests style sweep: hetcomm's transports beside mpi4py, gloo and naive "
        "staging (run under mpirun or `hetcomm run`)",
        description=__doc__,
    )
    add_arguments(p)
    p.set_defaults(func=run_args)
    return p


def _overhead_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m hetcomm.bench", description=__doc__)
    parser.add_argument("study", choices=["overhead"])
    parser.add_argument("--rounds", type=int, default=15)
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


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m hetcomm.bench overhead [...]` (the overhead study) or the sweep of
    `hetcomm bench` (`python -m hetcomm.bench --op all_reduce -b 8 -e 1M ...`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["overhead"]:
        return _overhead_main(argv)
    parser = argparse.ArgumentParser(prog="hetcomm bench", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.argv = argv
    return run_args(args)


if __name__ == "__main__":
    raise SystemExit(main())
