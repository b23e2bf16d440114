"""A script written for torchrun (it reads RANK, WORLD_SIZE, ... and uses env://), run by
`hetcomm run` with torchrun's options in tests/launch/test_torchrun.py; prints one REPORT line."""

from __future__ import annotations

import json
import os
import sys

import hetcomm

world = hetcomm.init()
report = {
    "rank": world.rank,
    "size": world.size,
    "python": sys.executable,
    "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")},
}
try:
    import torch
except ImportError:
    report["torch"] = None
else:
    import torch.distributed as dist

    import hetcomm.torch  # registers the backend

    dist.init_process_group("hetcomm")  # env:// through MASTER_ADDR/MASTER_PORT, as under torchrun
    x = torch.full((4,), float(dist.get_rank() + 1), dtype=torch.float64)
    dist.all_reduce(x)
    report["torch"] = {"rank": dist.get_rank(), "size": dist.get_world_size(), "sum": x.tolist()}
    dist.destroy_process_group()
print("REPORT " + json.dumps(report), flush=True)
world.close()
