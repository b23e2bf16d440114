"""The `hetcomm` command: `hetcomm info` (run, bench and tune live in their own modules)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any


def group_plans(world: Any, groups: Any) -> str | None:
    """Every distinct group's plan, as text on world rank 0 (None elsewhere). Collective."""
    plans = []
    for dim, comm in groups.items():
        members = tuple(comm.mpi.allgather(world.rank))
        plans.append((dim, members, str(comm.plan)))
    every = world.mpi.gather(plans, root=0)
    if world.rank != 0:
        return None
    lines = [f"layout: {groups.layout}"]
    seen: set[tuple[str, tuple[int, ...]]] = set()
    for rank_plans in every:
        for dim, members, text in rank_plans:
            if (dim, members) in seen or len(members) == 1:
                continue
            seen.add((dim, members))
            lines.append(f"{dim} group of world ranks {list(members)}:\n" + text.partition("\n")[2])
    return "\n".join(lines)


def config_table(config: Any) -> str:
    """The configuration as a table (variable, value, meaning), each column as wide as its
    widest cell."""
    from .config import OPTIONS

    rows = [("variable", "value", "meaning")]
    rows += [(env, str(getattr(config, name)), text) for name, (env, text) in OPTIONS.items()]
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    return "\n".join(f"{a:{widths[0]}}  {b:{widths[1]}}  {c}".rstrip() for a, b, c in rows)


def tuning_report(world: Any) -> str:
    """Whether values of `hetcomm tune` are in use for this topology, and which."""
    from .config import Config
    from .transports.staged.transport import CHUNK_BYTES, SLOTS
    from .tuning import cache_dir, cache_path, resolve_direct_min

    tuned = world.config.tuned
    fp = world.topology.fingerprint()
    value, source = resolve_direct_min(Config.load().direct_min, tuned)
    if tuned is not None:
        return (
            f"in use for topology {fp}\n{tuned.summary()}\ndirect_min in effect: {value} ({source})"
        )
    directory = cache_dir(world.config)
    where = (
        "HETCOMM_TUNE_DIR is off" if directory is None else f"no valid {cache_path(directory, fp)}"
    )
    return (
        f"none for topology {fp} ({where}): built-in defaults, chunk bytes {CHUNK_BYTES}, "
        f"slots {SLOTS}, no rail weights, direct_min {value} ({source})"
    )


def persistent_report(limit: int) -> str:
    """Whether small collectives of the mpi transport run as persistent requests, and why not."""
    from .transports.mpi.persistent import INITS, missing, unavailable
    from .transports.mpi.schedule import LANE_BYTES

    why = unavailable()
    if why is not None:
        return f"no: {why}"
    if limit == 0:
        return "off (HETCOMM_PERSISTENT_MAX=0)"
    lacking = missing()
    ops = ", ".join(op for op in INITS if op not in lacking)
    without = f" (this MPI has no persistent {', '.join(sorted(lacking))})" if lacking else ""
    return (
        f"mpi {ops} up to {min(limit, LANE_BYTES)} bytes run as cached MPI-4 persistent "
        f"requests{without}"
    )


def _info(args: argparse.Namespace) -> int:
    from mpi4py import MPI

    import hetcomm

    from .launch import mpi as launch_mpi
    from .topology import mpi_gpu_support

    world = hetcomm.init()
    sizes = {d: getattr(args, d) for d in ("tp", "cp", "ep", "pp") if getattr(args, d) != 1}
    groups = None
    if sizes or args.dp is not None:
        groups = hetcomm.ParallelGroups(world, dp=args.dp, order=args.order, **sizes)
    report = group_plans(world, groups) if groups is not None else None
    if world.rank == 0:
        # Open MPI's version string ends in a NUL byte, which strip() keeps
        banner = MPI.Get_library_version().strip("\x00 \n").splitlines()[0]
        levels = {
            MPI.THREAD_SINGLE: "single",
            MPI.THREAD_FUNNELED: "funneled",
            MPI.THREAD_SERIALIZED: "serialized",
            MPI.THREAD_MULTIPLE: "multiple",
        }
        aware, how = mpi_gpu_support()
        print(f"hetcomm {hetcomm.__version__}")
        print(f"MPI library:  {banner}")
        print(f"MPI flavour:  {launch_mpi.flavour(banner)} {launch_mpi.version(banner) or ''}")
        print(f"thread level: {levels.get(MPI.Query_thread(), MPI.Query_thread())}")
        print(f"GPU-aware:    {'yes' if aware else 'no'} ({how})")
        print(f"persistent:   {persistent_report(world.config.persistent_max)}")
        print(f"ranks:        {world.size}")
        print("\nconfiguration:")
        print("  " + config_table(world.config).replace("\n", "\n  "))
        print("\ntopology:")
        print("  " + world.topology.table().replace("\n", "\n  "))
        print("\ntuning:")
        print("  " + tuning_report(world).replace("\n", "\n  "))
        print()
        print(world.plan)
        if report:
            print()
            print(report)
        sys.stdout.flush()
    if groups is not None:
        groups.close()
    world.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `hetcomm` console script."""
    parser = argparse.ArgumentParser(prog="hetcomm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser(
        "info", help="MPI library, topology and each group's plan (under mpirun: every rank's view)"
    )
    for dim in ("tp", "cp", "ep", "pp"):
        info.add_argument(f"--{dim}", type=int, default=1, help=f"{dim} size (default 1)")
    info.add_argument("--dp", type=int, default=None, help="dp size (default: what is left)")
    info.add_argument("--order", default="tp-cp-ep-dp-pp", help="layout order, fastest first")
    info.set_defaults(func=_info)
    from .run import add_parser as add_run_parser

    add_run_parser(sub)
    from .bench.main import add_parser as add_bench_parser

    add_bench_parser(sub)
    from .tune import add_parser as add_tune_parser

    add_tune_parser(sub)
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
