"""hetcomm: a communicator for mpirun-launched training jobs on GPUs of several vendors."""

from __future__ import annotations

from importlib import metadata as _metadata
from typing import TYPE_CHECKING, Any

from .config import Config
from .errors import (
    CommAborted,
    CommTimeout,
    ConfigError,
    DtypeError,
    HetcommError,
    InvalidArgument,
    MismatchError,
    PeerLost,
    TopologyError,
    TransportUnavailable,
)
from .layout import LayoutError, ParallelLayout
from .ops import ReduceOp
from .work import Work

if TYPE_CHECKING:
    from .comm import Communicator
    from .groups import ParallelGroups

try:
    # one source of the version: pyproject.toml, as the installed metadata carries it
    __version__ = _metadata.version("hetcomm")
except _metadata.PackageNotFoundError:  # imported from a checkout that was never installed
    __version__ = "0+unknown"

#: `Communicator.recv(x, src=ANY_SOURCE)` takes the next matching message from any rank and
#: returns (or its Work carries, `work.source`) the rank it came from. Not -1: a rank computed
#: as -1 by mistake stays an error instead of receiving from whoever sends first.
ANY_SOURCE = -(2**31)

# kernels/ and launch/ sit beside hetcomm/ in the repository and install as hetcomm.kernels and
# hetcomm.launch by pyproject's package mapping; a checkout imports them through its editable
# install (pip install -e .), never by widening this package's __path__.

__all__ = [
    "ANY_SOURCE",
    "CommAborted",
    "CommTimeout",
    "Communicator",
    "Config",
    "ConfigError",
    "DtypeError",
    "HetcommError",
    "InvalidArgument",
    "LayoutError",
    "MismatchError",
    "ParallelGroups",
    "ParallelLayout",
    "PeerLost",
    "ReduceOp",
    "TopologyError",
    "TransportUnavailable",
    "Work",
    "init",
]


def init(
    comm: Any = None, config: Config | None = None, *, name: str | None = None
) -> Communicator:
    """A Communicator over a Dup of `comm` (default MPI.COMM_WORLD); collective over `comm`.

    `config` defaults to Config.load() (HETCOMM_* variables, then defaults); values that
    `hetcomm tune` measured for this topology fill what the configuration leaves open. The
    caller keeps `comm`; hetcomm owns and frees only its Dup.
    """
    from mpi4py import MPI

    from . import topology
    from .comm import Communicator

    if comm is None:
        comm = MPI.COMM_WORLD
    elif isinstance(comm, Communicator):
        comm = comm.mpi
    elif not isinstance(comm, MPI.Intracomm):
        raise InvalidArgument(
            f"init: expected an mpi4py Intracomm or a hetcomm Communicator, "
            f"got {type(comm).__qualname__}"
        )
    config = Config.load() if config is None else config
    if not isinstance(config, Config):
        raise InvalidArgument(f"init: config must be a hetcomm.Config, got {type(config).__name__}")
    _configure_logging(config)
    dup = comm.Dup()
    try:
        topo = topology.gather(dup, config)
        from .transports.direct.peer import probe

        topo = topo.with_peer_mapping(
            probe(
                dup, [r.node for r in topo.ranks], [r.device_index is not None for r in topo.ranks]
            )
        )
        from . import tuning

        # values `hetcomm tune` measured for this topology, the same on every rank; a config
        # that already carries some (a sub-communicator's) keeps them
        tuned = (
            config.tuned
            if config.tuned is not None
            else tuning.lookup(dup, topo.fingerprint(), config)
        )
        config = tuning.adopt(config, tuned)
    except BaseException:
        dup.Free()
        raise
    return Communicator(dup, config, topo, name or ("world" if comm == MPI.COMM_WORLD else "comm"))


def _configure_logging(config: Config) -> None:
    import logging

    logger = logging.getLogger("hetcomm")
    logger.setLevel(config.log.upper())
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("hetcomm %(levelname)s: %(message)s"))
        logger.addHandler(handler)


def __getattr__(name: str) -> Any:
    # Communicator and ParallelGroups import mpi4py.MPI, which initialises MPI: load them on
    # first use so that `import hetcomm` stays cheap and MPI-free (config, layout, plan).
    if name == "Communicator":
        from .comm import Communicator

        return Communicator
    if name == "ParallelGroups":
        from .groups import ParallelGroups

        return ParallelGroups
    raise AttributeError(f"module 'hetcomm' has no attribute {name!r}")
