"""Run PyTorch's backend suite (DistributedTest._DistTestBase) on N ranks under mpirun.

scripts/torch-suite is the entry point. The tests to run are found first (a listing process),
then one mpirun runs them in order (tests/torch_suite/ranks.py); when a test leaves a rank
inside it (an error on another rank, or the per-test limit), that mpirun ends and a new one
starts from the next test. One line per test, then `N passed, N failed, N skipped`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_RANKS = _HERE / "ranks.py"
# Tests torch runs on gloo alone by its own rule: monitored_barrier exists only in gloo's C++
# backend (a Python ProcessGroup cannot provide it), and so do sparse tensors.
_GLOO_ONLY = re.compile(r"monitored_barrier|sparse")


def listing(python: str, backend: str, gate: bool, ranks: int) -> list[tuple[str, str | None]]:
    cmd = [python, str(_RANKS), "--list", "--backend", backend, "--world-size", str(ranks)]
    if gate:
        cmd.append("--as-gloo-gate")
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    if out.returncode != 0:
        sys.exit(f"torch-suite: listing the tests failed:\n{out.stderr}")
    return [(name, why) for name, why in json.loads(out.stdout)]


def select(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """The tests to start, and those unittest skips before starting (name -> reason)."""
    own = listing(args.python, args.backend, False, args.ranks)
    if args.as_gloo_gate:
        gated = dict(listing(args.python, args.backend, True, args.ranks))
        # gated to gloo by name: skipped for this backend, started for gloo
        run = [n for n, why in own if why is not None and gated.get(n) is None]
        skipped = {}
    else:
        run = [n for n, why in own if why is None]
        skipped = {n: why for n, why in own if why is not None}
    if args.k:
        pattern = re.compile(args.k)
        run = [n for n in run if pattern.search(n)]
        skipped = {n: w for n, w in skipped.items() if pattern.search(n)}
    return run, skipped


def read_results(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_all(args: argparse.Namespace, tests: list[str], work: Path, log) -> list[dict]:
    """Run `tests` in order under as many mpiruns as it takes; one result per test."""
    results: list[dict] = []
    stall = args.test_timeout + 90.0  # a test's limit, plus starting mpirun and torch
    attempt = 0
    while len(results) < len(tests):
        remaining = tests[len(results) :]
        attempt += 1
        listfile, resfile = work / f"tests.{attempt}", work / f"results.{attempt}"
        listfile.write_text("\n".join(remaining) + "\n")
        cmd = [
            *args.mpirun,
            "-n",
            str(args.ranks),
            args.python,
            "-m",
            "mpi4py",
            str(_RANKS),
            "--backend",
            args.backend,
            "--tests",
            str(listfile),
            "--results",
            str(resfile),
            "--test-timeout",
            str(args.test_timeout),
        ]
        if args.as_gloo_gate:
            cmd.append("--as-gloo-gate")
        log.write(f"\n$ {shlex.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        seen, last = 0, time.monotonic()
        while True:
            rc = proc.poll()
            got = read_results(resfile)
            for r in got[seen:]:
                report(r, args.verbose)
            if len(got) > seen:
                seen, last = len(got), time.monotonic()
            if rc is not None:
                break
            if time.monotonic() - last > stall:
                # SIGTERM first: mpirun ends its ranks on it (killed outright, it leaves them
                # running, orphaned); SIGKILL for what is left of its group
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                rc = f"killed: no result within {stall:.0f} s"
                break
            time.sleep(0.2)
        results.extend(got)
        if len(results) < len(tests) and (not got or got[-1]["restart"] is False):
            # mpirun ended during a test without a verdict (a rank crashed or hung)
            lost = {
                "test": tests[len(results)],
                "status": "fail",
                "detail": f"mpirun ended during this test ({rc}); see {log.name}",
                "restart": True,
                "seconds": 0.0,
            }
            report(lost, args.verbose)
            results.append(lost)
    return results


def report(r: dict, verbose: bool) -> None:
    status = r["status"]
    if r.get("expected_gloo_only") and status == "fail":
        status = "xfail"
    print(f"{status.upper():5} {r['test']}  ({r['seconds']:.1f} s)", flush=True)
    if r["status"] == "fail" and r["detail"]:
        lines = r["detail"].rstrip().splitlines()
        keep = lines if verbose else lines[-25:]
        print("      " + "\n      ".join(keep), flush=True)
    elif r["status"] == "skip" and verbose:
        print(f"      {r['detail']}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(prog="torch-suite", description=__doc__.splitlines()[0])
    p.add_argument("-n", "--ranks", type=int, default=3, choices=(2, 3, 4))
    p.add_argument("--backend", default="hetcomm", choices=("hetcomm", "gloo"))
    p.add_argument(
        "--as-gloo-gate",
        action="store_true",
        help="run the tests torch gates to gloo by name, on this backend",
    )
    p.add_argument("-k", help="only tests whose name matches this regular expression")
    p.add_argument("--test-timeout", type=float, default=120.0, help="seconds per test")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--mpirun", default="mpirun", help="the mpirun command and its flags")
    p.add_argument("--log", help="where the ranks' output goes (default: a temporary file)")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args()
    args.mpirun = shlex.split(args.mpirun)
    if args.as_gloo_gate and args.backend == "gloo":
        p.error("--as-gloo-gate runs gloo's gated tests on hetcomm: use it without --backend gloo")
    t0 = time.monotonic()
    tests, skipped = select(args)
    mode = f"{args.backend} on {args.ranks} ranks" + (
        ", gloo's gated tests" if args.as_gloo_gate else ""
    )
    print(f"torch-suite: {mode}: {len(tests)} tests to start, {len(skipped)} skipped by decorators")
    if args.verbose:
        for name, why in sorted(skipped.items()):
            print(f"SKIP  {name}  (decorator: {why})")
    with tempfile.TemporaryDirectory(prefix="torch-suite-") as tmp:
        log_path = Path(args.log) if args.log else Path(tmp) / "ranks.log"
        with open(log_path, "w") as log:
            results = run_all(args, tests, Path(tmp), log) if tests else []
        for r in results:
            r["expected_gloo_only"] = bool(args.as_gloo_gate and _GLOO_ONLY.search(r["test"]))
        passed = sum(r["status"] == "pass" for r in results)
        failed = [r for r in results if r["status"] == "fail" and not r["expected_gloo_only"]]
        xfailed = [r for r in results if r["status"] == "fail" and r["expected_gloo_only"]]
        run_skips = sum(r["status"] == "skip" for r in results)
        if failed and not args.log:
            keep = Path(tempfile.gettempdir()) / f"torch-suite-{os.getpid()}.log"
            keep.write_bytes(log_path.read_bytes())
            print(f"torch-suite: the ranks' output is in {keep}")
    print(
        f"torch-suite: {mode}: {passed} passed, {len(failed)} failed and {run_skips} skipped of "
        f"{len(results)} started; {len(skipped)} skipped by decorators"
        + (f"; {len(xfailed)} gloo-only by torch's rule failed as expected" if xfailed else "")
        + f" ({time.monotonic() - t0:.0f} s)"
    )
    if failed:
        print("failed: " + " ".join(r["test"] for r in failed))
    print(f"{passed} passed, {len(failed)} failed, {run_skips + len(skipped)} skipped")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
