"""torchrun's command line in `hetcomm run`: its options, and the variables its scripts read.

A torchrun command works under `hetcomm run` with only the program name changed:
`torchrun --nproc-per-node 4 train.py --lr 3` becomes `hetcomm run --nproc-per-node 4 train.py
--lr 3`. The MPI launcher starts the ranks instead of torch's elastic agent; each rank still
finds RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR and MASTER_PORT,
as torchrun sets them, so `init_process_group` (hetcomm, gloo or nccl) and scripts that read
those variables run unchanged. Elastic features (restarts, ranges of node counts) do not exist
under MPI and are refused.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DEFAULT_PORT = 29500  # torchrun's
# options of torchrun that mean nothing under an MPI launcher: accepted, reported, ignored
_IGNORED = ("rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf", "monitor_interval", "role")
# set by torchrun's agent in every process it starts (and by nothing else)
AGENT_VARIABLE = "TORCHELASTIC_RUN_ID"


class TorchrunError(ValueError):
    """A torchrun option that cannot be honoured under an MPI launcher; the message says why."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """torchrun's options, under both of its spellings (--nproc-per-node, --nproc_per_node)."""
    g = p.add_argument_group(
        "torchrun's options", "a torchrun command line runs with only the program name changed"
    )

    def both(name: str, **kw: Any) -> None:
        flags = [f"--{name.replace('_', '-')}"]
        if "_" in name:
            flags.append(f"--{name}")
        g.add_argument(*flags, dest=f"torchrun_{name}", **kw)

    both("nproc_per_node", metavar="N", help="ranks per node: a number, gpu, cpu or auto")
    both("nnodes", metavar="N", help="nodes (N or N:N; elastic ranges are refused)")
    both("node_rank", type=int, metavar="I", help="this node's index (0 starts every node)")
    both("master_addr", metavar="HOST", help="MASTER_ADDR for the ranks (default: first host)")
    both("master_port", type=int, metavar="PORT", help=f"MASTER_PORT (default {DEFAULT_PORT})")
    both("standalone", action="store_true", help="one node (the default here)")
    both("max_restarts", type=int, metavar="K", help="only 0: MPI jobs are not restarted")
    both("no_python", action="store_true", help="run the command as given, not with python")
    g.add_argument(
        "-m", "--module", dest="torchrun_module", action="store_true", help="python -m SCRIPT"
    )
    for name in _IGNORED:
        both(name, metavar="X", help=argparse.SUPPRESS)


@dataclass(frozen=True)
class TorchrunLaunch:
    """What torchrun's options asked for, resolved."""

    n: int  # ranks in all
    per_node: int
    nnodes: int
    node_rank: int
    master_addr: str | None  # None: the first host of the job
    master_port: int
    notes: tuple[str, ...]


def used(args: argparse.Namespace) -> bool:
    """Whether any of torchrun's options was given."""
    return any(v not in (None, False) for k, v in vars(args).items() if k.startswith("torchrun_"))


def _count(text: str, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise TorchrunError(f"{what}: expected a number, got {text!r}") from None
    if value < 1:
        raise TorchrunError(f"{what}: expected a positive number, got {value}")
    return value


def per_node(text: str | None, gpus: int, cpus: int) -> int:
    """torchrun's --nproc-per-node: a number, `gpu` (one per GPU), `cpu` (one per core), `auto`."""
    if text is None:
        return 1
    if text == "gpu":
        if gpus == 0:
            raise TorchrunError("--nproc-per-node gpu: no GPU is visible on this host")
        return gpus
    if text == "cpu":
        return cpus
    if text == "auto":
        return gpus or cpus
    return _count(text, "--nproc-per-node")


def nodes(text: str | None) -> int:
    """torchrun's --nnodes: N, or N:N (a range of node counts is elastic: refused)."""
    if text is None:
        return 1
    low, _, high = text.partition(":")
    first = _count(low, "--nnodes")
    if high and _count(high, "--nnodes") != first:
        raise TorchrunError(
            f"--nnodes {text}: an elastic range of node counts cannot be run by an MPI launcher "
            "(the job's size is fixed when it starts); give one count"
        )
    return first


def resolve(args: argparse.Namespace, gpus: int, cpus: int) -> TorchrunLaunch:
    """The launch that torchrun's options in `args` describe (`gpus`, `cpus`: of this host)."""
    notes: list[str] = []
    restarts = args.torchrun_max_restarts
    if restarts not in (None, 0):
        raise TorchrunError(
            f"--max-restarts {restarts}: an MPI job is not restarted when a rank fails (the "
            "whole job ends); give 0 or leave it out"
        )
    k = per_node(args.torchrun_nproc_per_node, gpus, cpus)
    m = nodes(args.torchrun_nnodes)
    if args.torchrun_standalone and m != 1:
        raise TorchrunError(f"--standalone is one node, but --nnodes is {m}")
    node_rank = args.torchrun_node_rank or 0
    if not 0 <= node_rank < m:
        raise TorchrunError(f"--node-rank: expected 0..{m - 1}, got {node_rank}")
    for name in _IGNORED:
        value = getattr(args, f"torchrun_{name}")
        if value is not None:
            flag = name.replace("_", "-")
            notes.append(f"--{flag} {value} ignored: the MPI launcher starts and joins the ranks")
    port = args.torchrun_master_port or DEFAULT_PORT
    addr = args.torchrun_master_addr
    if addr is None and m == 1:
        addr = "127.0.0.1"
    notes.append(
        f"torchrun's variables for each rank: WORLD_SIZE={k * m}, LOCAL_WORLD_SIZE={k}, "
        f"MASTER_ADDR={addr or '(first host)'}, MASTER_PORT={port}"
    )
    return TorchrunLaunch(k * m, k, m, node_rank, addr, port, tuple(notes))


def started_by_torchrun(environ: Mapping[str, str]) -> bool:
    """Whether this process was started by torchrun's agent (it sets TORCHELASTIC_RUN_ID)."""
    return bool(environ.get(AGENT_VARIABLE))


def rank_variables(
    rank: int, local: int, size: int, local_size: int, addr: str, port: int
) -> dict[str, str]:
    """The variables torchrun gives process `rank` (node index: rank // local_size)."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(local),
        "WORLD_SIZE": str(size),
        "LOCAL_WORLD_SIZE": str(local_size),
        "GROUP_RANK": str(rank // local_size),
        "GROUP_WORLD_SIZE": str(-(-size // local_size)),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(size),
        "MASTER_ADDR": addr,
        "MASTER_PORT": str(port),
    }


def cpu_count() -> int:
    """The CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
