"""Per-rank shim: `python -m hetcomm.launch.shim -- CMD ...` sets the rank's environment, execs."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from .rankenv import PLAN_VARIABLE, LaunchPlan, PlanError, rank_environment

USAGE = f"usage: python -m hetcomm.launch.shim -- CMD [ARGS...]   (with {PLAN_VARIABLE} set)"


def main(argv: Sequence[str] | None = None) -> int:
    """Apply this rank's plan, then replace this process with the command (returns on failure)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        print(USAGE, file=sys.stderr)
        return 2
    text = os.environ.get(PLAN_VARIABLE)
    if text is None:
        print(
            f"hetcomm shim: {PLAN_VARIABLE} is not set; start ranks with `hetcomm run`.\n{USAGE}",
            file=sys.stderr,
        )
        return 2
    try:
        plan = LaunchPlan.from_json(text)
        allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        mine = rank_environment(plan, os.environ, allowed_cpus=allowed)
    except PlanError as e:
        print(f"hetcomm shim: {e}", file=sys.stderr)
        return 2
    env = {k: v for k, v in os.environ.items() if k != PLAN_VARIABLE}
    env.update(mine.variables)
    if mine.cpus and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, mine.cpus)  # the command inherits it across exec
        except OSError as e:
            print(f"hetcomm shim: rank {mine.rank}: cannot pin to CPUs: {e}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(args[0], args, env)
    except OSError as e:
        print(
            f"hetcomm shim: rank {mine.rank}: cannot start {args[0]!r}: {e.strerror or e}",
            file=sys.stderr,
        )
        return 127 if isinstance(e, FileNotFoundError) else 126
    return 0  # not reached: execvpe does not return


if __name__ == "__main__":
    raise SystemExit(main())
