"""ProcessGroupHetcomm: a torch ProcessGroup over one hetcomm Communicator, and its creator.

Each process group is a `ProcessGroupHetcomm` (a Python `torch.distributed.ProcessGroup`) over its
own Communicator, so every group has its own plan. Under mpirun `dist.init_process_group("hetcomm")`
needs no address, port, rank or world size: they come from MPI. docs/torch.md is the user's guide.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..errors import HetcommError
from ..ops import ReduceOp
from . import profile
from .compat import BACKEND, BackendView, install_aliases, reduce_op
from .errors import ArgumentError, DistBackendError, torch_error
from .tensors import (
    _copier,
    _copy_rows,
    _listed,
    _movable,
    _nonempty,
    _one,
    _opt,
    _pairs,
    _reducible,
    _same_dtype,
    split_rows,
)
from .work import (
    _PROGRESS,
    _joined,
    _Pending,
    _synchronous,
    _Work,
    finished_now,
)

if TYPE_CHECKING:
    from ..comm import Communicator
    from ..work import Work as HetcommWork

log = logging.getLogger("hetcomm")

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
        # the latest per-call timeout _limit read, and the limit it gave
        self._last_timeout: Any = None
        self._last_limit = timeout_s
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

    def _get_backend(self, device: Any) -> BackendView:
        """torch looks here for splitting support (init_process_group(device_id=...),
        split_group, DeviceMesh on a GPU machine); the group serves every device itself."""
        return BackendView(self)

    def split_group(
        self,
        new_ranks: Sequence[int],
        timeout: Any = None,
        opts: Any = None,
        group_name: Any = None,
        group_desc: str | None = None,
        device_types: Any = None,
    ) -> ProcessGroupHetcomm | None:
        """This rank's group of `new_ranks` (ranks of this group), or None when not among them.
        Collective over this group: every member calls it with its own piece of the split."""
        from .create import with_timeout

        me = self.comm.rank
        members = [int(r) for r in new_ranks]
        inside = me in members
        sub = self.comm.split(
            min(members) if inside else None,
            members.index(me) if inside else None,
            name=f"{self.comm.name}.split{self._splits}",
            config=with_timeout(self.comm.config, timeout),
        )
        self._splits += 1
        if sub is None:
            return None
        group = ProcessGroupHetcomm(sub, sub.config.timeout)
        if group_name is not None:
            group.setGroupName(str(group_name))
        if group_desc is not None:
            group.setGroupDesc(group_desc)
        return group

    # ---- plumbing -----------------------------------------------------------------------------

    def _limit(self, opts: Any) -> float:
        timeout = opts if isinstance(opts, timedelta) else getattr(opts, "timeout", None)
        if timeout is None:
            return self.timeout_s
        if timeout == self._last_timeout:  # most calls carry the one torch gives every call
            return self._last_limit
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else -1.0
        limit = seconds if seconds > 0 else self.timeout_s
        self._last_timeout, self._last_limit = timeout, limit
        return limit

    def _run(
        self,
        name: str,
        ops: Sequence[_Op],
        opts: Any = None,
        timeout: Any = None,
        *,
        inputs: Sequence[torch.Tensor] = (),
    ) -> _Work | None:
        """Start prepared operations (in order, as one torch call) and hand back their Work;
        `inputs`: the call's input tensors, whose shapes a torch profiler event records.

        A call torch waits for at once (its options say asyncOp=False: `dist.<op>` without
        async_op) is made blocking on this thread and returns None, which torch's own
        functions take as a call that has completed (as a backend that synchronized in C++)."""
        if self._closed:
            raise DistBackendError(
                f"hetcomm {name}: process group '{self.comm.name}' is closed (destroyed)"
            )
        if opts is None and timeout is None:  # sends and receives: no options
            limit = self.timeout_s
        else:
            limit = self._limit(timeout if isinstance(timeout, timedelta) else opts)
        record = profile.Record(name, inputs) if profile.active() else None
        if opts is not None and self._coalesced is None and not getattr(opts, "asyncOp", True):
            # (the sends and receives of gather, scatter and uneven all-to-all stay
            # non-blocking: made one after another blocking, they would wait for each other)
            for op in ops:
                if op.aux:
                    break
            else:
                self._run_blocking(name, ops, limit, record)
                return None
        with self._issue:
            works = []
            try:
                for op in ops:
                    work = op.start(self._aux_comm() if op.aux else self.comm)
                    if work is not None:
                        works.append(work)
            except HetcommError as exc:
                if record is not None:
                    record.end()
                raise torch_error(exc, f"{self.comm.name}: {name}") from exc
        if len(ops) == 1:
            result, after = ops[0].result, ops[0].after
        else:
            result = [t for op in ops for t in op.result]
            after = [step for op in ops for step in op.after]
        settle = True
        if record is None and self._coalesced is None and not after:
            finished = finished_now(works, self.comm.name, name, result)
            if finished is not None:
                return _Work(finished)
            settle = False  # it was, and did not end
        pending = self._pending(name, works, after, result, limit, record, settle)
        if self._coalesced is not None:
            self._coalesced.append(pending)
        return _Work(pending)

    def _pending(
        self,
        name: str,
        works: list[HetcommWork],
        after: list[Callable[[], None]],
        result: list[torch.Tensor],
        limit: float,
        record: profile.Record | None = None,
        settle: bool = True,
    ) -> _Pending:
        """The operation of started Works, driven here for a moment (unless `settle` is
        False: it was), then (still running) by the progress thread, or to its end where MPI
        cannot take calls from two threads."""
        pending = _Pending(f"{self.comm.name}: {name}", works, after, result, limit)
        pending.record = record
        if _synchronous():
            pending.wait()
        elif not (settle and pending.settle()):
            _PROGRESS.add(id(self), pending)
        return pending

    def _run_blocking(
        self, name: str, ops: Sequence[_Op], limit: float, record: profile.Record | None
    ) -> None:
        """The Communicator's blocking calls of one torch call, driven on this thread. The
        group's timeout bounds them (given per call only where it is not the Communicator's
        own, since a per-call timeout takes the general path)."""
        timeout = None if limit == self.comm.config.timeout else limit
        try:
            with self._issue:
                for op in ops:
                    if op.method is not None:
                        getattr(self.comm, op.method)(*op.args, timeout=timeout)
            for op in ops:
                for step in op.after:
                    step()
        except HetcommError as exc:
            raise torch_error(exc, f"{self.comm.name}: {name}") from exc
        finally:
            if record is not None:
                _PROGRESS.end_record(record)  # an asynchronous event, as every other one

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

    def allreduce(self, tensors: Any, opts: Any = None, timeout: Any = None) -> _Work | None:
        op = reduce_op(_opt(opts, "reduceOp"), "allreduce")
        t = _one(_listed(tensors), "allreduce")
        x = _reducible(t, op, "allreduce")
        return self._run("allreduce", [_Op("all_reduce", (x, op), [t])], opts, timeout, inputs=[t])

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> _Work | None:
        op = reduce_op(_opt(opts, "reduceOp"), "allreduce_coalesced")
        _nonempty(tensors, "allreduce_coalesced")
        xs = [_reducible(t, op, "allreduce_coalesced") for t in tensors]
        # one fused all_reduce per (dtype, device), packed and unpacked by hetcomm
        return self._run(
            "allreduce_coalesced",
            [_Op("all_reduce_coalesced", (xs, op), list(tensors))],
            opts,
            inputs=tensors,
        )

    def broadcast(self, tensors: Any, opts: Any = None, timeout: Any = None) -> _Work | None:
        root = self._rank_arg(_opt(opts, "rootRank", 0), "broadcast: root")
        if _opt(opts, "rootTensor", 0) != 0:
            raise ArgumentError("hetcomm broadcast: rootTensor must be 0 (one tensor per process)")
        t = _one(_listed(tensors), "broadcast")
        x, after = _movable(t, write=self.comm.rank != root)
        return self._run(
            "broadcast", [_Op("broadcast", (x, root), [t], after)], opts, timeout, inputs=[t]
        )

    def reduce(
        self, tensors: Any, opts: Any = None, op: Any = None, timeout: Any = None
    ) -> _Work | None:
        rop = reduce_op(op if op is not None else _opt(opts, "reduceOp"), "reduce")
        root = self._rank_arg(_opt(opts, "rootRank", 0), "reduce: root")
        t = _one(_listed(tensors), "reduce")
        x = _reducible(t, rop, "reduce")
        return self._run("reduce", [_Op("reduce", (x, root, rop), [t])], opts, timeout, inputs=[t])

    def allgather(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> _Work | None:
        if isinstance(input_tensors, torch.Tensor):  # the (outputs, input, timeout) form
            output_tensors, input_tensors = [output_tensors], [input_tensors]
        t = _one(input_tensors, "allgather: input")
        outs = _one(output_tensors, "allgather: output")
        return self._run("allgather", [self._allgather_op(outs, t, "allgather")], opts, inputs=[t])

    def allgather_coalesced(
        self,
        output_lists: list[list[torch.Tensor]],
        input_list: list[torch.Tensor],
        opts: Any = None,
    ) -> _Work | None:
        _nonempty(input_list, "allgather_coalesced: input")
        if len(output_lists) != self.comm.size:
            raise ArgumentError(
                f"hetcomm allgather_coalesced: expected {self.comm.size} output "
                f"lists (one per rank), got {len(output_lists)}"
            )
        for r, outs in enumerate(output_lists):
            if len(outs) != len(input_list):
                raise ArgumentError(
                    f"hetcomm allgather_coalesced: output list {r} holds "
                    f"{len(outs)} tensors for {len(input_list)} inputs"
                )
        ops = [
            self._allgather_op([outs[i] for outs in output_lists], t, "allgather_coalesced")
            for i, t in enumerate(input_list)
        ]
        return self._run("allgather_coalesced", ops, opts, inputs=input_list)

    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> _Work | None:
        return self._run(
            "all_gather_into_tensor", [self._gather_single_op(output, input)], opts, inputs=[input]
        )

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> _Work | None:
        _pairs(outputs, inputs, "all_gather_into_tensor_coalesced")
        ops = [self._gather_single_op(o, i) for o, i in zip(outputs, inputs)]
        return self._run("all_gather_into_tensor_coalesced", ops, opts, inputs=inputs)

    def reduce_scatter(
        self, output_tensors: Any, input_tensors: Any, opts: Any = None, timeout: Any = None
    ) -> _Work | None:
        if isinstance(output_tensors, torch.Tensor):  # the (output, inputs, op, timeout) form
            output_tensors, input_tensors = [output_tensors], [input_tensors]
        op = reduce_op(_opt(opts, "reduceOp"), "reduce_scatter")
        t = _one(output_tensors, "reduce_scatter: output")
        ins = _one(input_tensors, "reduce_scatter: input")
        self._check_blocks(ins, t, "reduce_scatter: input")
        o = _reducible(t, op, "reduce_scatter")
        flat = torch.stack([_reducible(i, op, "reduce_scatter").reshape(o.shape) for i in ins])
        return self._run(
            "reduce_scatter",
            [_Op("reduce_scatter", (o, flat, op), [t])],
            opts,
            timeout,
            inputs=ins,
        )

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> _Work | None:
        op = reduce_op(_opt(opts, "reduceOp"), "reduce_scatter_tensor")
        return self._run(
            "reduce_scatter_tensor",
            [self._scatter_single_op(output, input, op)],
            opts,
            inputs=[input],
        )

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> _Work | None:
        op = reduce_op(_opt(opts, "reduceOp"), "reduce_scatter_tensor_coalesced")
        _pairs(outputs, inputs, "reduce_scatter_tensor_coalesced")
        ops = [self._scatter_single_op(o, i, op) for o, i in zip(outputs, inputs)]
        return self._run("reduce_scatter_tensor_coalesced", ops, opts, inputs=inputs)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int] | None = None,
        input_split_sizes: Sequence[int] | None = None,
        opts: Any = None,
    ) -> _Work | None:
        n = self.comm.size
        _same_dtype(output, input, "all_to_all_single: output")
        if not output_split_sizes and not input_split_sizes:
            if input.numel() % n or output.numel() != input.numel():
                raise ArgumentError(
                    f"hetcomm all_to_all_single: input and output must hold the "
                    f"same multiple of {n} elements, got {input.numel()} and "
                    f"{output.numel()}"
                )
            x, _ = _movable(input, write=False)
            o, after = _movable(output, write=True)
            return self._run(
                "all_to_all_single",
                [_Op("all_to_all", (o, x), [output], after)],
                opts,
                inputs=[input],
            )
        sends = split_rows(input, input_split_sizes, n, "all_to_all_single: input")
        recvs = split_rows(output, output_split_sizes, n, "all_to_all_single: output")
        return self._exchange("all_to_all_single", sends, recvs, [output], opts, inputs=[input])

    def alltoall(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> _Work | None:
        n = self.comm.size
        for what, ts in (("output", output_tensors), ("input", input_tensors)):
            if len(ts) != n:
                raise ArgumentError(
                    f"hetcomm alltoall: expected {n} {what} tensors (one per rank), got {len(ts)}"
                )
        for i, t in enumerate([*output_tensors, *input_tensors]):
            _same_dtype(t, input_tensors[0], f"alltoall: tensor {i}")
        return self._exchange(
            "alltoall",
            list(input_tensors),
            list(output_tensors),
            list(output_tensors),
            opts,
            inputs=input_tensors,
        )

    def gather(
        self, output_tensors: Any, input_tensors: Any, opts: Any = None, timeout: Any = None
    ) -> _Work | None:
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
                raise ArgumentError(
                    f"hetcomm gather: only the root (rank {root}) passes output tensors"
                )
            sends = [t if r == root else None for r in range(n)]
            recvs, result = [None] * n, []
        return self._exchange("gather", sends, recvs, result, opts, timeout, inputs=[t])

    def scatter(
        self, output_tensors: Any, input_tensors: Any, opts: Any = None, timeout: Any = None
    ) -> _Work | None:
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
                raise ArgumentError(
                    f"hetcomm scatter: only the root (rank {root}) passes input tensors"
                )
            sends = [None] * n
            recvs = [t if r == root else None for r in range(n)]
        return self._exchange("scatter", sends, recvs, [t], opts, timeout, inputs=input_tensors)

    def barrier(self, opts: Any = None) -> _Work | None:
        return self._run("barrier", [_Op("barrier", (), [])], opts)

    # ---- point to point -----------------------------------------------------------------------

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int = 0) -> _Work:
        t = _one(tensors, "send")
        dst = self._rank_arg(dstRank, "send: dst")
        x, _ = _movable(t, write=False)
        return self._point_to_point("send", "send", (x, dst, tag), t)

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int = 0) -> _Work:
        t = _one(tensors, "recv")
        src = self._rank_arg(srcRank, "recv: src")
        x, after = _movable(t, write=True)
        return self._point_to_point("recv", "recv", (x, src, tag), t, after)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> _Work:
        from .. import ANY_SOURCE

        t = _one(tensors, "recv")
        x, after = _movable(t, write=True)
        # the Work's _source_rank() is the sender's rank in this group, once complete
        return self._point_to_point("recv_anysource", "recv", (x, ANY_SOURCE, tag), t, after)

    def _point_to_point(
        self,
        name: str,
        method: str,
        args: tuple,
        t: torch.Tensor,
        after: Sequence[Callable[[], None]] = (),
    ) -> _Work:
        """A send or receive: torch passes it no options, so it always starts and hands back a
        Work (dist.send and dist.recv wait on it). Started here, it is one call into the
        Communicator; _run takes those that join a coalesced block, need steps after them or
        are recorded for the profiler."""
        if self._closed or self._coalesced is not None or after or profile.active():
            work = self._run(name, [_Op(method, args, [t], after)], inputs=[t])
            assert work is not None
            return work
        with self._issue:
            try:
                started = getattr(self.comm, method)(*args, async_op=True)
            except HetcommError as exc:
                raise torch_error(exc, f"{self.comm.name}: {name}") from exc
        finished = finished_now([started], self.comm.name, name, [t])
        if finished is not None:
            return _Work(finished)
        return _Work(self._pending(name, [started], [], [t], self.timeout_s, settle=False))

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
        return _Op("all_gather", (flat, x), list(outs), [_copy_rows(flat, outs)])

    def _gather_single_op(self, output: torch.Tensor, input: torch.Tensor) -> _Op:
        _same_dtype(output, input, "all_gather_into_tensor: output")
        if output.numel() != input.numel() * self.comm.size:
            raise ArgumentError(
                f"hetcomm all_gather_into_tensor: output must hold {self.comm.size} "
                f"x {input.numel()} elements, got {output.numel()}"
            )
        x, _ = _movable(input, write=False)
        o, after = _movable(output, write=True)
        return _Op("all_gather", (o, x), [output], after)

    def _scatter_single_op(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp) -> _Op:
        _same_dtype(output, input, "reduce_scatter_tensor: output")
        if output.numel() * self.comm.size != input.numel():
            raise ArgumentError(
                f"hetcomm reduce_scatter_tensor: input must hold {self.comm.size} x "
                f"{output.numel()} elements, got {input.numel()}"
            )
        o = _reducible(output, op, "reduce_scatter_tensor")
        x = _reducible(input, op, "reduce_scatter_tensor")
        return _Op("reduce_scatter", (o, x, op), [output])

    def _exchange(
        self,
        name: str,
        sends: Sequence[torch.Tensor | None],
        recvs: Sequence[torch.Tensor | None],
        result: list[torch.Tensor],
        opts: Any,
        timeout: Any = None,
        *,
        inputs: Sequence[torch.Tensor] = (),
    ) -> _Work | None:
        """Block j of `sends` goes to rank j, block i of `recvs` comes from rank i (p2p)."""
        me = self.comm.rank
        mine_in, mine_out = sends[me], recvs[me]
        if (mine_in is None) != (mine_out is None):
            raise ArgumentError(f"hetcomm {name}: this rank's own block is missing on one side")
        ops: list[_Op] = []
        for peer, t in enumerate(recvs):
            if t is not None and peer != me and t.numel():
                x, after = _movable(t, write=True)
                ops.append(_Op("recv", (x, peer), [], after, aux=True))
        for peer, t in enumerate(sends):
            if t is not None and peer != me and t.numel():
                x, _ = _movable(t, write=False)
                ops.append(_Op("send", (x, peer), [], aux=True))
        if mine_in is not None and mine_out is not None:
            if mine_in.numel() != mine_out.numel():
                raise ArgumentError(
                    f"hetcomm {name}: this rank sends itself {mine_in.numel()} "
                    f"elements but expects {mine_out.numel()}"
                )
            own, target = mine_in.clone(), mine_out  # the input may change before the copy
            ops.append(_Op(None, (), [], [_copier(target, own)]))
        if ops:
            ops[0].result = result
        return self._run(name, ops or [_Op(None, (), result)], opts, timeout, inputs=inputs)

    def _rank_arg(self, rank: Any, what: str) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.comm.size:
            raise ArgumentError(
                f"hetcomm {what}: expected a rank in [0, {self.comm.size}), got {rank!r}"
            )
        return rank

    def _check_blocks(self, blocks: Sequence[torch.Tensor], like: torch.Tensor, what: str) -> None:
        if len(blocks) != self.comm.size:
            raise ArgumentError(
                f"hetcomm {what}: expected {self.comm.size} tensors (one per rank), "
                f"got {len(blocks)}"
            )
        for i, t in enumerate(blocks):
            _same_dtype(t, like, f"{what}[{i}]")
            if t.numel() != like.numel():
                raise ArgumentError(
                    f"hetcomm {what}[{i}]: expected {like.numel()} elements like "
                    f"the input, got {t.numel()} (shape {list(t.shape)})"
                )


class _Op:
    """One prepared hetcomm call (a Communicator method and its arguments; None: nothing to
    move), the tensors it yields, and steps to run after it. `aux`: on the p2p communicator."""

    __slots__ = ("after", "args", "aux", "method", "result")

    def __init__(
        self,
        method: str | None,
        args: tuple,
        result: list[torch.Tensor],
        after: Sequence[Callable[[], None]] = (),
        aux: bool = False,
    ) -> None:
        self.method, self.args, self.result = method, args, result
        self.after, self.aux = list(after), aux

    def start(self, comm: Communicator) -> HetcommWork | None:
        if self.method is None:
            return None
        return getattr(comm, self.method)(*self.args, async_op=True)


install_aliases(ProcessGroupHetcomm)
