"""One rank of PyTorch's backend suite under mpirun: torch's own per-test runner, test by test.

Run by tests/torch_suite/driver.py (scripts/torch-suite), never by pytest. Every rank calls
`TestDistBackend._run(rank, test, init_file, pipe)` for each test of the list, as the processes
that torch's `MultiProcessTestCase` spawns do, and reads its exit code (`sys.exit`) as
`MultiProcessTestCase._check_return_codes` does. A watchdog thread per rank bounds each test:
rank 0 collects every rank's exit code over MPI, decides the outcome and tells the others; when a
rank is still inside the test at that point (an error on another rank, or the time limit), every
rank leaves the process and the driver starts a new mpirun from the next test.

The glue is the suite's own configuration, nothing more: the backend is registered (`import
hetcomm.torch`), "hetcomm" joins every capability table that names gloo, and the environment is
the one torch's runner gives (BACKEND, WORLD_SIZE, TEMP_DIR, INIT_METHOD). No test is edited or
skipped here.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import threading
import time
import traceback
from typing import Any

_GATE_BACKEND = "gloo"


class _GatedName(str):
    """The backend's name for a gated run: its value (what torch makes a group of) is the
    backend's, and it compares equal to gloo's name as well, so that a test body which sets up
    for gloo by name (`if BACKEND == "gloo": ...`) sets up for this backend the same way, as
    the decorators that let it start did."""

    def __eq__(self, other: object) -> bool:
        return other == _GATE_BACKEND or str.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    __hash__ = str.__hash__


def configure(backend: str, gate: bool, world_size: int) -> Any:
    """Import torch's suite for `backend`; `gate`: its decorators see gloo, the tests hetcomm.

    Returns the test class (TestDistBackend + DistributedTest._DistTestBase, as torch's
    test/distributed/test_distributed_spawn.py makes it)."""
    os.environ["BACKEND"] = _GATE_BACKEND if gate else backend
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ.setdefault("INIT_METHOD", "file:///dev/null")  # replaced per test (fresh())
    import torch.distributed as dist

    if backend == "hetcomm":
        import hetcomm.torch  # noqa: F401  (registers the backend)
    from torch.testing._internal import common_distributed as cd

    # "hetcomm" can do what gloo can: it joins each table that names gloo. Before the suite's
    # import, since its skip decorators read the tables then.
    for backends in cd.DistTestCases.backend_feature.values():
        if "gloo" in backends:
            backends.add("hetcomm")
    from torch.testing._internal.distributed import distributed_test as dt

    for table in (
        dt.PROFILING_SUPPORTED_BACKENDS,
        dt.CUDA_PROFILING_SUPPORTED_BACKENDS,
        dt.SEND_RECV_PROFILING_SUPPORTED_BACKENDS,
    ):
        if dist.Backend.GLOO in table and backend not in table:
            table.append(backend)
    if gate:
        # the gates have been read (as gloo's); the tests themselves run on `backend`
        dt.BACKEND = _GatedName(backend)
        os.environ["BACKEND"] = backend

    class TestDistBackendWithSpawn(dt.TestDistBackend, dt.DistributedTest._DistTestBase):
        pass

    return TestDistBackendWithSpawn


def listing(cls: Any) -> list[tuple[str, str | None]]:
    """Every test of the suite and its skip reason when unittest skips it before any process
    starts (a skip decorator), else None."""
    out = []
    for name in sorted(dir(cls)):
        if not name.startswith("test"):
            continue
        fn = getattr(cls, name)
        if not callable(fn):
            continue
        why = (
            getattr(fn, "__unittest_skip_why__", None)
            if getattr(fn, "__unittest_skip__", False)
            else None
        )
        out.append((name, why))
    return out


# exit codes, as torch's MultiProcessTestCase reads them
_ERROR_EXIT = 10  # MultiProcessTestCase.TEST_ERROR_EXIT_CODE
# tests whose exit code torch does not check (TestDistBackend.setUp)
_NO_CODE_CHECK = ("test_ddp_has_finalized",)
_ERROR_GRACE_S = 5.0


def outcome(test: str, codes: list[int | None], tracebacks: list[str]) -> tuple[str, str]:
    """(status, detail) for one test from every rank's exit code (None: still running), the way
    MultiProcessTestCase._check_return_codes decides."""
    from torch.testing._internal.common_distributed import TEST_SKIPS

    errored = [r for r, c in enumerate(codes) if c == _ERROR_EXIT]
    if errored:
        detail = "".join(
            f"rank {r} exited with error code {_ERROR_EXIT} and exception:\n{tracebacks[r]}\n"
            for r in errored
        )
        return "fail", detail
    late = [r for r, c in enumerate(codes) if c is None]
    if late:
        return "fail", f"ranks {late} terminated or timed out"
    if test in _NO_CODE_CHECK:
        return "pass", ""
    for skip in TEST_SKIPS.values():
        if codes[0] == skip.exit_code:
            return "skip", skip.message
    if codes[0] != 0:
        return "fail", f"expected exit code 0 but rank 0 got {codes[0]}"
    return "pass", ""


class Watch:
    """The per-test watchdog of one rank (a thread): rank 0 gathers the exit codes and decides;
    every rank learns the decision and leaves the process when its test is still running."""

    def __init__(self, comm: Any, index: int, limit: float, results: str) -> None:
        self.comm, self.index, self.limit, self.results = comm, index, limit, results
        self.decided = threading.Event()
        self.decision: dict[str, Any] = {}
        self.running = True
        self.my_code: int | None = None
        self.my_tb = ""
        self._mine = threading.Event()

    def finished(self, code: int, tb: str) -> None:
        """Called by the main thread once its test has exited with `code`."""
        self.my_code, self.my_tb = code, tb
        self.running = False
        self._mine.set()

    def serve(self, test: str, t0: float) -> None:
        comm, size, tag = self.comm, self.comm.Get_size(), 1000 + 2 * self.index
        if comm.Get_rank() != 0:
            request = comm.irecv(source=0, tag=tag + 1)
            sent = False
            while True:
                if not sent and self._mine.is_set():
                    comm.send((self.my_code, self.my_tb), dest=0, tag=tag)
                    sent = True
                done, decision = request.test()
                if done:
                    break
                time.sleep(0.01)
        else:
            codes: list[int | None] = [None] * size
            tbs = [""] * size
            requests = {r: comm.irecv(source=r, tag=tag) for r in range(1, size)}
            deadline = t0 + self.limit
            while True:
                if self._mine.is_set():
                    codes[0], tbs[0] = self.my_code, self.my_tb
                for r, request in list(requests.items()):
                    done, got = request.test()
                    if done:
                        codes[r], tbs[r] = got
                        del requests[r]
                now = time.monotonic()
                if None not in codes or now > deadline:
                    break
                if _ERROR_EXIT in codes:
                    # torch ends the other processes at once; give them a moment to end the
                    # test themselves (they usually fail the same way), which spares a restart
                    deadline = min(deadline, now + _ERROR_GRACE_S)
                time.sleep(0.01)
            status, detail = outcome(test, codes, tbs)
            if None in codes and _ERROR_EXIT not in codes:
                detail = f"timed out after {self.limit:.0f} s: " + detail
            decision = {
                "status": status,
                "detail": detail,
                "restart": None in codes,
                "seconds": round(time.monotonic() - t0, 2),
            }
            for r in range(1, size):
                comm.send(decision, dest=r, tag=tag + 1)
            with open(self.results, "a") as f:
                f.write(json.dumps({"test": test, **decision}) + "\n")
        self.decision = decision
        self.decided.set()
        if decision["restart"] and self.running:
            # this rank is still inside the test and cannot be brought back: leave the process
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(3)


def run_test(
    cls: Any, comm: Any, test: str, index: int, limit: float, results: str
) -> dict[str, Any]:
    """Run `test` on this rank with torch's runner; return rank 0's decision."""
    import multiprocessing

    from torch.testing._internal import common_distributed as cd
    from torch.testing._internal.distributed import distributed_test as dt

    rank = comm.Get_rank()
    fresh = None
    if rank == 0:
        cd.initialize_temp_directories()  # TEMP_DIR with barrier/, test_dir/, init_dir/
        with tempfile.NamedTemporaryFile(delete=False) as f:
            init_file = f.name
        fresh = (os.environ["TEMP_DIR"], os.environ["INIT_METHOD"], init_file)
    temp_dir, init_method, init_file = comm.bcast(fresh, root=0)
    os.environ["TEMP_DIR"], os.environ["INIT_METHOD"] = temp_dir, init_method
    dt.INIT_METHOD = init_method  # read by the suite at import; torch's runner sets it per run
    dt.Barrier.barrier_id = 0  # what Barrier.init() resets (rank 0 made the directory empty)
    comm.Barrier()

    watch = Watch(comm, index, limit, results)
    t0 = time.monotonic()
    thread = threading.Thread(target=watch.serve, args=(test, t0), daemon=True)
    thread.start()
    ours, theirs = multiprocessing.Pipe()
    code, tb = 0, ""
    try:
        cls._run(rank, test, init_file, theirs)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        code, tb = _ERROR_EXIT, traceback.format_exc()
    if code == _ERROR_EXIT and not tb:
        try:
            tb = ours.recv() if ours.poll(1) else ""
        except (EOFError, OSError):
            tb = ""
    watch.finished(code, tb)
    watch.decided.wait()
    decision = watch.decision
    ours.close()
    # a test that failed part-way leaves its groups behind; a spawned process would have exited
    import torch.distributed as dist

    if not decision["restart"] and dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    if not decision["restart"]:
        # every rank has let go of the test's stores before rank 0 removes their files: a
        # FileStore's destructor still reads its file, and one removed under it reads forever
        comm.Barrier()
    if rank == 0:
        cd.cleanup_temp_dir()
        with contextlib.suppress(OSError):
            os.unlink(init_file)
    return decision


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="hetcomm")
    p.add_argument("--as-gloo-gate", action="store_true")
    p.add_argument("--world-size", type=int, default=0, help="with --list: the rank count")
    p.add_argument("--list", action="store_true", help="print the tests as JSON and exit")
    p.add_argument("--tests", help="a file of test names, one per line, to run in order")
    p.add_argument("--results", help="rank 0 appends one JSON line per test here")
    p.add_argument("--test-timeout", type=float, default=120.0)
    args = p.parse_args()
    if args.list:
        cls = configure(args.backend, args.as_gloo_gate, args.world_size)
        json.dump(listing(cls), sys.stdout)
        return
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    comm = world.Dup()  # the harness's own messages, apart from everything the tests do
    cls = configure(args.backend, args.as_gloo_gate, world.Get_size())
    with open(args.tests) as f:
        tests = [line.strip() for line in f if line.strip()]
    for index, test in enumerate(tests):
        decision = run_test(cls, comm, test, index, args.test_timeout, args.results)
        if decision["restart"]:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(3)  # a rank is still inside the test: the driver starts a new mpirun
    comm.Barrier()


if __name__ == "__main__":
    main()
