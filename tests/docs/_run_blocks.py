"""Run Python blocks of the docs one after the other on every rank of one mpirun.

argv: a JSON file of [[id, source], ...]. Each block runs in fresh globals as `__main__`; each
rank prints `BLOCK id ok` or `BLOCK id FAILED <error>` lines. A block is started on every rank
together (a barrier between blocks), so that one that fails on some ranks cannot leave the
others blocked in the next one.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

from mpi4py import MPI

world = MPI.COMM_WORLD
for ident, source in json.loads(Path(sys.argv[1]).read_text()):
    world.Barrier()
    print(f"START {ident}", flush=True)
    try:
        exec(compile(source, ident, "exec"), {"__name__": "__main__"})
    except SystemExit as e:
        verdict = "ok" if e.code in (None, 0) else f"FAILED SystemExit({e.code!r})"
    except BaseException:
        verdict = "FAILED " + traceback.format_exc().replace("\n", "\n    ")
    else:
        verdict = "ok"
    print(f"BLOCK {ident} rank {world.Get_rank()} {verdict}", flush=True)
