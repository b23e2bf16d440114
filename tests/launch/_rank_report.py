"""One rank's report for the launch tests: its environment and what hetcomm.init() sees, as JSON."""

from __future__ import annotations

import json
import os
import sys

import hetcomm

PREFIXES = ("HETCOMM_", "_HETCOMM", "CUDA_", "HIP_", "ROCR_", "UCX_", "OMPI_ALLOW")

world = hetcomm.init()
if len(sys.argv) > 1 and sys.argv[1] == "raise" and world.rank == 1:
    raise RuntimeError("rank 1 fails on purpose")
topology = world.topology
report = {
    "rank": world.rank,
    "size": world.size,
    "env": {k: v for k, v in os.environ.items() if k.startswith(PREFIXES)},
    "timeout": world.config.timeout,
    "vendors": [r.vendor for r in topology],
    "hosts": [r.host for r in topology],
    "local_ranks": [r.local_rank for r in topology],
    "islands": [list(i) for i in topology.islands()],
}
world.barrier()  # a rank that raised never arrives: the others must not wait here forever
print("REPORT " + json.dumps(report), flush=True)
world.close()
