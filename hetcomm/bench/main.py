"""`hetcomm bench`: nccl-tests' sweep, the `--latency` table and the `--study` benchmarks.

Every benchmark runs under mpirun (`mpirun -n 2 python -m mpi4py -m hetcomm bench ...`, or
`hetcomm run`, or scripts/bench) and times hetcomm beside its baselines or floors in the same
run (docs/bench.md):

- no study: nccl-tests' sweep and its output format, out of place and in place, hetcomm's
  transports beside raw mpi4py, torch gloo, naive staging and NCCL (sweep.py);
- `--latency`: every op form from 8 B to 16 MiB beside its floor, in interleaved rounds
  (latency.py);
- `--study NAME`: the studies BENCHMARKS.md quotes (`STUDIES`, one module each).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Any

from .report import canonical_dtype

#: study name -> (module, its function, what it measures); the function takes the parsed
#: arguments and returns the exit code; modules with study options have `add_arguments`
STUDIES = {
    "overhead": ("overhead", "run", "in-place all_reduce of tensors, arrays vs mpi4py, gloo"),
    "staged": ("device", "run_staged", "GPU: staged send/recv, all_reduce vs PCIe, naive"),
    "direct": ("device", "run_direct", "GPU: direct send/recv, all_reduce vs the copy rate"),
    "hier": ("hier", "run", "hier vs flat all_reduce across simulated vendor islands"),
    "rails": ("rails", "run", "staged send/recv over 1..K emulated tcp rails"),
    "coalesced": ("coalesced", "run", "all_reduce_coalesced vs one all_reduce per array"),
    "ddp": ("ddp", "run", "a DDP training step through hetcomm vs gloo"),
    "wake": ("wake", "run", "a message after a pause: how soon a long wait sees it"),
    "lane": ("lane", "run", "large host collectives: blocking, on a thread, non-blocking"),
    "copies": ("copies", "run", "GPU: host<->device copies, 1D vs 2D rows, ranks sharing"),
}


def _study_module(name: str) -> Any:
    return importlib.import_module(f"hetcomm.bench.{STUDIES[name][0]}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `hetcomm bench` (nccl-tests' letters where they mean the same)."""
    p.add_argument(
        "--latency",
        action="store_true",
        help="the OSU-style latency table: every op form beside its floor, measured in the "
        "same interleaved rounds",
    )
    p.add_argument(
        "--study",
        choices=sorted(STUDIES),
        help="one of the studies of docs/BENCHMARKS.md: "
        + "; ".join(f"{k}: {v[2]}" for k, v in STUDIES.items()),
    )
    p.add_argument("--mode", default=None, help="--study: the study's mode (docs/bench.md)")
    p.add_argument(
        "--op",
        default=None,
        help="one op or a comma list: all_reduce, all_gather, reduce_scatter, broadcast, "
        "reduce, all_to_all, sendrecv (nccl-tests' allreduce, allgather, reducescatter, "
        "alltoall too); default all_reduce; with --latency every op (and barrier, "
        "all_reduce_coalesced, all_gather_single)",
    )
    p.add_argument("-b", "--minbytes", default=None, help="smallest size (8, 64K, 1M...): 8")
    p.add_argument("-e", "--maxbytes", default=None, help="largest size: 256M (--latency 16M)")
    p.add_argument(
        "-f", "--stepfactor", type=float, default=None, help="size step factor (default 2)"
    )
    p.add_argument(
        "-i", "--stepbytes", default=None, help="size step in bytes, used when -f is 1 or absent"
    )
    p.add_argument(
        "-d",
        "--datatype",
        "--dtype",
        dest="dtype",
        default="float32",
        help="hetcomm's dtype names (float32, bfloat16, int8...) or nccl-tests' (float, half, "
        "double, bfloat16, int8, uint8, int32, int64); default float32",
    )
    p.add_argument(
        "-o", "--redop", default="sum", help="reduction: sum, prod, min, max, avg (default sum)"
    )
    p.add_argument("-r", "--root", type=int, default=0, help="root of broadcast and reduce")
    p.add_argument(
        "-n",
        "--iters",
        type=int,
        default=None,
        help="timed iterations per size (20); --latency: calls per sample up to 8 KiB (100)",
    )
    p.add_argument(
        "--iters-large", type=int, default=10, help="--latency: calls per sample above 8 KiB"
    )
    p.add_argument(
        "--rounds",
        "--repeats",
        type=int,
        default=10,
        help="--latency, --study: interleaved rounds (10)",
    )
    p.add_argument("-w", "--warmup", type=int, default=None, help="untimed iterations first (5)")
    p.add_argument(
        "-c",
        "--check",
        type=int,
        nargs="?",
        const=1,
        default=0,
        help="check results against a float64 numpy reference (#wrong): -c or -c 1 on, "
        "-c 0 off (nccl-tests' spelling)",
    )
    p.add_argument("-g", "--ngpus", type=int, default=1, help="GPUs per rank: 1 (the only one)")
    p.add_argument("-t", "--nthreads", type=int, default=1, help="threads per rank: 1 (the only)")
    p.add_argument(
        "-z",
        "--blocking",
        type=int,
        default=0,
        choices=(0, 1),
        help="accepted as nccl-tests does; hetcomm's calls block, each timed after a barrier",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="buffer memory")
    p.add_argument(
        "--transport",
        default="auto",
        help="hetcomm transport(s): auto, mpi, staged, direct, nccl, hier; the sweep takes a "
        "comma list (each in its own communicator; 'none' for baselines only), --latency one; "
        "set through Config(transport=...) on every rank",
    )
    p.add_argument(
        "--no-mismatch-check",
        "--no-check",
        action="store_true",
        help="--latency: switch off hetcomm's default mismatch check (Config field 'check') "
        "where this hetcomm has one, to time the control path alone",
    )
    p.add_argument(
        "--check-cost",
        action="store_true",
        help="--latency on host buffers: a section timing every host op form with the "
        "default mismatch check beside the same op on a Communicator without it",
    )
    p.add_argument(
        "--baselines",
        default="mpi4py,gloo,naive,nccl",
        help="sweep: comma list of mpi4py, gloo, naive, nccl; 'none' for none. --latency: "
        "the gloo column of the host rows only where gloo is listed (mpi4py is their floor)",
    )
    p.add_argument(
        "--hetcomm-columns",
        action="store_true",
        help="sweep: add hetcomm's columns after nccl-tests' (transport, busbw / the best "
        "baseline's per form)",
    )
    p.add_argument(
        "--json",
        help="write the rows (and the run's facts) to this file (rank 0; rails: - for "
        "one JSON line on stdout)",
    )
    p.add_argument("--plot", help="sweep: busbw against size into this PNG (rank 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    group = p.add_argument_group("study options")
    for module in dict.fromkeys(m for m, _, _ in STUDIES.values()):
        add = getattr(importlib.import_module(f"hetcomm.bench.{module}"), "add_arguments", None)
        if add is not None:
            add(group)


def _refuse(args: argparse.Namespace) -> None:
    """Exit with a clear message on what hetcomm bench cannot do."""
    from ..dtypes import DTYPES

    if args.ngpus != 1:
        raise SystemExit(
            f"hetcomm bench: -g {args.ngpus}: hetcomm drives one GPU per rank; start one rank "
            "per GPU instead (mpirun -n <GPUs>)"
        )
    if args.nthreads != 1:
        raise SystemExit(
            f"hetcomm bench: -t {args.nthreads}: one thread per rank; start more ranks instead"
        )
    if args.check < 0:
        raise SystemExit(f"hetcomm bench: -c takes 0 or a positive count, got {args.check}")
    try:
        args.dtype = canonical_dtype(args.dtype, DTYPES)
    except ValueError as exc:
        raise SystemExit(f"hetcomm bench: -d: {exc}") from None


def _defaults(args: argparse.Namespace) -> None:
    latency = args.latency
    for name, value in (
        ("op", None if latency else "all_reduce"),
        ("minbytes", "8"),
        ("maxbytes", "16M" if latency else "256M"),
        ("iters", 100 if latency else 20),
        ("warmup", 10 if latency else 5),
    ):
        if getattr(args, name) is None:
            setattr(args, name, value)
    if latency and args.stepfactor is None and args.stepbytes is None:
        args.stepfactor = 2.0


def run_args(args: argparse.Namespace) -> int:
    """`hetcomm bench`: the study, the latency table or the sweep that `args` asks for."""
    _refuse(args)
    if args.latency and args.study:
        raise SystemExit("hetcomm bench: --latency and --study are two runs; give one")
    if args.study:  # a study takes its own defaults for the options it reads
        code: int = getattr(_study_module(args.study), STUDIES[args.study][1])(args)
        return code
    _defaults(args)
    from .sweep import sizes_of

    try:  # a bad size or step is a clear message before any rank starts MPI work
        sizes_of(args)
    except ValueError as exc:
        raise SystemExit(f"hetcomm bench: -b/-e/-f/-i: {exc}") from None
    if args.latency:
        from .latency import run_latency

        argv = getattr(args, "argv", None)
        if argv is None:
            argv = sys.argv[sys.argv.index("bench") + 1 :] if "bench" in sys.argv else []
        return run_latency(args, argv)
    from .sweep import run_sweep

    return run_sweep(args)


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register `hetcomm bench` on the subparsers object of the `hetcomm` command."""
    p: argparse.ArgumentParser = sub.add_parser(
        "bench",
        help="nccl-tests' sweep, --latency, --study (under mpirun or `hetcomm run`)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    p.set_defaults(func=run_args)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m hetcomm.bench [options]`, the same as `hetcomm bench [options]`
    (`python -m hetcomm.bench overhead` still runs the overhead study)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["overhead"]:
        argv = ["--study", "overhead", *argv[1:]]
    parser = argparse.ArgumentParser(prog="hetcomm bench", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.argv = argv
    return run_args(args)
