"""Making hetcomm process groups: the creator torch calls for each new group of backend
"hetcomm" (the default group over MPI.COMM_WORLD, then groups among their members only), and
the group's timeout."""

from __future__ import annotations

import logging
import zlib
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from .errors import ArgumentError
from .group import ProcessGroupHetcomm

if TYPE_CHECKING:
    from ..comm import Communicator
    from ..config import Config

log = logging.getLogger("hetcomm")


class _State:
    world: Communicator | None = None  # the default group's Communicator, when it is hetcomm's


def group_timeout(timeout: Any, config_timeout: float) -> float:
    """The group's timeout: torch's when the user set one, else HETCOMM_TIMEOUT."""
    from torch.distributed.constants import default_pg_timeout

    if isinstance(timeout, timedelta) and timeout != default_pg_timeout:
        return max(timeout.total_seconds(), 1e-3)
    return config_timeout


def create_group(opts: Any, backend_options: Any = None) -> ProcessGroupHetcomm:
    """The creator registered with torch: called on the members of each new group only."""
    from mpi4py import MPI

    import hetcomm

    from ..comm import Communicator

    world_rank, world_size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    ranks = list(opts.global_ranks_in_group)
    rank, size, group_id = int(opts.group_rank), int(opts.group_size), str(opts.group_id)
    if not ranks:  # the default group
        if (rank, size) != (world_rank, world_size):
            raise ArgumentError(
                f"hetcomm: init_process_group was given rank {rank} of world_size {size}, but MPI "
                f"makes this process rank {world_rank} of {world_size}. hetcomm takes ranks from "
                "MPI: drop rank/world_size (and RANK/WORLD_SIZE) or make them match mpirun's"
            )
        config = with_timeout(hetcomm.Config.load(), opts.timeout)
        world = hetcomm.init(config=config, name=f"torch{group_id}")
        _State.world = world
        log.info("hetcomm.torch: default group over %d ranks", world.size)
        return _bound(ProcessGroupHetcomm(world, world.config.timeout))
    torch_rank = dist.get_rank()
    if torch_rank != world_rank or ranks[rank] != world_rank:
        raise ArgumentError(
            f"hetcomm: torch's global rank {torch_rank} is not MPI's rank {world_rank}; hetcomm "
            "groups need the default group's ranks to be MPI.COMM_WORLD's (launch with mpirun)"
        )
    parent = _State.world
    base = parent.mpi if parent is not None and not parent.closed else MPI.COMM_WORLD
    # torch makes a group on its members only, so MPI_Comm_create_group (collective over the
    # members) rather than a Split of the parent (collective over every rank)
    everyone = base.Get_group()
    group = everyone.Incl(ranks)
    sub = base.Create_group(group, zlib.crc32(group_id.encode()) & 0x7FFF)
    group.Free()
    everyone.Free()
    name = f"torch{group_id}"
    if parent is not None and not parent.closed:
        config = with_timeout(parent.config, opts.timeout)
        comm = Communicator(sub, config, parent.topology.subset(ranks), name)
    else:
        comm = hetcomm.init(
            sub, config=with_timeout(hetcomm.Config.load(), opts.timeout), name=name
        )
        sub.Free()
    return _bound(ProcessGroupHetcomm(comm, comm.config.timeout))


def with_timeout(config: Config, timeout: Any) -> Config:
    """`config` with the group's timeout (torch's where the user set one) as its own, so
    that every wait of the group's Communicator has that bound and its calls, which then need
    no timeout of their own, take their prepared routes: with a timeout per call each took
    the general path (dist.all_reduce of 8 B, timeout=600 s: 17.5-19.0 us against 10.9-11.0
    us without, 2 ranks, CPU VM, 2026-12-02)."""
    seconds = group_timeout(timeout, config.timeout)
    return config if seconds == config.timeout else config.with_options(timeout=seconds)


def _bound(pg: ProcessGroupHetcomm) -> ProcessGroupHetcomm:
    """`pg` bound to the device torch meant to bind the new group to, if any."""
    from .compat import device_being_bound

    device = device_being_bound()
    if device is not None:
        pg.bound_device_id = device
    return pg
