"""A hint for the one mistake torch explains badly: `init_process_group("hetcomm")` under mpirun
without `import hetcomm.torch`.

Without that import, torch does not know the backend yet and first runs its env:// rendezvous,
which fails with "environment variable RANK expected, but not set": mpirun sets its own rank
variables, not torch's. torch calls `autoload()` when it is imported (the `torch.backends`
entry point of hetcomm's package metadata; `TORCH_DEVICE_BACKEND_AUTOLOAD=0` turns that off).
It only wraps torch's env:// handler so that this one error, in a process an MPI launcher
started, says what to do; it imports nothing of hetcomm's communication code, starts no MPI,
and changes no behaviour.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

# variables by which MPI launchers mark a rank (as hetcomm.torch.store._LAUNCHER_VARS)
_LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE", "PMI_RANK", "MPI_LOCALNRANKS")

HINT = (
    "this process was started by an MPI launcher, which does not set torch's RANK: for "
    'init_process_group("hetcomm"), `import hetcomm.torch` first (it registers the backend, '
    "which takes rank and world size from MPI); for another backend, start the job with "
    "`hetcomm run --nproc-per-node N script.py`, which sets RANK, WORLD_SIZE, MASTER_ADDR and "
    "MASTER_PORT as torchrun does"
)


# with hetcomm.torch imported, in a process that no launcher started
UNLAUNCHED = (
    "hetcomm.torch is imported, but no MPI launcher started this process and RANK is not set: "
    "start the job with `mpirun -n N python -m mpi4py script.py` or `hetcomm run -n N -- python "
    "script.py` (plain torchrun is not supported: `hetcomm run` takes torchrun's options "
    'instead); for a single process, use init_method="mpi://"'
)


def explain(error: ValueError, environ: Any = os.environ, imported: bool = False) -> ValueError:
    """`error` with a hint added when it is torch's missing-RANK error: under an MPI launcher
    (hetcomm.torch not imported, or `imported` false), or with hetcomm.torch imported and no
    launcher."""
    if "RANK" not in str(error):
        return error
    imported = imported or "hetcomm.torch" in sys.modules
    launched = any(environ.get(v) for v in _LAUNCHER_VARS)
    if launched and not imported:
        return ValueError(f"{error}. hetcomm: {HINT}")
    if imported and not launched:
        return ValueError(f"{error}. hetcomm: {UNLAUNCHED}")
    return error


def wrap(handler: Callable[..., Iterator[Any]], imported: bool = False) -> Callable[..., Any]:
    """torch's env:// rendezvous handler, with explain() applied to what it raises (once: a
    handler wrapped already, by autoload, is wrapped afresh from the handler it wraps)."""
    handler = getattr(handler, "hetcomm_hint", handler)

    def env_rendezvous(url: str, *args: Any, **kwargs: Any) -> Iterator[Any]:
        it = handler(url, *args, **kwargs)
        try:
            first = next(it)
        except ValueError as e:
            raise explain(e, imported=imported) from e
        yield first
        yield from it

    env_rendezvous.hetcomm_hint = handler  # type: ignore[attr-defined]
    env_rendezvous.hetcomm_imported = imported  # type: ignore[attr-defined]
    return env_rendezvous


def autoload() -> None:
    """Called by torch at import (entry point `torch.backends`): add the hint to env://."""
    try:
        import importlib

        # the module, not the function torch.distributed exports under the same name
        handlers = importlib.import_module("torch.distributed.rendezvous")._rendezvous_handlers
        env = handlers.get("env")
        if env is not None and not hasattr(env, "hetcomm_hint"):
            handlers["env"] = wrap(env)
    except Exception:
        pass
