"""torch.distributed under mpirun, for the torch backend's MPI tests: the default group on
"hetcomm" (the `pg` fixture of conftest.py) and the variables a TCP rendezvous would need."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist

import hetcomm.torch as ht

ADDRESS_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


def default_group() -> Iterator[dist.ProcessGroup]:
    """The default group on hetcomm, as `init_process_group("hetcomm")` makes it under mpirun
    (none of ADDRESS_VARS set); destroyed when the generator ends."""
    with pytest.MonkeyPatch.context() as mp:
        for var in ADDRESS_VARS:
            mp.delenv(var, raising=False)
        dist.init_process_group("hetcomm")
    group = dist.group.WORLD
    assert isinstance(group, ht.ProcessGroupHetcomm)
    yield group
    dist.destroy_process_group()
