"""torch.distributed backend "hetcomm": unchanged PyTorch code runs on hetcomm Communicators.

`import hetcomm.torch` registers the backend; under mpirun `dist.init_process_group("hetcomm")`
then needs no address, port, rank or world size (they come from MPI). Each process group is a
`ProcessGroupHetcomm` (a Python `torch.distributed.ProcessGroup`) over its own Communicator, so
every group has its own plan. docs/torch.md is the user's guide; this docstring is the design:

- Operations start at once (non-blocking hetcomm calls, in issue order) and return a `Work`.
  `Work.wait()` drives the operation on the calling thread; a daemon thread polls the rest so that
  `Work.get_future()` completes without a wait (DDP waits on futures only).
- Names torch changed between 2.4 and today live in one table, `METHOD_NAMES`.
- A store is needed only by torch itself (and by gloo groups made beside hetcomm ones): under
  mpirun `env://` without MASTER_ADDR/MASTER_PORT, and `mpi://` always, rendezvous over
  `MpiStore`, a torch Store kept by rank 0 and reached over MPI (no network setup).
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import parse_qsl, urlparse

import torch
import torch.distributed as dist

from .errors import CommTimeout, DtypeError
from .ops import ReduceOp

if TYPE_CHECKING:
    from .comm import Communicator
    from .work import Work as HetcommWork

__all__ = ["API_NAMES", "BACKEND", "METHOD_NAMES", "MpiStore", "ProcessGroupHetcomm",
           "dist_function", "fully_shard", "reduce_op"]  # fmt: skip

BACKEND = "hetcomm"
log = logging.getLogger("hetcomm")

# ---- compatibility: what torch 2.4 .. 2.13 call ------------------------------------------------

#: canonical operation -> every method name a torch version calls for it (newest first). torch
#: 2.13 renamed the tensor-in/tensor-out collectives; older versions call the names after the first.
METHOD_NAMES: dict[str, tuple[str, ...]] = {
    "all_gather_single": ("all_gather_single", "_allgather_base"),
    "reduce_scatter_single": ("reduce_scatter_single", "_reduce_scatter_base"),
    "all_to_all_single": ("all_to_all_single", "alltoall_base"),
    "all_gather_single_coalesced": ("all_gather_single_coalesced",
                                    "allgather_into_tensor_coalesced"),
    "reduce_scatter_single_coalesced": ("reduce_scatter_single_coalesced",
                                        "reduce_scatter_tensor_coalesced"),
    "start_coalescing": ("start_coalescing", "_start_coalescing"),
    "end_coalescing": ("end_coalescing", "_end_coalescing"),
}  # fmt: skip
#: canonical torch.distributed function -> its names, newest first (2.13 deprecated the others)
API_NAMES: dict[str, tuple[str, ...]] = {
    "all_gather_single": ("all_gather_single", "all_gather_into_tensor"),
    "reduce_scatter_single": ("reduce_scatter_single", "reduce_scatter_tensor"),
}
# where FSDP2's fully_shard lives: torch >= 2.6, then 2.4 - 2.5
_FULLY_SHARD_MODULES = ("torch.distributed.fsdp", "torch.distributed._composable.fsdp")
# the module whose private table maps URL schemes to rendezvous handlers (all of 2.4 .. 2.13)
_RENDEZVOUS_MODULE, _RENDEZVOUS_TABLE = "torch.distributed.rendezvous", "_rendezvous_handlers"
# environment variables by which MPI launchers (Open MPI, MPICH/Hydra, Intel MPI, PMIx) mark a rank
_LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE", "PMI_RANK", "MPI_LOCALNRANKS")


def fully_shard(*args: Any, **kwargs: Any) -> Any:
    """FSDP2's `fully_shard` from wherever this torch keeps it."""
    import importlib

    for name in _FULLY_SHARD_MODULES:
        try:
            found = getattr(importlib.import_module(name), "fully_shard", None)
        except ImportError:
            continue
        if found is not None:
            return found(*args, **kwargs)
    raise RuntimeError(f"this torch ({torch.__version__}) has no FSDP2 fully_shard")


def dist_function(canonical: str) -> Callable[..., Any]:
    """The torch.distributed function for `canonical` under the name this torch uses."""
    for name in API_NAMES.get(canonical, (canonical,)):
        found = getattr(dist, name, None)
        if found is not None:
            return found
    raise AttributeError(f"this torch ({torch.__version__}) has no torch.distributed.{canonical}")


def rendezvous_handlers() -> dict[str, Callable[..., Iterator[tuple[Any, int, int]]]]:
    """torch's table of rendezvous handlers (URL scheme -> handler)."""
    import importlib

    return getattr(importlib.import_module(_RENDEZVOUS_MODULE), _RENDEZVOUS_TABLE)


# ---- reduce ops ---------------------------------------------------------------------------------

_OPS = {"SUM": ReduceOp.SUM, "AVG": ReduceOp.AVG, "PRODUCT": ReduceOp.PROD,
        "MIN": ReduceOp.MIN, "MAX": ReduceOp.MAX}  # fmt: skip


def reduce_op(op: Any, what: str = "reduce") -> ReduceOp:
    """hetcomm's ReduceOp for a torch ReduceOp (or its RedOpType); ValueError naming the rest."""
    kind = getattr(op, "op", op)  # ReduceOp objects carry a RedOpType in .op
    name = getattr(kind, "name", None) or str(kind).rpartition(".")[2]
    found = _OPS.get(name)
    if found is None:
        raise ValueError(
            f"hetcomm {what}: ReduceOp.{name} is not supported; use SUM, AVG, PRODUCT, MIN or MAX"
        )
    return found


# ---- operations in flight -----------------------------------------------------------------------

_NATIVE = frozenset(("bool", "int8", "int16", "int32", "int64", "uint8", "float16", "bfloat16",
                     "float32", "float64"))  # fmt: skip


class _Pending:
    """One torch-level operation: hetcomm Works, steps to run after them, the result, a future."""

    __slots__ = ("_after", "_lock", "_works", "deadline", "done", "error", "future", "limit",
                 "name", "result")  # fmt: skip

    def __init__(self, name: str, works: list[Any], after: list[Callable[[], None]],
                 result: list[torch.Tensor], limit: float) -> None:  # fmt: skip
        self.name, self._works, self._after, self.result = name, works, after, result
        self.limit = limit
        self.deadline = time.monotonic() + limit
        self.done = False
        self.error: BaseException | None = None
        self._lock = threading.RLock()
        devices = sorted({t.device for t in result if t.device.type != "cpu"}, key=str)
        self.future: torch.futures.Future = torch.futures.Future(
            devices=list[int | str | torch.device](devices) or None)

    def poll(self) -> bool:
        """True once complete (never blocks; skips when another thread is completing it)."""
        if self.done:
            return True
        if not self._lock.acquire(blocking=False):
            return False
        try:
            return self.done or self._advance(self.deadline, self.limit)
        finally:
            self._lock.release()

    def test(self) -> bool:
        """poll(), raising what the operation failed with (so a _Pending can be a part)."""
        if self.poll() and self.error is not None:
            raise self.error
        return self.done

    def wait(self, timeout: float | None = None) -> None:
        """Block until complete (at most `timeout` s, default the group's); raise what the
        operation failed with."""
        if not self.done:
            if timeout is None:
                deadline, limit = self.deadline, self.limit
            else:
                deadline, limit = time.monotonic() + timeout, timeout
            with self._lock:
                spin_until = time.monotonic() + _SPIN_S
                sleep = _POLL_MIN_S
                while not self.done and not self._advance(deadline, limit):
                    if time.monotonic() < spin_until:
                        continue
                    time.sleep(sleep)
                    sleep = min(sleep * 2, _WAIT_MAX_S)
        if self.error is not None:
            raise self.error

    def _advance(self, deadline: float, limit: float) -> bool:
        """One non-blocking step, under the lock: True once complete (or failed)."""
        try:
            while self._works:
                if not self._works[0].test():
                    if time.monotonic() > deadline:
                        self._expire(self._works[0], limit)
                    return False
                self._works.pop(0)
            for step in self._after:
                step()
        except BaseException as exc:
            self._fail(exc)
        else:
            self._complete()
        return True

    def _expire(self, work: Any, limit: float) -> None:
        # hetcomm's own wait raises CommTimeout and aborts the communicator; say how long it was
        try:
            work.wait(timeout=1e-3)
        except CommTimeout as exc:
            raise CommTimeout(exc.group, exc.op, exc.seq, limit) from exc

    def _complete(self) -> None:
        self.done = True
        self.future.set_result(self.result)

    def _fail(self, exc: BaseException) -> None:
        self.done, self.error = True, exc
        self.future.set_exception(exc)


class _Progress:
    """A daemon thread completing operations nobody waits on, in issue order per group."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queues: dict[int, collections.deque[_Pending]] = {}
        self._thread: threading.Thread | None = None
        self._stop = False

    def add(self, key: int, pending: _Pending) -> None:
        with self._cond:
            self._queues.setdefault(key, collections.deque()).append(pending)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hetcomm-torch-progress",
                                                daemon=True)  # fmt: skip
                self._thread.start()
                _at_exit(self.stop)
            self._cond.notify()

    def drain(self, key: int, timeout: float) -> None:
        """Wait for the operations of group `key` still in flight (at most `timeout` s)."""
        with self._cond:
            queue = list(self._queues.pop(key, ()))
        for pending in queue:
            try:
                pending.wait(timeout)
            except BaseException as exc:
                log.warning("hetcomm: %s did not end cleanly at shutdown: %s", pending.name, exc)

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        sleep = _POLL_MIN_S
        while True:
            with self._cond:
                while not self._stop and not any(self._queues.values()):
                    self._cond.wait()
                    sleep = _POLL_MIN_S
                if self._stop:
                    return
                queues = [q for q in self._queues.values() if q]
            progressed = False
            for queue in queues:
                while queue and queue[0].poll():
                    with self._cond:
                        queue.popleft()
                    progressed = True
            if progressed:
                sleep = _POLL_MIN_S
            else:
                time.sleep(sleep)
                sleep = min(sleep * 2, _POLL_MAX_S)


# Sleeps between polls double from the first value to the second (the progress thread) or the
# third (a thread blocked in wait()): long enough not to steal a core from the computation being
# overlapped, short enough that MPI's non-blocking algorithms, which advance only while polled,
# do not stall between their rounds.
_POLL_MIN_S, _POLL_MAX_S, _WAIT_MAX_S = 20e-6, 500e-6, 50e-6
_SPIN_S = 100e-6  # a waiting thread first polls without sleeping: small operations end within it
_PROGRESS = _Progress()


class _Work(dist.Work):
    """torch's Work for one hetcomm operation: wait(), get_future(), is_completed(), result()."""

    def __init__(self, pending: _Pending) -> None:
        super().__init__()
        self._pending = pending

    def wait(self, timeout: timedelta | None = None) -> bool:
        seconds = timeout.total_seconds() if timeout is not None else 0.0
        self._pending.wait(seconds if seconds > 0 else None)
        return True

    def get_future(self) -> torch.futures.Future:
        return self._pending.future

    def is_completed(self) -> bool:
        return self._pending.poll()

    def is_success(self) -> bool:
        return self._pending.poll() and self._pending.error is None

    def exception(self) -> BaseException | None:
        return self._pending.error

    def result(self) -> list[torch.Tensor]:
        self._pending.wait()
        return self._pending.result

    def synchronize(self) -> None:
        self._pending.wait()

    def __repr__(self) -> str:
        state = "failed" if self._pending.error else "done" if self._pending.done else "pending"
        return f"<hetcomm.torch Work {self._pending.name} {state}>"


# ---- the process group --------------------------------------------------------------------------


class ProcessGroupHetcomm(dist.ProcessGroup):
    """A torch ProcessGroup whose every operation runs on one hetcomm Communicator.

    Made by torch through the registered backend (`init_process_group("hetcomm")`,
    `new_group(..., backend="hetcomm")`, DeviceMesh); it owns its Communicator.
    """

    def __init__(self, comm: Communicator, timeout_s: float) -> None:
        super().__init__(comm.rank, comm.size)  # type: ignore[call-arg]
        self.comm = comm
        self.timeout_s = timeout_s
        self._aux: Communicator | None = None  # for gather/scatter/uneven all-to-all (p2p)
        self._issue = threading.Lock()
        self._coalesced: list[_Pending] | None = None
        self._closed = False
        self._splits = 0
        self._group_name = self._group_desc = comm.name

    def getBackendName(self) -> str:
        return BACKEND

    # torch keeps a group's name and description in its C++ backends, which a Python group has
    # none of: keep them here, for C++ callers (getGroupName...) and Python ones (group_name...)
    def getGroupName(self) -> str:
        return self._group_name

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupDesc(self) -> str:
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    _set_group_name, _set_group_desc = setGroupName, setGroupDesc
    group_name = property(getGroupName)
    group_desc = property(getGroupDesc)

    def __repr__(self) -> str:
        return f"<ProcessGroupHetcomm '{self.comm.name}' rank {self.comm.rank} of {self.comm.size}>"

    # ---- life cycle ---------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Let operations in flight end, then close the Communicators (destroy_process_group)."""
        if self._closed:
            return
        self._closed = True
        _PROGRESS.drain(id(self), min(self.timeout_s, 60.0))
        for comm in (self._aux, self.comm):
            if comm is not None:
                comm.close()

    def abort(self) -> None:
        self.shutdown()

    # ---- what torch asks of a group's C++ backend, and split_group -----------------------------

    def _get_backend(self, device: Any) -> _BackendView:  # type: ignore[override]
        """torch looks here for splitting support (init_process_group(device_id=...),
        split_group, DeviceMesh on a GPU machine); the group serves every device itself."""
        return _BackendView(self)

    def split_group(self, new_ranks: Sequence[int], timeout: Any = None, opts: Any = None,
                    group_name: Any = None, group_desc: str | None = None,
                    device_types: Any = None) -> ProcessGroupHetcomm | None:  # fmt: skip
        """This rank's group of `new_ranks` (ranks of this group), or None when not among them.
        Collective over this group: every member calls it with its own piece of the split."""
        me = self.comm.rank
        members = [int(r) for r in new_ranks]
        inside = me in members
        sub = self.comm.split(min(members) if inside else None,
                              members.index(me) if inside else None,
                              name=f"{self.comm.name}.split{self._splits}")  # fmt: skip
        self._splits += 1
        if sub is None:
            return None
        limit = timeout.total_seconds() if isinstance(timeout, timedelta) else self.timeout_s
        group = ProcessGroupHetcomm(sub, limit)
        if group_name is not None:
            group.setGroupName(str(group_name))
        if group_desc is not None:
            group.setGroupDesc(group_desc)
        return group

    # ---- plumbing -----------------------------------------------------------------------------

    def _limit(self, opts: Any) -> float:
        timeout = opts if isinstance(opts, timedelta) else getattr(opts, "timeout", None)
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else -1.0
        return seconds if seconds > 0 else self.timeout_s

    def _run(self, name: str, ops: Sequence[_Op], opts: Any = None,
             timeout: Any = None) -> _Work:  # fmt: skip
        """Start prepared operations (in order, as one torch call) and hand back their Work."""
        if self._closed:
            raise RuntimeError(f"hetcomm {name}: process group '{self.comm.name}' was destroyed")
        limit = self._limit(timeout if isinstance(timeout, timedelta) else opts)
        with self._issue:
            works = []
            for op in ops:
                work = op.start(self._aux_comm() if op.aux else self.comm)
                if work is not None:
                    works.append(work)
        result = [t for op in ops for t in op.result]
        after = [step for op in ops for step in op.after]
        pending = _Pending(f"{self.comm.name}: {name}", works, after, result, limit)
        if _synchronous():
            pending.wait()
        else:
            _PROGRESS.add(id(self), pending)
        if self._coalesced is not None:
            self._coalesced.append(pending)
        return _Work(pending)

    def _aux_comm(self) -> Communicator:
        # point-to-point traffic of gather, scatter and uneven all-to-all: a communicator of its
        # own so that it never matches the user's send/recv. Made inside a collective call, which
        # every member reaches in the same order, so the Dup is safe here.
        if self._aux is None:
            self._aux = self.comm.dup(name=f"{self.comm.name}.p2p")
        return self._aux

    # ---- collectives --------------------------------------------------------------------------
    # Each operation is prepared as an _Op (validated, nothing moved yet), then started by _run;
    # the coalesced variants start several _Ops as one torch Work.

    def allreduce(self, tensors: Any, opts: Any = None, timeout: Any = None) -> _Work:
        op = reduce_op(_opt(opts, "reduceOp"), "allreduce")
        t = _one(_listed(tensors), "allreduce")
        x = _reducible(t, op, "allreduce")
        return self._run("allreduce", [_Op("all_reduce", (x, op), [t])],
                         opts, timeout)  # fmt: skip

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> _Work:
        op = reduce_op(_opt(opts, "reduceOp"), "allreduce_coalesced")
        _nonempty(tensors, "allreduce_coalesced")
        xs = [_reducible(t, op, "allreduce_coalesced") for t in tensors]
        if len(xs) == 1 or len({(x.dtype, x.device) for x in xs}) > 1:
            ops = [_Op("all_reduce", (x, op), [t])
                   for x, t in zip(xs, tensors)]  # fmt: skip
            return self._run("allreduce_coalesced", ops, opts)
        # one operation over the concatenation, then the pieces back in place
        flat = torch.cat([x.reshape(-1) for x in xs])
        return self._run("allreduce_coalesced", [_Op(
            "all_reduce", (flat, op), list(tensors), [_unflatten(flat, xs)])], opts)  # fmt: skip

    def broadcast(self, tensors: Any, opts: Any = None, timeout: Any = None) -> _Work:
        root = self._rank_arg(_opt(opts, "rootRank", 0), "broadcast: root")
        if _opt(opts, "rootTensor", 0) != 0:
            raise ValueError("hetcomm broadcast: rootTensor must be 0 (one tensor per process)")
        t = _one(_listed(tensors), "broadcast")
        x, after = _movable(t, write=self.comm.rank != root)
        return self._run("broadcast", [_Op("broadcast", (x, root), [t], after)], opts, timeout)  # fmt: skip

    def reduce(self, tensors: Any, opts: Any = None, op: Any = None,
               timeout: Any = None) -> _Work:  # fmt: skip
        rop = reduce_op(op if op is not None else _opt(opts, "reduceOp"), "reduce")
        root = self._rank_arg(_opt(opts, "rootRank", 0), "reduce: root")
        t = _one(_listed(tensors), "reduce")
        x = _reducible(t, rop, "reduce")
        return self._run("reduce", [_Op("reduce", (x, root, rop), [t])],
                         opts, timeout)  # fmt: skip

    def allgather(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> _Work:
        if isinstance(input_tensors, torch.Tensor):  # the (outputs, input, timeout) form
            output_tensors, input_tensors = [output_tensors], [input_tensors]
        t = _one(input_tensors, "allgather: input")
        outs = _one(output_tensors, "allgather: output")
        return self._run("allgather", [self._allgather_op(outs, t, "allgather")], opts)

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]],
                            input_list: list[torch.Tensor], opts: Any = None) -> _Work:  # fmt: skip
        _nonempty(input_list, "allgather_coalesced: input")
        if len(output_lists) != self.comm.size:
            raise ValueError(f"hetcomm allgather_coalesced: expected {self.comm.size} output "
                             f"lists (one per rank), got {len(output_lists)}")  # fmt: skip
        for r, outs in enumerate(output_lists):
            if len(outs) != len(input_list):
                raise ValueError(f"hetcomm allgather_coalesced: output list {r} holds "
                                 f"{len(outs)} tensors for {len(input_list)} inputs")  # fmt: skip
        ops = [self._allgather_op([outs[i] for outs in output_lists], t, "allgather_coalesced")
               for i, t in enumerate(input_list)]  # fmt: skip
        return self._run("allgather_coalesced", ops, opts)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts: Any = None) -> _Work:  # fmt: skip
        return self._run("all_gather_into_tensor", [self._gather_single_op(output, input)], opts)

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor],
                                    inputs: list[torch.Tensor], opts: Any = None) -> _Work:  # fmt: skip
        _pairs(outputs, inputs, "all_gather_into_tensor_coalesced")
        ops = [self._gather_single_op(o, i) for o, i in zip(outputs, inputs)]
        return self._run("all_gather_into_tensor_coalesced", ops, opts)

    def reduce_scatter(self, output_tensors: Any, input_tensors: Any, opts: Any = None,
                       timeout: Any = None) -> _Work:  # fmt: skip
        if isinstance(output_tensors, torch.Tensor):  # the (output, inputs, op, timeout) form
            output_tensors, input_tensors = [output_tensors], [input_tensors]
        op = reduce_op(_opt(opts, "reduceOp"), "reduce_scatter")
        t = _one(output_tensors, "reduce_scatter: output")
        ins = _one(input_tensors, "reduce_scatter: input")
        self._check_blocks(ins, t, "reduce_scatter: input")
        o = _reducible(t, op, "reduce_scatter")
        flat = torch.stack([_reducible(i, op, "reduce_scatter").reshape(o.shape) for i in ins])
        return self._run("reduce_scatter", [_Op(
            "reduce_scatter", (o, flat, op), [t])], opts,
            timeout)  # fmt: skip

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts: Any = None) -> _Work:  # fmt: skip
        op = reduce_op(_opt(opts, "reduceOp"), "reduce_scatter_tensor")
        return self._run("reduce_scatter_tensor", [self._scatter_single_op(output, input, op)],
                         opts)  # fmt: skip

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts: Any = None) -> _Work:  # fmt: skip
        op = reduce_op(_opt(opts, "reduceOp"), "reduce_scatter_tensor_coalesced")
        _pairs(outputs, inputs, "reduce_scatter_tensor_coalesced")
        ops = [self._scatter_single_op(o, i, op) for o, i in zip(outputs, inputs)]
        return self._run("reduce_scatter_tensor_coalesced", ops, opts)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: Sequence[int] | None = None,
                          input_split_sizes: Sequence[int] | None = None,
                          opts: Any = None) -> _Work:  # fmt: skip
        n = self.comm.size
        _same_dtype(output, input, "all_to_all_single: output")
        if not output_split_sizes and not input_split_sizes:
            if input.numel() % n or output.numel() != input.numel():
                raise ValueError(f"hetcomm all_to_all_single: input and output must hold the "
                                 f"same multiple of {n} elements, got {input.numel()} and "
                                 f"{output.numel()}")  # fmt: skip
            x, _ = _movable(input, write=False)
            o, after = _movable(output, write=True)
            return self._run("all_to_all_single", [_Op(
                "all_to_all", (o, x), [output], after)], opts)  # fmt: skip
        sends = split_rows(input, input_split_sizes, n, "all_to_all_single: input")
        recvs = split_rows(output, output_split_sizes, n, "all_to_all_single: output")
        return self._exchange("all_to_all_single", sends, recvs, [output], opts)

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> _Work:  # fmt: skip
        n = self.comm.size
        for what, ts in (("output", output_tensors), ("input", input_tensors)):
            if len(ts) != n:
                raise ValueError(f"hetcomm alltoall: expected {n} {what} tensors (one per rank), "
                                 f"got {len(ts)}")  # fmt: skip
        for i, t in enumerate([*output_tensors, *input_tensors]):
            _same_dtype(t, input_tensors[0], f"alltoall: tensor {i}")
        return self._exchange("alltoall", list(input_tensors), list(output_tensors),
                              list(output_tensors), opts)  # fmt: skip

    def gather(self, output_tensors: Any, input_tensors: Any, opts: Any = None,
               timeout: Any = None) -> _Work:  # fmt: skip
        if isinstance(input_tensors, torch.Tensor):  # the (outputs, input, root, timeout) form
            output_tensors = [output_tensors] if output_tensors else []
            input_tensors = [input_tensors]
        root = self._rank_arg(_opt(opts, "rootRank", 0), "gather: root")
        t = _one(input_tensors, "gather: input")
        n, me = self.comm.size, self.comm.rank
        if me == root:
            outs = _one(output_tensors, "gather: output")
            self._check_blocks(outs, t, "gather: output")
            recvs: list[torch.Tensor | None] = list(outs)
            sends: list[torch.Tensor | None] = [t if r == me else None for r in range(n)]
            result = list(outs)
        else:
            if any(output_tensors):
                raise ValueError(f"hetcomm gather: only the root (rank {root}) passes output "
                                 f"tensors")  # fmt: skip
            sends = [t if r == root else None for r in range(n)]
            recvs, result = [None] * n, []
        return self._exchange("gather", sends, recvs, result, opts, timeout)

    def scatter(self, output_tensors: Any, input_tensors: Any, opts: Any = None,
                timeout: Any = None) -> _Work:  # fmt: skip
        if isinstance(output_tensors, torch.Tensor):  # the (output, inputs, root, timeout) form
            output_tensors = [output_tensors]
            input_tensors = [input_tensors] if input_tensors else []
        root = self._rank_arg(_opt(opts, "rootRank", 0), "scatter: root")
        t = _one(output_tensors, "scatter: output")
        n, me = self.comm.size, self.comm.rank
        if me == root:
            ins = _one(input_tensors, "scatter: input")
            self._check_blocks(ins, t, "scatter: input")
            sends: list[torch.Tensor | None] = list(ins)
            recvs: list[torch.Tensor | None] = [t if r == me else None for r in range(n)]
        else:
            if any(input_tensors):
                raise ValueError(f"hetcomm scatter: only the root (rank {root}) passes input "
                                 f"tensors")  # fmt: skip
            sends = [None] * n
            recvs = [t if r == root else None for r in range(n)]
        return self._exchange("scatter", sends, recvs, [t], opts, timeout)

    def barrier(self, opts: Any = None) -> _Work:
        return self._run("barrier", [_Op("barrier", (), [])], opts)

    # ---- point to point -----------------------------------------------------------------------

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int = 0) -> _Work:
        t = _one(tensors, "send")
        dst = self._rank_arg(dstRank, "send: dst")
        x, _ = _movable(t, write=False)
        return self._run("send", [_Op("send", (x, dst, tag), [t])])

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int = 0) -> _Work:
        t = _one(tensors, "recv")
        src = self._rank_arg(srcRank, "recv: src")
        x, after = _movable(t, write=True)
        return self._run("recv", [_Op("recv", (x, src, tag), [t], after)])

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> _Work:
        raise RuntimeError("hetcomm recv: a source rank is required (receiving from any source "
                           "is not supported)")  # fmt: skip

    # ---- coalescing (batch_isend_irecv, _coalescing_manager) ----------------------------------

    def start_coalescing(self, device: Any = None) -> None:
        if self._coalesced is not None:
            raise RuntimeError("hetcomm: coalescing already started on this process group")
        self._coalesced = []

    def end_coalescing(self, device: Any = None) -> _Work:
        if self._coalesced is None:
            raise RuntimeError("hetcomm: end_coalescing without start_coalescing")
        parts, self._coalesced = self._coalesced, None
        return _joined(parts, f"{self.comm.name}: coalesced")

    # ---- preparing operations -----------------------------------------------------------------

    def _allgather_op(self, outs: Sequence[torch.Tensor], t: torch.Tensor, what: str) -> _Op:
        self._check_blocks(outs, t, f"{what}: output")
        x, _ = _movable(t, write=False)
        flat = torch.empty((self.comm.size, *x.shape), dtype=x.dtype, device=x.device)
        return _Op("all_gather", (flat, x), list(outs), [_copy_rows(flat, outs)])  # fmt: skip

    def _gather_single_op(self, output: torch.Tensor, input: torch.Tensor) -> _Op:
        _same_dtype(output, input, "all_gather_into_tensor: output")
        if output.numel() != input.numel() * self.comm.size:
            raise ValueError(f"hetcomm all_gather_into_tensor: output must hold {self.comm.size} "
                             f"x {input.numel()} elements, got {output.numel()}")  # fmt: skip
        x, _ = _movable(input, write=False)
        o, after = _movable(output, write=True)
        return _Op("all_gather", (o, x), [output], after)

    def _scatter_single_op(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp) -> _Op:
        _same_dtype(output, input, "reduce_scatter_tensor: output")
        if output.numel() * self.comm.size != input.numel():
            raise ValueError(f"hetcomm reduce_scatter_tensor: input must hold {self.comm.size} x "
                             f"{output.numel()} elements, got {input.numel()}")  # fmt: skip
        o = _reducible(output, op, "reduce_scatter_tensor")
        x = _reducible(input, op, "reduce_scatter_tensor")
        return _Op("reduce_scatter", (o, x, op), [output])

    def _exchange(self, name: str, sends: Sequence[torch.Tensor | None],
                  recvs: Sequence[torch.Tensor | None], result: list[torch.Tensor],
                  opts: Any, timeout: Any = None) -> _Work:  # fmt: skip
        """Block j of `sends` goes to rank j, block i of `recvs` comes from rank i (p2p)."""
        me = self.comm.rank
        mine_in, mine_out = sends[me], recvs[me]
        if (mine_in is None) != (mine_out is None):
            raise ValueError(f"hetcomm {name}: this rank's own block is missing on one side")
        ops: list[_Op] = []
        for peer, t in enumerate(recvs):
            if t is not None and peer != me and t.numel():
                x, after = _movable(t, write=True)
                ops.append(_Op("recv", (x, peer), [], after, aux=True))  # fmt: skip
        for peer, t in enumerate(sends):
            if t is not None and peer != me and t.numel():
                x, _ = _movable(t, write=False)
                ops.append(_Op("send", (x, peer), [], aux=True))
        if mine_in is not None and mine_out is not None:
            if mine_in.numel() != mine_out.numel():
                raise ValueError(f"hetcomm {name}: this rank sends itself {mine_in.numel()} "
                                 f"elements but expects {mine_out.numel()}")  # fmt: skip
            own, target = mine_in.clone(), mine_out  # the input may change before the copy
            ops.append(_Op(None, (), [], [_copier(target, own)]))
        if ops:
            ops[0].result = result
        return self._run(name, ops or [_Op(None, (), result)], opts, timeout)

    def _rank_arg(self, rank: Any, what: str) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.comm.size:
            raise ValueError(f"hetcomm {what}: expected a rank in [0, {self.comm.size}), "
                             f"got {rank!r}")  # fmt: skip
        return rank

    def _check_blocks(self, blocks: Sequence[torch.Tensor], like: torch.Tensor, what: str) -> None:
        if len(blocks) != self.comm.size:
            raise ValueError(f"hetcomm {what}: expected {self.comm.size} tensors (one per rank), "
                             f"got {len(blocks)}")  # fmt: skip
        for i, t in enumerate(blocks):
            _same_dtype(t, like, f"{what}[{i}]")
            if t.numel() != like.numel():
                raise ValueError(f"hetcomm {what}[{i}]: expected {like.numel()} elements like "
                                 f"the input, got {t.numel()} (shape {list(t.shape)})")  # fmt: skip


class _BackendView:
    """Stands in for the C++ backend object torch expects a group to have: torch asks it whether
    the group can split (yes: ProcessGroupHetcomm.split_group) and calls a few hooks that have
    nothing to do here (hetcomm makes each group's communicator when torch creates the group)."""

    supports_splitting = True
    supports_coalescing = False
    supports_time_estimate = False
    options = None

    def __init__(self, group: ProcessGroupHetcomm) -> None:
        self._group = group

    def name(self) -> str:
        return BACKEND

    def comm_split_count(self) -> int:
        return self._group._splits

    def supports_tensor_alloc(self, device: Any) -> bool:
        return False

    def perform_nocolor_split(self, device: Any) -> None:
        pass  # non-members of a new group: nothing to do, members make it among themselves

    def eager_connect_single_device(self, device: Any) -> None:
        pass  # the communicator exists already

    def _set_sequence_number_for_group(self) -> None:
        pass


class _Op:
    """One prepared hetcomm call (a Communicator method and its arguments; None: nothing to
    move), the tensors it yields, and steps to run after it. `aux`: on the p2p communicator."""

    __slots__ = ("after", "args", "aux", "method", "result")

    def __init__(self, method: str | None, args: tuple, result: list[torch.Tensor],
                 after: Sequence[Callable[[], None]] = (), aux: bool = False) -> None:  # fmt: skip
        self.method, self.args, self.result = method, args, result
        self.after, self.aux = list(after), aux

    def start(self, comm: Communicator) -> HetcommWork | None:
        if self.method is None:
            return None
        return getattr(comm, self.method)(*self.args, async_op=True)


def _install_aliases(cls: type) -> None:
    for canonical, names in METHOD_NAMES.items():
        for name in names:
            if name not in cls.__dict__:
                setattr(cls, name, cls.__dict__[canonical])


_install_aliases(ProcessGroupHetcomm)


# ---- tensor helpers -----------------------------------------------------------------------------


def _opt(opts: Any, name: str, default: Any = None) -> Any:
    """Field `name` of torch's options object; the convenience forms pass the value itself
    (`allreduce(t, op)`, `broadcast(t, root)`)."""
    if name == "reduceOp" and default is None:
        default = dist.ReduceOp.SUM
    if opts is None or isinstance(opts, timedelta):
        return default
    if hasattr(opts, name):
        return getattr(opts, name)
    is_rank = isinstance(opts, int) and not isinstance(opts, bool)
    if (name == "rootRank" and is_rank) or (name == "reduceOp" and not is_rank):
        return opts
    return default


def _listed(tensors: Any) -> Any:
    return [tensors] if isinstance(tensors, torch.Tensor) else tensors


def _nonempty(ts: Sequence[Any], what: str) -> None:
    if not ts:
        raise ValueError(f"hetcomm {what}: expected at least one tensor, got an empty list")


def _one(ts: Sequence[Any], what: str) -> Any:
    _nonempty(ts, what)
    if len(ts) != 1:
        raise ValueError(f"hetcomm {what}: expected one tensor (or list) per process, got "
                         f"{len(ts)}; several per process is the multi-device API torch has "
                         "deprecated")  # fmt: skip
    return ts[0]


def _pairs(outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor], what: str) -> None:
    _nonempty(ins, what)
    if len(outs) != len(ins):
        raise ValueError(f"hetcomm {what}: {len(outs)} outputs for {len(ins)} inputs")


def _same_dtype(t: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    if t.dtype != ref.dtype:
        raise TypeError(f"hetcomm {what}: expected dtype {ref.dtype} like the input, got {t.dtype}")
    if t.device != ref.device:
        raise ValueError(f"hetcomm {what}: expected a tensor on {ref.device} like the input, got "
                         f"{t.device}")  # fmt: skip


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _reducible(t: torch.Tensor, op: ReduceOp, what: str) -> torch.Tensor:
    """`t` as hetcomm reduces it: itself, or the real view of a complex tensor (SUM/AVG)."""
    if t.is_complex():
        if op not in (ReduceOp.SUM, ReduceOp.AVG):
            raise ValueError(f"hetcomm {what}: complex tensors reduce with SUM or AVG only, "
                             f"got {op.name}")  # fmt: skip
        return torch.view_as_real(t)
    if _dtype_name(t) not in _NATIVE:
        raise DtypeError(f"hetcomm {what}: cannot reduce {t.dtype}; expected one of "
                         f"{', '.join(sorted(_NATIVE))} or a complex dtype")  # fmt: skip
    return t


def _movable(t: torch.Tensor, write: bool) -> tuple[torch.Tensor, list[Callable[[], None]]]:
    """`t` as hetcomm moves it (no arithmetic): itself, a real view, or its bytes.

    Dtypes hetcomm does not know (float8, uint32, ...) travel as bytes; a non-contiguous one goes
    through a contiguous copy, written back after the operation when `write`.
    """
    if t.is_complex():
        return torch.view_as_real(t), []
    if _dtype_name(t) in _NATIVE:
        return t, []
    if t.is_contiguous():
        return t.reshape(-1).view(torch.uint8), []
    packed = t.contiguous()
    steps = [_copier(t, packed)] if write else []
    return packed.reshape(-1).view(torch.uint8), steps


def split_rows(t: torch.Tensor, splits: Sequence[int] | None, n: int,
               what: str) -> list[torch.Tensor]:  # fmt: skip
    """`t` cut along dim 0 into `n` pieces of `splits` rows (equal pieces when splits is empty)."""
    rows = t.shape[0] if t.dim() else 1
    if not splits:
        if rows % n:
            raise ValueError(f"hetcomm {what}: {rows} rows do not split evenly over {n} ranks")
        splits = [rows // n] * n
    if len(splits) != n or any(s < 0 for s in splits) or sum(splits) != rows:
        raise ValueError(f"hetcomm {what}: expected {n} non-negative split sizes adding up to "
                         f"{rows} rows, got {list(splits)}")  # fmt: skip
    return list(torch.split(t, list(splits), dim=0)) if t.dim() else [t]


def _copier(target: torch.Tensor, source: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        target.copy_(source.reshape(target.shape))

    return step


def _unflatten(flat: torch.Tensor, xs: Sequence[torch.Tensor]) -> Callable[[], None]:
    def step() -> None:
        offset = 0
        for x in xs:
            n = x.numel()
            x.copy_(flat[offset:offset + n].view(x.shape))
            offset += n

    return step


def _copy_rows(flat: torch.Tensor, outs: Sequence[torch.Tensor]) -> Callable[[], None]:
    def step() -> None:
        for row, out in zip(flat, outs):
            out.copy_(_restore(row, out))

    return step


def _restore(moved: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Undo _movable: `moved` seen with the dtype and shape of `like`."""
    if like.is_complex():
        return torch.view_as_complex(moved.reshape(*like.shape, 2))
    if moved.dtype != like.dtype:
        return moved.reshape(-1).view(like.dtype).reshape(like.shape)
    return moved.reshape(like.shape)


def _joined(parts: list[_Pending], name: str) -> _Work:
    """One Work that completes when every part has (end_coalescing)."""
    result = [t for p in parts for t in p.result]
    pending = _Pending(name, list(parts), [], result, max((p.limit for p in parts), default=60.0))
    if _synchronous():
        pending.wait()
    else:
        _PROGRESS.add(0, pending)
    return _Work(pending)


# ---- creating groups ----------------------------------------------------------------------------


class _State:
    world: Communicator | None = None  # the default group's Communicator, when it is hetcomm's
    store: MpiStore | None = None
    rendezvous = 0
    thread_multiple: bool | None = None


def _synchronous() -> bool:
    """True when MPI cannot take calls from two threads: then every operation ends before
    returning (correct, without overlap)."""
    if _State.thread_multiple is None:
        from mpi4py import MPI

        _State.thread_multiple = MPI.Query_thread() >= MPI.THREAD_MULTIPLE
        if not _State.thread_multiple:
            log.warning("hetcomm.torch: MPI is not THREAD_MULTIPLE; operations complete before "
                        "they return (no overlap with computation)")  # fmt: skip
    return not _State.thread_multiple


def _timeout_s(timeout: Any, config_timeout: float) -> float:
    """The group's timeout: torch's when the user set one, else HETCOMM_TIMEOUT."""
    from torch.distributed.constants import default_pg_timeout

    if isinstance(timeout, timedelta) and timeout != default_pg_timeout:
        return max(timeout.total_seconds(), 1e-3)
    return config_timeout


def _create_group(opts: Any, backend_options: Any = None) -> ProcessGroupHetcomm:
    """The creator registered with torch: called on the members of each new group only."""
    from mpi4py import MPI

    import hetcomm

    from .comm import Communicator

    world_rank, world_size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    ranks = list(opts.global_ranks_in_group)
    rank, size, group_id = int(opts.group_rank), int(opts.group_size), str(opts.group_id)
    if not ranks:  # the default group
        if (rank, size) != (world_rank, world_size):
            raise ValueError(
                f"hetcomm: init_process_group was given rank {rank} of world_size {size}, but MPI "
                f"makes this process rank {world_rank} of {world_size}. hetcomm takes ranks from "
                "MPI: drop rank/world_size (and RANK/WORLD_SIZE) or make them match mpirun's"
            )
        world = hetcomm.init(name=f"torch{group_id}")
        _State.world = world
        log.info("hetcomm.torch: default group over %d ranks", world.size)
        return ProcessGroupHetcomm(world, _timeout_s(opts.timeout, world.config.timeout))
    torch_rank = dist.get_rank()
    if torch_rank != world_rank or ranks[rank] != world_rank:
        raise ValueError(
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
        comm = Communicator(sub, parent.config, parent.topology.subset(ranks), name)
    else:
        comm = hetcomm.init(sub, name=name)
        sub.Free()
    return ProcessGroupHetcomm(comm, _timeout_s(opts.timeout, comm.config.timeout))


# ---- a torch Store over MPI ---------------------------------------------------------------------

_REQ, _REP = 7001, 7002  # tags on the store's own communicator
_StoreError: type[Exception] = getattr(dist, "DistStoreError", RuntimeError)


class MpiStore(dist.Store):
    """A torch key-value Store held by rank 0 of an MPI communicator and reached over MPI.

    Collective to create (it Dups `comm`, default COMM_WORLD); afterwards any rank may call any
    method at any time. Rank 0 serves requests from a daemon thread; values never touch a socket.
    """

    def __init__(self, comm: Any = None, timeout: timedelta = timedelta(minutes=5)) -> None:
        super().__init__()
        from mpi4py import MPI

        self._mpi = (MPI.COMM_WORLD if comm is None else comm).Dup()
        self._lock = threading.Lock()
        self._serial = 0
        self._server = _StoreServer(self._mpi) if self._mpi.Get_rank() == 0 else None
        self.set_timeout(timeout)

    def _call(self, op: str, *args: Any, timeout: timedelta | None = None) -> Any:
        limit = (timeout or cast(Any, self).timeout).total_seconds()
        with self._lock:
            self._serial += 1
            serial = self._serial
            self._mpi.send((serial, op, args, limit), dest=0, tag=_REQ)
            give_up = time.monotonic() + limit + 30.0  # the server answers timeouts itself
            sleep = 10e-6
            while True:
                msg = self._mpi.improbe(0, _REP)
                if msg is not None:
                    got, ok, value = msg.recv()
                    if got == serial:
                        break
                    continue  # the late answer to a request that timed out here
                if time.monotonic() > give_up:
                    raise _StoreError(f"hetcomm MpiStore: {op} got no answer from rank 0 within "
                                      f"{limit + 30:.0f} s")  # fmt: skip
                time.sleep(sleep)
                sleep = min(sleep * 2, 2e-3)
        if not ok:
            raise _StoreError(f"hetcomm MpiStore: {value}")
        return value

    def set(self, key: str, value: bytes | str) -> None:
        self._call("set", key, _bytes(value))

    def get(self, key: str) -> bytes:
        return self._call("get", key)

    def add(self, key: str, amount: int) -> int:
        return self._call("add", key, int(amount))

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        return self._call("compare_set", key, _bytes(expected), _bytes(desired))

    def append(self, key: str, value: bytes | str) -> None:
        self._call("append", key, _bytes(value))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._call("multi_get", list(keys))

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        self._call("multi_set", list(keys), [_bytes(v) for v in values])

    def check(self, keys: list[str]) -> bool:
        return self._call("check", list(keys))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._call("wait", list(keys), timeout=timeout)

    def getNumKeys(self) -> int:
        return self._call("num_keys")

    def deleteKey(self, key: str) -> bool:
        return self._call("delete_key", key)

    num_keys = getNumKeys
    delete_key = deleteKey

    def has_extended_api(self) -> bool:
        return True

    def clone(self) -> MpiStore:
        return self  # thread-safe: one request at a time per process


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class _StoreServer:
    """Rank 0's side of MpiStore: the data, requests that wait for keys, a polling thread."""

    def __init__(self, mpi: Any) -> None:
        self._mpi = mpi
        self._data: dict[str, bytes] = {}
        self._parked: list[tuple[float, int, int, str, list[str]]] = []
        self._sends: list[Any] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="hetcomm-store", daemon=True)
        self._thread.start()
        _at_exit(self.close)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _serve(self) -> None:
        from mpi4py import MPI

        status = MPI.Status()
        sleep = 10e-6
        while not self._stop.is_set():
            msg = self._mpi.improbe(MPI.ANY_SOURCE, _REQ, status)
            if msg is None:
                self._housekeeping()
                time.sleep(sleep)
                sleep = min(sleep * 2, 5e-3)
                continue
            sleep = 10e-6
            serial, op, args, limit = msg.recv()
            try:
                self._handle(status.Get_source(), serial, op, args, limit)
            except Exception as exc:  # a malformed request must not end the server
                self._reply(status.Get_source(), serial, False, f"{op}: {exc}")

    def _handle(self, src: int, serial: int, op: str, args: tuple, limit: float) -> None:
        data = self._data
        if op in ("get", "wait", "multi_get"):
            keys = [args[0]] if op == "get" else list(args[0])
            if all(k in data for k in keys):
                self._answer_wait(src, serial, op, keys)
            else:
                self._parked.append((time.monotonic() + limit, src, serial, op, keys))
            return
        value: Any = None
        if op == "set":
            data[args[0]] = args[1]
        elif op == "add":
            value = int(data.get(args[0], b"0")) + args[1]
            data[args[0]] = str(value).encode()
        elif op == "append":
            data[args[0]] = data.get(args[0], b"") + args[1]
        elif op == "multi_set":
            data.update(zip(args[0], args[1]))
        elif op == "compare_set":
            key, expected, desired = args
            current = data.get(key)
            if (current is None and not expected) or current == expected:
                data[key] = value = desired
            else:
                value = expected if current is None else current
        elif op == "check":
            value = all(k in data for k in args[0])
        elif op == "num_keys":
            value = len(data)
        elif op == "delete_key":
            value = data.pop(args[0], None) is not None
        else:
            raise ValueError(f"unknown store operation {op!r}")
        self._reply(src, serial, True, value)
        if self._parked:
            self._wake()

    def _answer_wait(self, src: int, serial: int, op: str, keys: list[str]) -> None:
        data = self._data
        value: Any = (data[keys[0]] if op == "get" else [data[k] for k in keys]
                      if op == "multi_get" else None)  # fmt: skip
        self._reply(src, serial, True, value)

    def _wake(self) -> None:
        still = []
        for entry in self._parked:
            _, src, serial, op, keys = entry
            if all(k in self._data for k in keys):
                self._answer_wait(src, serial, op, keys)
            else:
                still.append(entry)
        self._parked = still

    def _housekeeping(self) -> None:
        if self._parked:
            now = time.monotonic()
            for _, src, serial, op, keys in [e for e in self._parked if e[0] < now]:
                missing = [k for k in keys if k not in self._data]
                self._reply(src, serial, False, f"{op}: timed out waiting for keys {missing}")
            self._parked = [e for e in self._parked if e[0] >= now]
        if self._sends:
            self._sends = [r for r in self._sends if not r.Test()]

    def _reply(self, dst: int, serial: int, ok: bool, value: Any) -> None:
        self._sends.append(self._mpi.isend((serial, ok, value), dest=dst, tag=_REP))


# ---- rendezvous: env:// under mpirun, and mpi:// ------------------------------------------------


def _launched_by_mpi() -> bool:
    return any(os.environ.get(v) for v in _LAUNCHER_VARS)


def _mpi_rendezvous(url: str, timeout: timedelta = timedelta(minutes=30),
                    **kwargs: Any) -> Iterator[tuple[Any, int, int]]:  # fmt: skip
    """mpi:// (and env:// without MASTER_ADDR under mpirun): rank and size from MPI.COMM_WORLD."""
    from mpi4py import MPI

    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    query = dict(parse_qsl(urlparse(url).query))
    for name, mine in (("rank", rank), ("world_size", size)):
        given = int(query.get(name, -1))
        if given not in (-1, mine):
            raise ValueError(
                f"hetcomm rendezvous: {name}={given} was given, but MPI says {mine}; under "
                "mpirun leave rank and world_size out (they come from MPI) or make them match"
            )
    if size == 1:
        store: Any = dist.HashStore()
    else:
        if _State.store is None:
            _State.store = MpiStore(timeout=timeout)
        # each rendezvous gets fresh keys, so that a second init_process_group in the same job
        # never reads what the first one wrote
        _State.rendezvous += 1
        store = dist.PrefixStore(f"hetcomm-rdzv{_State.rendezvous}", _State.store)
    store.set_timeout(timeout)
    yield store, rank, size
    raise RuntimeError("hetcomm rendezvous: re-rendezvous is not supported")


def _env_or_mpi(original: Callable[..., Iterator[tuple[Any, int, int]]]) -> Callable[..., Any]:
    def handler(url: str, **kwargs: Any) -> Iterator[tuple[Any, int, int]]:
        if _launched_by_mpi() and not (os.environ.get("MASTER_ADDR")
                                       and os.environ.get("MASTER_PORT")):  # fmt: skip
            return _mpi_rendezvous(url, **kwargs)
        return original(url, **kwargs)

    handler.hetcomm_wraps = original  # type: ignore[attr-defined]
    return handler


# ---- registration -------------------------------------------------------------------------------

_EXIT_HOOKS: list[Callable[[], None]] = []


def _at_exit(hook: Callable[[], None]) -> None:
    # registered after mpi4py's own exit hook, so these run first: threads stop before
    # MPI_Finalize
    if not _EXIT_HOOKS:
        atexit.register(_run_exit_hooks)
    _EXIT_HOOKS.append(hook)


def _run_exit_hooks() -> None:
    while _EXIT_HOOKS:
        try:
            _EXIT_HOOKS.pop()()
        except Exception as exc:
            print(f"hetcomm.torch: at exit: {exc}", file=sys.stderr)


def _register() -> None:
    dist.Backend.register_backend(BACKEND, _create_group, extended_api=True,
                                  devices=["cpu", "cuda"])  # fmt: skip
    handlers = rendezvous_handlers()
    handlers["mpi"] = _mpi_rendezvous
    env = handlers.get("env")
    if env is not None and not hasattr(env, "hetcomm_wraps"):
        handlers["env"] = _env_or_mpi(env)


_register()
