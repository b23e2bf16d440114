"""The nccl-tests sweep of `hetcomm bench`: per size, each op out of place and in place through
hetcomm's transports and the baselines, reported in nccl-tests' own format (report.py)."""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .impls import (
    Case,
    Gloo,
    Hetcomm,
    Impl,
    Mpi4py,
    Naive,
    Skip,
    TorchNccl,
    to_tensor,
)
from .report import (
    FORMS,
    REDUCING,
    ROOTED,
    add_ratios,
    canonical_op,
    element_count,
    make_row,
    nccl_report,
    parse_size,
    plot,
    size_steps,
    to_json,
)
from .timing import cuda_event_timer, share_cores, wall_timer

TRANSPORTS = ("auto", "mpi", "staged", "direct", "nccl", "hier")
BASELINES = ("mpi4py", "gloo", "naive", "nccl")
REDOPS = ("sum", "prod", "min", "max", "avg")


def names(text: str, known: Sequence[str], what: str) -> list[str]:
    """The comma list `text` of names out of `known` ('none': none), or exit naming the bad."""
    got = [t.strip().lower() for t in text.split(",") if t.strip()]
    if got == ["none"]:
        return []
    bad = [t for t in got if t not in known]
    if bad:
        raise SystemExit(
            f"hetcomm bench: unknown {what} {', '.join(bad)}; expected {', '.join(known)}"
        )
    return list(dict.fromkeys(got))


def _agree(raw: Any, reason: str | None) -> str | None:
    """The first rank's reason to skip, on every rank (None when no rank has one)."""
    return next((r for r in raw.allgather(reason) if r is not None), None)


def sizes_of(args: argparse.Namespace) -> list[int]:
    """The sizes of -b/-e with -f (a factor) or -i (step bytes, when -f is 1 or not given)."""
    step = None if args.stepbytes is None else parse_size(args.stepbytes)
    factor = args.stepfactor if args.stepfactor is not None else (1 if step else 2)
    return size_steps(parse_size(args.minbytes), parse_size(args.maxbytes), factor, step)


def _step(args: argparse.Namespace) -> tuple[int | float, str]:
    if args.stepbytes is not None and (args.stepfactor is None or args.stepfactor <= 1):
        return parse_size(args.stepbytes), "bytes"
    factor = args.stepfactor if args.stepfactor is not None else 2
    return (int(factor) if float(factor).is_integer() else factor), "factor"


def _progress(total: int, enabled: bool) -> Any:
    """A rich progress bar on stderr (None when disabled, not a tty or rich is missing)."""
    if enabled and sys.stderr.isatty():
        try:
            from rich.console import Console
            from rich.progress import Progress

            bar = Progress(console=Console(stderr=True), transient=True)
            bar.start()
            bar.add_task("hetcomm bench", total=total)
            return bar
        except ImportError:
            pass
    return None


def _device_line(raw: Any, device: str) -> dict[str, Any]:
    """This rank's `#  Rank ...` facts: pid, host, device index, PCI bus and name."""
    import torch

    facts: dict[str, Any] = {
        "rank": raw.Get_rank(),
        "pid": os.getpid(),
        "host": os.uname().nodename,
        "device": -1,
        "bus": 0,
        "name": "cpu (host memory)",
    }
    if device.startswith("cuda"):
        index = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        facts.update(device=index, bus=int(getattr(props, "pci_bus_id", 0)), name=props.name)
    return facts


class Sweep:
    """The implementations and the sizes of one `hetcomm bench` run, on every rank."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        from mpi4py import MPI

        from ..errors import TransportUnavailable

        self.args = args
        self.raw = MPI.COMM_WORLD.Dup()
        self.rank, self.ranks = self.raw.Get_rank(), self.raw.Get_size()
        share_cores(torch, self.raw)
        self.ops = [canonical_op(o) for o in args.op.split(",") if o.strip()]
        self.sizes = sizes_of(args)
        self.redop = args.redop.lower()
        if self.redop not in REDOPS:
            raise SystemExit(
                f"hetcomm bench: unknown -o/--redop {args.redop!r}; expected {', '.join(REDOPS)}"
            )
        if not 0 <= args.root < self.ranks:
            raise SystemExit(f"hetcomm bench: --root {args.root} is not a rank of {self.ranks}")
        self.device = args.device
        if self.device == "cuda":
            local = self.raw.Split_type(MPI.COMM_TYPE_SHARED)
            torch.cuda.set_device(local.Get_rank() % torch.cuda.device_count())
            local.Free()
            self.device = f"cuda:{torch.cuda.current_device()}"
        self.notes: list[tuple[str | None, str]] = []  # (the op it is about or None, text)
        self.impls: list[Impl] = []
        for t in names(args.transport, TRANSPORTS, "transport"):
            try:
                self.impls.append(Hetcomm(t))
            except TransportUnavailable as exc:
                self.notes.append((None, f"skipping transport {t}: {exc}"))
        for b in names(args.baselines, BASELINES, "baseline"):
            why = None
            try:
                impl = {"mpi4py": Mpi4py, "gloo": Gloo, "naive": Naive, "nccl": TorchNccl}[b](
                    self.raw
                )
            except Exception as exc:
                why = f"{type(exc).__name__}: {exc}"
            why = _agree(self.raw, why)
            if why is None:
                self.impls.append(impl)
            else:
                self.notes.append((None, f"skipping baseline {b}: {why}"))
        # CUDA events around each call on a GPU, the host clock on the CPU
        self.timer = cuda_event_timer() if args.device == "cuda" else wall_timer()
        self.itemsize = torch.tensor([], dtype=getattr(torch, args.dtype)).element_size()
        self.devices: list[dict[str, Any]] = (
            self.raw.gather(_device_line(self.raw, self.device), root=0) or []
        )

    def run(self) -> list[dict[str, Any]]:
        """Every row (op, implementation, size, form), with ratios; the same on every rank."""
        rows: list[dict[str, Any]] = []
        skipped: set[tuple[str, str, str]] = set()
        total = len(self.ops) * len(self.sizes) * len(self.impls)
        bar = _progress(total, self.rank == 0 and not self.args.no_progress)
        try:
            for op in self.ops:
                for size in self.sizes:
                    count = element_count(op, size, self.itemsize, self.ranks)
                    case = Case(
                        op,
                        count,
                        self.args.dtype,
                        self.redop,
                        self.args.root,
                        self.rank,
                        self.ranks,
                    )
                    for impl in self.impls:
                        rows.extend(self._both_forms(impl, case, skipped))
                        if bar is not None:
                            bar.advance(bar.task_ids[0])
        finally:
            if bar is not None:
                bar.stop()
        add_ratios(rows)
        return rows

    def _both_forms(
        self, impl: Impl, case: Case, skipped: set[tuple[str, str, str]]
    ) -> list[dict[str, Any]]:
        out = []
        for form in FORMS:
            key = (impl.name, case.op, form)
            if key in skipped:
                continue
            got = measure(self.raw, impl, case, self.device, self.timer, self.args, form)
            if isinstance(got, str):
                skipped.add(key)
                self.notes.append((case.op, f"no {form} {case.op} for {impl.name}: {got}"))
                continue
            out.append(
                make_row(
                    op=case.op,
                    form=form,
                    transport=impl.name,
                    kind=impl.kind,
                    count=case.count,
                    itemsize=self.itemsize,
                    dtype=case.dtype,
                    redop=self.redop if case.op in REDUCING else None,
                    root=case.root if case.op in ROOTED else None,
                    ranks=self.ranks,
                    time_s=got[0],
                    wrong=got[1],
                )
            )
        return out

    def close(self) -> None:
        for impl in self.impls:
            impl.close()
        self.raw.Free()


def form_buffers(case: Case, where: str, in_place: bool) -> tuple[Any, Any, Callable[[], None]]:
    """(x, y, fresh) for one form: in place, x and y share the one buffer of NCCL's in-place
    layout (all_gather's x is this rank's block of y; reduce_scatter's y is this rank's block of
    x; else y is x); `fresh()` puts the inputs back."""
    inputs = to_tensor(case.input(case.rank), case.dtype, where)
    x = inputs.clone()
    y = to_tensor(np.zeros(case.out_count), case.dtype, where)
    block = case.count // case.ranks
    mine = slice(case.rank * block, (case.rank + 1) * block)
    if not in_place:

        def fresh_out() -> None:
            x.copy_(inputs)
            y.zero_()

        return x, y, fresh_out
    if case.op == "all_gather":
        x = y[mine]

        def fresh_gather() -> None:
            y.zero_()
            x.copy_(inputs)

        return x, y, fresh_gather
    y = x[mine] if case.op == "reduce_scatter" else x
    return x, y, lambda: x.copy_(inputs)


def measure(
    raw: Any,
    impl: Impl,
    case: Case,
    device: str,
    timer: Callable[[Callable[[], Any]], float],
    args: argparse.Namespace,
    form: str,
) -> tuple[float, int | None] | str:
    """(median over iterations of the slowest rank's seconds, #wrong or None), or why not."""
    from ..errors import HetcommError

    where = device if impl.on_device else "cpu"
    x, y, fresh = form_buffers(case, where, form == "in-place")
    why = None
    try:
        call, out = impl.prepare(case, x, y, form == "in-place")
        call()  # the first call: opens connections, and tells whether this can run at all
        if args.check:  # again from fresh inputs (in-place ops changed them)
            fresh()
            raw.Barrier()
            call()
            if where != "cpu":
                import torch

                torch.cuda.synchronize()
    except (Skip, HetcommError, RuntimeError, NotImplementedError, ValueError, TypeError) as exc:
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    why = _agree(raw, why)
    if why is not None:
        return why
    from mpi4py import MPI

    wrong = raw.allreduce(case.wrong(out), op=MPI.SUM) if args.check else None
    for _ in range(args.warmup):
        call()
    samples = []
    for _ in range(args.iters):
        raw.Barrier()
        samples.append(timer(call))
    worst = np.max(raw.allgather(samples), axis=0) if samples else [0.0]
    return float(statistics.median(worst)), wrong


def report_meta(args: argparse.Namespace, sweep: Sweep, op: str) -> dict[str, Any]:
    """What nccl_report prints above the tables of `op`."""
    transports = [i.name for i in sweep.impls if i.kind == "hetcomm"]
    baselines = [i.name for i in sweep.impls if i.kind == "baseline"]
    return {
        "min_bytes": sweep.sizes[0],
        "max_bytes": sweep.sizes[-1],
        "step": _step(args),
        "warmup": args.warmup,
        "iters": args.iters,
        "check": 1 if args.check else 0,
        "blocking": args.blocking,
        "ranks": sweep.ranks,
        "notes": [
            f"hetcomm bench: {sweep.ranks} ranks, {args.device} buffers, hetcomm transport(s) "
            f"{', '.join(transports) or 'none'}, baselines {', '.join(baselines) or 'none'}",
            "time: the median over the iterations of the slowest rank's time, each iteration "
            "after a barrier (nccl-tests: the mean); algbw, busbw as nccl-tests",
            "N/A: the implementation has no such form of the op (hetcomm's broadcast and reduce "
            "work in place, send/recv out of place)",
            *(text for about, text in sweep.notes if about in (None, op)),
        ],
    }


def run_sweep(args: argparse.Namespace) -> int:
    """`hetcomm bench` without a study: the sweep, then nccl-tests' report per op on rank 0 (and
    JSON, plot); 1 if any #wrong."""
    from mpi4py import MPI

    sweep = Sweep(args)
    try:
        rows = sweep.run()
    finally:
        sweep.close()
    if MPI.COMM_WORLD.Get_rank() == 0:
        for op in dict.fromkeys(r["op"] for r in rows) or sweep.ops:
            if len(sweep.ops) > 1:
                print(f"# ---- {op} ----")
            mine = [r for r in rows if r["op"] == op]
            meta = report_meta(args, sweep, op)
            print(nccl_report(mine, meta, sweep.devices, extra=args.hetcomm_columns))
        if args.json:
            with open(args.json, "w") as f:
                f.write(
                    to_json(
                        rows,
                        ranks=MPI.COMM_WORLD.Get_size(),
                        device=args.device,
                        host=os.uname().nodename,
                        date=datetime.datetime.now().isoformat(timespec="seconds"),
                    )
                )
        if args.plot:
            plot(rows, args.plot, MPI.COMM_WORLD.Get_size())
        sys.stdout.flush()
    MPI.COMM_WORLD.Barrier()  # the files exist once any rank returns
    return 1 if any(r["wrong"] for r in rows) else 0
