"""`hetcomm bench --latency`: an OSU-style latency table of every op, each beside its floor.

Per size (8 B to 16 MiB by default) and per op form, hetcomm's call is timed in the same
interleaved rounds as its floor (timing.py): raw mpi4py doing the same op the same way on host
buffers (and torch gloo where torch is installed); for the torch layer, `dist.<op>` through a
hetcomm ProcessGroup, the same op on its bare Communicator and a trivial Python ProcessGroup;
on device buffers, the copies and 1-byte messages that staged and direct cannot do without.
Every call is a real call: two buffer sets alternate, nothing is cached, and `-c` checks the
first call of every row against a float64 reference. Run under mpirun (docs/bench.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..kernels.host_copies import memcpy_async
from .latency_calls import (
    Arrays,
    Buffers,
    TorchView,
    fill,
    hetcomm_run,
    mpi4py_run,
    pingpong_peer,
    torch_run,
    wrong,
)
from .latency_table import (
    FORMS,
    SECTIONS,
    TORCH_FORMS,
    LatencyRow,
    iterations,
    pingpong,
    select_forms,
    table,
    to_json,
    torch_goal_us,
)
from .report import element_count
from .sweep import sizes_of
from .timing import Interleaved, Run, Stat, paired_difference, paired_ratio, share_cores

#: the Config field that switches off the default mismatch check, where this hetcomm has one
#: (`Config(check=False)` / HETCOMM_CHECK=0); `--no-mismatch-check` sets it
MISMATCH_CHECK_FIELD = "check"
LATENCY_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "float32", "float64")


# ---- the torch layer: a hetcomm ProcessGroup and a trivial one ------------------------------

_BENCH_BACKEND = "hetcomm_latency"
_TRIVIAL_BACKEND = "trivial_pg"


class _Creators:
    """What torch's creator callbacks for the two benchmark backends hand out: the Communicator
    the hetcomm group wraps is the bench's own (made with the asked transport)."""

    comm: Any = None


def _register_backends(dist: Any) -> None:
    from ..torch import METHOD_NAMES, ProcessGroupHetcomm

    known = {b.lower() for b in dist.Backend.backend_list}
    if _BENCH_BACKEND not in known:

        def hetcomm_group(opts: Any, backend_options: Any = None) -> Any:
            return ProcessGroupHetcomm(_Creators.comm, _Creators.comm.config.timeout)

        dist.Backend.register_backend(
            _BENCH_BACKEND, hetcomm_group, extended_api=True, devices=["cpu", "cuda"]
        )
    if _TRIVIAL_BACKEND not in known:
        trivial = _trivial_class(dist, METHOD_NAMES)

        def trivial_group(opts: Any, backend_options: Any = None) -> Any:
            return trivial(int(opts.group_rank), int(opts.group_size))

        dist.Backend.register_backend(
            _TRIVIAL_BACKEND, trivial_group, extended_api=True, devices=["cpu", "cuda"]
        )


def _trivial_class(dist: Any, method_names: dict[str, tuple[str, ...]]) -> type:
    """A Python ProcessGroup whose every operation returns one already finished Work: what
    torch's dispatch costs a Python backend, and nothing else."""
    import torch

    class Finished(dist.Work):
        def __init__(self) -> None:
            super().__init__()
            self._future: Any = torch.futures.Future()
            self._future.set_result([])

        def wait(self, timeout: Any = None) -> bool:
            return True

        def is_completed(self) -> bool:
            return True

        def is_success(self) -> bool:
            return True

        def get_future(self) -> Any:
            return self._future

    done = Finished()

    class TrivialGroup(dist.ProcessGroup):
        def __init__(self, rank: int, size: int) -> None:
            super().__init__(rank, size)
            self._name = ""

        def getBackendName(self) -> str:
            return _TRIVIAL_BACKEND

        # a Python group keeps its own name (torch keeps it in C++ backends, of which it has none)
        def getGroupName(self) -> str:
            return self._name

        def setGroupName(self, name: str) -> None:
            self._name = name

        def getGroupDesc(self) -> str:
            return self._name

        def setGroupDesc(self, desc: str) -> None:
            pass

        _set_group_name, _set_group_desc = setGroupName, setGroupDesc
        group_name = property(getGroupName)
        group_desc = property(getGroupDesc)

        def _done(self, *args: Any, **kwargs: Any) -> Any:
            return done

        allreduce = broadcast = reduce = send = recv = barrier = _done
        allgather = alltoall_base = _done

    for name in method_names["all_gather_single"]:
        setattr(TrivialGroup, name, TrivialGroup._done)
    return TrivialGroup


# ---- the device floors ----------------------------------------------------------------------


class DeviceFloors:
    """The copies and signals a device message cannot do without, between ranks 2k and 2k+1.

    `copy`: one device copy of the size. `two_copies` (staged's floor): device -> pinned host,
    a 1-byte MPI message, pinned host -> device in the other process, a 1-byte answer.
    `peer_copy` (direct's floor): a copy into the peer's buffer mapped through CUDA IPC, then a
    1-byte message; the peer does the same back, and the time is half of that round trip.
    Needs CuPy and a CUDA GPU; written for the GPU machine (see docs/bench.md).
    """

    def __init__(self, raw: Any, nbytes: int) -> None:
        import cupy
        import cupyx
        from mpi4py import MPI

        rt = cupy.cuda.runtime
        self.cupy, self.rt, self.raw, self.nbytes = cupy, rt, raw, max(1, nbytes)
        self.rank, self.ranks = raw.Get_rank(), raw.Get_size()
        self.peer = pingpong_peer(self.rank, self.ranks)
        self.first = self.rank % 2 == 0
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.sig = np.zeros(1, np.uint8)
        self.src = cupy.zeros(self.nbytes, dtype=cupy.uint8)
        self.dst = cupy.zeros(self.nbytes, dtype=cupy.uint8)
        self.host = cupyx.empty_pinned(self.nbytes, dtype=np.uint8)
        # the peer's mapped buffer: this rank's own cudaMalloc (not the pool's, whose blocks
        # are parts of larger allocations an IPC handle would not start at)
        self.mine = rt.malloc(self.nbytes)
        self.theirs: int | None = None
        self.no_peer_copy: str | None = None
        local = raw.Split_type(MPI.COMM_TYPE_SHARED)
        same_host = self.peer is not None and self.peer in self._world_ranks(raw, local)
        local.Free()
        try:
            handle = rt.ipcGetMemHandle(self.mine)
        except Exception as exc:  # a device or driver without IPC
            handle, self.no_peer_copy = None, f"no CUDA IPC handle: {exc}"
        theirs = self._swap(handle)
        if self.peer is not None and not same_host:
            self.no_peer_copy = "the ping-pong partner is on another host"
        elif theirs is not None and self.no_peer_copy is None:
            try:
                self.theirs = rt.ipcOpenMemHandle(theirs)
            except Exception as exc:
                self.no_peer_copy = f"cannot open the partner's IPC handle: {exc}"
        why = [w for w in raw.allgather(self.no_peer_copy) if w is not None]
        self.no_peer_copy = why[0] if why else None

    @staticmethod
    def _world_ranks(raw: Any, local: Any) -> set[int]:
        return set(local.allgather(raw.Get_rank()))

    def _swap(self, handle: Any) -> Any:
        if self.peer is None:
            return None
        got: Any = self.raw.sendrecv(handle, dest=self.peer, source=self.peer)
        return got

    def _copy(self, dst: int, src: int, kind: int) -> None:
        # as staged copies: small ones between host and device on the copy engines
        memcpy_async(self.rt, dst, src, self.nbytes, kind, self.stream.ptr)
        self.stream.synchronize()

    def copy(self, calls: int) -> None:
        """One device copy of the size, synchronized, `calls` times."""
        for _ in range(calls):
            self._copy(self.dst.data.ptr, self.src.data.ptr, self.rt.memcpyDeviceToDevice)

    def two_copies(self, calls: int) -> None:
        """Staged's floor per call: D2H, signal, H2D in the other process, answer."""
        if self.peer is None:
            return
        raw, peer, sig, host = self.raw, self.peer, self.sig, self.host.ctypes.data
        down, up = self.rt.memcpyDeviceToHost, self.rt.memcpyHostToDevice
        for _ in range(calls):
            if self.first:
                self._copy(host, self.src.data.ptr, down)
                raw.Send(sig, peer)
                raw.Recv(sig, peer)
            else:
                raw.Recv(sig, peer)
                self._copy(self.dst.data.ptr, host, up)
                raw.Send(sig, peer)

    def peer_copy(self, calls: int) -> None:
        """Direct's floor, twice per call (there and back): a peer copy, then a signal."""
        if self.peer is None or self.theirs is None:
            return
        raw, peer, sig, theirs = self.raw, self.peer, self.sig, self.theirs
        kind = self.rt.memcpyDeviceToDevice
        for _ in range(calls):
            if self.first:
                self._copy(theirs, self.src.data.ptr, kind)
                raw.Send(sig, peer)
                raw.Recv(sig, peer)
            else:
                raw.Recv(sig, peer)
                self._copy(theirs, self.src.data.ptr, kind)
                raw.Send(sig, peer)

    def close(self) -> None:
        self.raw.Barrier()  # the peer has stopped copying into `mine`
        if self.theirs is not None:
            self.rt.ipcCloseMemHandle(self.theirs)
            self.theirs = None
        self.raw.Barrier()
        self.rt.free(self.mine)


# ---- the study --------------------------------------------------------------------------------


def _against(
    section: str,
    op: str,
    form: str,
    nbytes: int,
    half: float,
    h: Stat,
    f: Stat,
    floor: str,
    **more: Any,
) -> LatencyRow:
    """The row of `h` against the floor `f` (measured as `floor`) in the same rounds; `half`
    is 2 where a call is a round trip (its row gives one way)."""
    return LatencyRow(
        section=section,
        op=op,
        form=form,
        bytes=nbytes,
        hetcomm_us=h.median * 1e6 / half,
        floor_us=f.median * 1e6 / half,
        floor=floor,
        spread=max(h.spread, f.spread),
        ratio=paired_ratio(h, f),
        **more,
    )


def mismatch_config(transport: str, mismatch_check: bool) -> tuple[Any, str]:
    """The Config of the benchmarked Communicator and a line saying how its mismatch check ran."""
    import hetcomm

    names = {f.name for f in dataclasses.fields(hetcomm.Config)}
    overrides: dict[str, Any] = {"transport": transport}
    if MISMATCH_CHECK_FIELD not in names:
        state = f"this hetcomm has no Config field {MISMATCH_CHECK_FIELD!r}: measured as built" + (
            "" if mismatch_check else " (--no-mismatch-check had nothing to switch off)"
        )
    elif mismatch_check:
        state = f"on (Config.{MISMATCH_CHECK_FIELD} as configured)"
    else:
        overrides[MISMATCH_CHECK_FIELD] = False
        state = f"off (Config({MISMATCH_CHECK_FIELD}=False), --no-mismatch-check)"
    return hetcomm.Config.load(**overrides), state


def _machine(device: str) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu
            )
    except OSError:
        pass
    text = f"{platform.node()}, {os.cpu_count()} cores ({cpu}), {platform.system()}"
    if device == "cuda":
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        name = props["name"]
        text += f", GPU {name.decode() if isinstance(name, bytes) else name}"
    return text


def _versions() -> str:
    import mpi4py

    import hetcomm

    parts = [f"hetcomm {hetcomm.__version__}", f"mpi4py {mpi4py.__version__}"]
    parts.append(f"numpy {np.__version__}")
    try:
        import torch

        parts.append(f"torch {torch.__version__}")
    except ImportError:
        parts.append("torch not installed")
    return ", ".join(parts)


class Study:
    """One run of the latency table on every rank of MPI.COMM_WORLD."""

    def __init__(self, args: argparse.Namespace, argv: Sequence[str]) -> None:
        from mpi4py import MPI

        import hetcomm

        self.args = args
        self.raw = MPI.COMM_WORLD.Dup()  # the floors' communicator
        self.ctl = MPI.COMM_WORLD.Dup()  # barriers and gathers of the timing
        self.rank, self.ranks = self.raw.Get_rank(), self.raw.Get_size()
        if args.dtype not in LATENCY_DTYPES:
            raise SystemExit(
                f"hetcomm bench --latency: -d {args.dtype} has no numpy/MPI datatype here; "
                f"expected one of {', '.join(LATENCY_DTYPES)}"
            )
        if "," in args.transport:
            raise SystemExit(
                f"hetcomm bench --latency: --transport takes one transport, got {args.transport!r}"
            )
        self.dtype = args.dtype
        self.itemsize = np.dtype(self.dtype).itemsize
        self.device = args.device
        if self.device == "cuda":  # each rank takes GPU local-rank mod GPU count
            import cupy

            local = self.raw.Split_type(MPI.COMM_TYPE_SHARED)
            cupy.cuda.Device(local.Get_rank() % cupy.cuda.runtime.getDeviceCount()).use()
            local.Free()
        self.arrays = Arrays(self.device)
        self.timing = Interleaved(self.ctl, args.rounds, sync=self.arrays.sync)
        config, self.check_state = mismatch_config(args.transport, not args.no_mismatch_check)
        check_cost = getattr(args, "check_cost", False)
        if check_cost and (args.no_mismatch_check or self.device != "cpu"):
            raise SystemExit(
                "hetcomm bench --latency --check-cost: times host buffers with the check on "
                "beside it off (drop --no-mismatch-check and --device cuda)"
            )
        self.comm = hetcomm.init(config=config, name="bench-latency")
        # --check-cost: the same ops on a Communicator without the check, in the same rounds
        self.unchecked: Any = None
        self.check_rows: list[LatencyRow] = []
        if check_cost:
            off, _ = mismatch_config(args.transport, False)
            self.unchecked = hetcomm.init(config=off, name="bench-unchecked")
        self.sizes = sizes_of(args)
        self.forms = select_forms(args.op, FORMS)
        self.torch_forms = select_forms(args.op, TORCH_FORMS)
        self.dist: Any = None
        self.gloo = "gloo" in [b.strip() for b in getattr(args, "baselines", "gloo").split(",")]
        self._own_dist = False
        self.groups: dict[str, Any] = {}
        self.meta = {
            "command": f"mpirun -n {self.ranks} python -m mpi4py -m hetcomm bench "
            + " ".join(argv),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": _machine(self.device),
            "mpi": MPI.Get_library_version().strip().splitlines()[0],
            "versions": _versions(),
            "ranks": self.ranks,
            "transport": args.transport,
            "mismatch_check": self.check_state,
            "memory": self.device,
            "dtype": self.dtype,
            "rounds": args.rounds,
            "plan": str(self.comm.plan),
        }
        self.say = print if self.rank == 0 else (lambda *a, **k: None)

    # -- torch ----------------------------------------------------------------------------------

    def _start_torch(self) -> str | None:
        """torch gloo as the default group, a hetcomm group and a trivial group beside it; the
        reason torch cannot run here, or None."""
        try:
            import torch
            import torch.distributed as dist

            from .impls import torch_gloo
        except ImportError as exc:
            return f"torch is not installed ({exc})"
        why = None
        try:
            share_cores(torch, self.raw)
            self._own_dist = not dist.is_initialized()
            self.dist = torch_gloo(self.raw) if self._own_dist else dist
            _register_backends(dist)
            _Creators.comm = self.comm
            self.groups["hetcomm"] = dist.new_group(backend=_BENCH_BACKEND)
            self.groups["trivial"] = dist.new_group(backend=_TRIVIAL_BACKEND)
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
        why = self._agree(why)
        if why is not None:
            self.dist = None
        return why

    def _agree(self, why: str | None) -> str | None:
        return next((w for w in self.ctl.allgather(why) if w is not None), None)

    # -- rows -----------------------------------------------------------------------------------

    def _count(self, op: str, nbytes: int) -> int:
        if op == "barrier":
            return 0
        blocked = "all_gather" if op == "all_gather_single" else op
        return element_count(blocked, nbytes, self.itemsize, self.ranks)

    def _sets(self, op: str, form: str, count: int, arrays: Arrays) -> list[Buffers]:
        return [Buffers(arrays, op, form, count, self.dtype, self.rank, self.ranks) for _ in (0, 1)]

    def _check(self, run: Run, sets: list[Buffers], arrays: Arrays) -> int | None:
        if not self.args.check:
            return None
        fill(arrays, sets[0], self.dtype)
        self.ctl.Barrier()
        run(1)
        arrays.sync()
        peer = pingpong_peer(self.rank, self.ranks)
        got = wrong(arrays, sets[0], self.dtype, peer)
        return int(self.ctl.allreduce(got))

    def _calls(self, nbytes: int) -> int:
        return iterations(nbytes, self.args.iters, self.args.iters_large)

    def host_row(self, op: str, form: str, nbytes: int) -> LatencyRow:
        """hetcomm (host buffers) beside mpi4py and gloo at one op form and size."""
        count = self._count(op, nbytes)
        nbytes = count * self.itemsize
        host = Arrays("cpu")
        mine = self._sets(op, form, count, host)
        impls: dict[str, Run] = {
            "hetcomm": hetcomm_run(self.comm, op, form, mine, host.sync, False)
        }
        wrong_count = self._check(impls["hetcomm"], mine, host)
        # every implementation on the same arrays: arrays made at other times may lie elsewhere
        # in memory, which moved medians of 16 MiB calls by 10-15% on a 16-core host
        impls["mpi4py"] = mpi4py_run(self.raw, op, form, mine)
        if self.unchecked is not None:
            impls["unchecked"] = hetcomm_run(self.unchecked, op, form, mine, host.sync, False)
        if self.gloo and self.dist is not None and op != "all_reduce_coalesced":
            views = [TorchView(b) for b in self._sets(op, form, count, host)]
            gloo = torch_run(self.dist, None, op, form, views, self.rank, self.ranks)
            if gloo is not None and self._agree(self._try(gloo)) is None:
                impls["gloo"] = gloo
        stats = self.timing.measure(impls, self._calls(nbytes), self.args.warmup)
        half = 2.0 if pingpong(op, form) else 1.0
        h, f = stats["hetcomm"], stats["mpi4py"]
        g = stats.get("gloo")
        u = stats.get("unchecked")
        if u is not None:
            self.check_rows.append(_against("check", op, form, nbytes, half, h, u, "unchecked"))
        return _against(
            "host",
            op,
            form,
            nbytes,
            half,
            h,
            f,
            "mpi4py",
            wrong=wrong_count,
            gloo_us=None if g is None else g.median * 1e6 / half,
        )

    @staticmethod
    def _try(run: Run) -> str | None:
        try:
            run(1)
        except (RuntimeError, ValueError, TypeError, NotImplementedError) as exc:
            return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        return None

    def _torch_on(self, group: str, op: str, form: str, views: Sequence[Any]) -> Run:
        run = torch_run(self.dist, self.groups[group], op, form, views, self.rank, self.ranks)
        if run is None:
            raise ValueError(f"torch has no {form} {op}")
        return run

    def torch_row(self, op: str, form: str, nbytes: int) -> LatencyRow:
        """dist.<op> through hetcomm minus the bare Communicator, beside the trivial group."""
        count = self._count(op, nbytes)
        nbytes = count * self.itemsize
        host = Arrays("cpu")
        base = "all_gather" if op == "all_gather_single" else op
        views = {
            k: [TorchView(b) for b in self._sets(op, form, count, host)]
            for k in ("dist", "bare", "trivial")
        }
        on = self._torch_on
        dist_run, trivial = (
            on("hetcomm", op, form, views["dist"]),
            on("trivial", op, form, views["trivial"]),
        )
        bare = hetcomm_run(self.comm, base, form, views["bare"], host.sync, False)
        wrong_count = None
        if self.args.check:
            tensors = self._sets(op, form, count, host)
            check_views = [TorchView(b) for b in tensors]
            check_run = on("hetcomm", op, form, check_views)
            wrong_count = self._check(check_run, tensors, host)
        impls = {"dist": dist_run, "bare": bare, "trivial": trivial}
        stats = self.timing.measure(impls, self._calls(nbytes), self.args.warmup)
        half = 2.0 if pingpong(op, form) else 1.0
        d, b, t = stats["dist"], stats["bare"], stats["trivial"]
        over = paired_difference(d, b) * 1e6 / half
        floor = t.median * 1e6 / half
        return LatencyRow(
            section="torch",
            op=op,
            form=form,
            bytes=nbytes,
            hetcomm_us=over,
            floor_us=floor,
            floor="trivial-pg",
            spread=max(d.spread, b.spread, t.spread),
            wrong=wrong_count,
            ratio=over / floor if floor > 0 else None,
            extra={
                "dist_us": d.median * 1e6 / half,
                "bare_us": b.median * 1e6 / half,
                "goal_us": torch_goal_us(floor),
                "within_goal": over <= torch_goal_us(floor),
            },
        )

    def device_row(
        self, op: str, form: str, nbytes: int, floors: DeviceFloors | None
    ) -> LatencyRow:
        """hetcomm on device buffers; floors: the device copies and signals (ping-pong), else
        mpi4py on host buffers of the same size."""
        count = self._count(op, nbytes)
        nbytes = count * self.itemsize
        dev, host = self.arrays, Arrays("cpu")
        mine = self._sets(op, form, count, dev)
        impls: dict[str, Run] = {"hetcomm": hetcomm_run(self.comm, op, form, mine, dev.sync, True)}
        wrong_count = self._check(impls["hetcomm"], mine, dev)
        extra: dict[str, Any] = {}
        if pingpong(op, form) and floors is not None:
            impls["copy"] = floors.copy
            impls["two-copies"] = floors.two_copies
            if floors.no_peer_copy is None:
                impls["peer-copy"] = floors.peer_copy
            else:
                extra["peer_copy"] = floors.no_peer_copy
        else:
            impls["mpi4py-host"] = mpi4py_run(self.raw, op, form, self._sets(op, form, count, host))
        stats = self.timing.measure(impls, self._calls(nbytes), self.args.warmup)
        h = stats["hetcomm"]
        if pingpong(op, form):
            floor = "peer-copy" if self.args.transport in ("direct", "nccl") else "two-copies"
            floor = floor if floor in stats else "two-copies"
        else:
            floor = "mpi4py-host"
        # ping-pong times are one way; the floors' are per one-way message already (copy,
        # two-copies: one message and its answer; peer-copy: half its round trip)
        per: dict[str, float] = {"hetcomm": 2.0, "peer-copy": 2.0} if pingpong(op, form) else {}
        us = {k: s.median * 1e6 / per.get(k, 1.0) for k, s in stats.items()}
        extra.update({f"{k.replace('-', '_')}_us": v for k, v in us.items() if k != "hetcomm"})
        f = stats[floor]
        ratio = us["hetcomm"] / us[floor] if us[floor] > 0 else None
        return LatencyRow(
            section="device",
            op=op,
            form=form,
            bytes=nbytes,
            hetcomm_us=us["hetcomm"],
            floor_us=us[floor],
            floor=floor,
            spread=max(h.spread, f.spread),
            wrong=wrong_count,
            ratio=ratio,
            extra=extra,
        )

    def run(self) -> list[LatencyRow]:
        """Every row, in table order; the same list on every rank."""
        rows: list[LatencyRow] = []
        # torch (gloo beside the host rows, the torch section) serves host buffers only
        why = self._start_torch() if self.device == "cpu" else None
        if why is not None:
            self.say(f"# no gloo and no torch section: {why}")
        barrier_done = False
        for nbytes in self.sizes:
            floors = None
            if self.device == "cuda" and any(pingpong(*f) for f in self.forms):
                floors = DeviceFloors(self.raw, nbytes)
            try:
                for op, form in self.forms:
                    if op == "barrier":
                        if barrier_done:
                            continue
                        barrier_done = True
                    if self.device == "cuda":
                        rows.append(self.device_row(op, form, nbytes, floors))
                    else:
                        rows.append(self.host_row(op, form, nbytes))
            finally:
                if floors is not None:
                    floors.close()
            if self.dist is not None and self.device == "cpu":
                rows.extend(self.torch_row(op, form, nbytes) for op, form in self.torch_forms)
        rows.extend(self.check_rows)

        def place(r: LatencyRow) -> tuple[int, int, int]:
            forms = TORCH_FORMS if r.section == "torch" else FORMS
            return SECTIONS.index(r.section), forms.index((r.op, r.form)), r.bytes

        rows.sort(key=place)
        return rows

    def close(self) -> None:
        if self.dist is not None:
            for group in self.groups.values():
                self.dist.destroy_process_group(group)
            if self._own_dist:
                self.dist.destroy_process_group()
        for comm in (self.comm, self.unchecked):
            if comm is not None and not comm.closed:
                comm.close()
        self.raw.Free()
        self.ctl.Free()


def run_latency(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """`hetcomm bench --latency`: the table on rank 0 (and JSON); 1 if any check failed."""
    study = Study(args, argv)
    try:
        rows = study.run()
    finally:
        meta = study.meta
        study.close()
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_rank() == 0:
        print(table(rows, meta))
        if args.json:
            with open(args.json, "w") as f:
                f.write(to_json(rows, meta))
        sys.stdout.flush()
    MPI.COMM_WORLD.Barrier()  # the file exists once any rank returns
    return 1 if any(r.wrong for r in rows) else 0
