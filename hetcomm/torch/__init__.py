"""torch.distributed backend "hetcomm": unchanged PyTorch code runs on hetcomm Communicators."""

from __future__ import annotations

import torch.distributed as dist

from ..torch_hint import wrap as _hinted

# `name as name`: re-exported, among them the private names tests/unit/test_torch_compat.py uses
from .compat import _FULLY_SHARD_MODULES as _FULLY_SHARD_MODULES
from .compat import API_NAMES, BACKEND, METHOD_NAMES, dist_function, fully_shard, reduce_op
from .compat import rendezvous_handlers as rendezvous_handlers
from .create import create_group
from .errors import ArgumentError
from .group import ProcessGroupHetcomm
from .store import _LAUNCHER_VARS as _LAUNCHER_VARS
from .store import MpiStore, _env_or_mpi, _mpi_rendezvous
from .tensors import _NATIVE as _NATIVE
from .tensors import _dtype_name as _dtype_name
from .tensors import _movable as _movable
from .tensors import _opt as _opt
from .tensors import _reducible as _reducible
from .tensors import _restore as _restore
from .tensors import split_rows as split_rows
from .work import _PROGRESS as _PROGRESS
from .work import _Pending as _Pending
from .work import _Work as _Work

__all__ = [
    "API_NAMES",
    "ArgumentError",
    "BACKEND",
    "METHOD_NAMES",
    "MpiStore",
    "ProcessGroupHetcomm",
    "dist_function",
    "fully_shard",
    "reduce_op",
]


def _register() -> None:
    dist.Backend.register_backend(BACKEND, create_group, extended_api=True, devices=["cpu", "cuda"])
    handlers = rendezvous_handlers()
    handlers["mpi"] = _mpi_rendezvous
    env = handlers.get("env")
    if env is not None and not hasattr(env, "hetcomm_wraps"):
        # torch's own error, when RANK is missing and no launcher is there, says how to start
        handlers["env"] = _env_or_mpi(_hinted(env, imported=True))


_register()
