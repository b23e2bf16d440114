"""Per-rank Chrome traces of every completed operation: `HETCOMM_TRACE=DIR`.

Each rank writes `DIR/trace-rank<RANK>.json` in the Chrome trace-event format (open it in
chrome://tracing or https://ui.perfetto.dev). Every operation that completes through a `Work`
becomes one complete event (`"ph": "X"`): `ts` is when the Work was made and `dur` how long it
took until it was seen complete, both in microseconds of wall-clock time (comparable between the
ranks of one host; between hosts only as far as their clocks agree). `pid` is the rank in
MPI_COMM_WORLD, `tid` a small number per communicator, named by a `thread_name` metadata event,
and `args` hold `op`, `seq`, `group` and what the transport put in `Work.info`: `transport`,
`bytes` (the operation's size on this rank, as nccl-tests counts it) and `stages` (the pieces it
moved in: MPI calls on the mpi transport, chunks sent and received over rails on staged).

Events are buffered and written every `FLUSH_EVERY` events and at exit; after each write the file
is a complete JSON document. A rank killed with SIGKILL loses the events since its last write.
`scripts/merge-trace DIR OUT.json` (or `python -m hetcomm.trace merge DIR OUT.json`) merges the
ranks' files into one trace.

Tracing is an observer registered on Work (`hetcomm.work.add_observer`). It is decided once per
process, by the config of the first Communicator made (`HETCOMM_TRACE` is read like every
option, in hetcomm.config), or, where no Communicator has been made, of the communicator whose
operation completes first: importing this module registers that decision as an observer, which
removes itself and, when the config names a directory, registers the writer. `enable()` and
`disable()` switch it by hand, and `reset()` leaves it undecided again. While nobody observes, a
completed operation costs one check of a module variable.

Not traced: operations with nothing to move (already complete when made) and operations that
fail. The communicator's short path for small in-place all_reduces makes no Work, so it is not
taken while tracing is on (nor while it is undecided).
"""

from __future__ import annotations

import atexit
import glob
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, BinaryIO

from . import work as _work

if TYPE_CHECKING:
    from .work import Work

FLUSH_EVERY = 1000
FILE_PATTERN = "trace-rank*.json"
_FOOTER = b"\n]}\n"

_writer: TraceWriter | None = None
_lock = threading.Lock()


class Stamps:
    """Time stamps of a transport's inner steps, for profiling one operation: kept only while
    `marks` is a list (`marks = []` starts, `None` stops); otherwise a step costs one check.
    `time.perf_counter()` is one clock for the ranks of one host."""

    __slots__ = ("marks",)

    def __init__(self) -> None:
        self.marks: list[tuple[float, str]] | None = None

    def __call__(self, what: str, idx: int = -1) -> None:
        """Note the time of `what` (of chunk `idx`, where one is named)."""
        if self.marks is not None:
            self.marks.append((time.perf_counter(), what if idx < 0 else f"{what} {idx}"))


class TraceWriter:
    """The trace file of one rank: `record(work)` buffers an event, `flush()` writes them."""

    def __init__(self, directory: str, rank: int, flush_every: int = FLUSH_EVERY) -> None:
        if flush_every < 1:
            raise ValueError(f"flush_every must be at least 1, got {flush_every}")
        os.makedirs(directory, exist_ok=True)
        self.rank = rank
        self.path = os.path.join(directory, f"trace-rank{rank:05d}.json")
        self.flush_every = flush_every
        self.count = 0  # events recorded so far
        self._events: list[str] = []
        self._tids: dict[str, int] = {}
        self._lock = threading.Lock()
        # wall clock of perf_counter's zero: events of all ranks land on one time line
        self._wall0 = time.time() - time.perf_counter()
        self._file: BinaryIO | None = open(self.path, "w+b")  # noqa: SIM115 (closed in close())
        header = {
            "displayTimeUnit": "ms",
            "otherData": {
                "producer": "hetcomm",
                "rank": rank,
                "host": socket.gethostname(),
                "pid": os.getpid(),
            },
        }
        head = json.dumps(header, separators=(",", ":"))[:-1] + ',"traceEvents":[\n'
        self._file.write(head.encode())
        self._end = self._file.tell()
        self._first = True
        self._meta("process_name", 0, {"name": f"rank {rank} ({socket.gethostname()})"})
        self._meta("process_sort_index", 0, {"sort_index": rank})
        self.flush()

    def _meta(self, name: str, tid: int, args: dict[str, Any]) -> None:
        event = {"name": name, "ph": "M", "pid": self.rank, "tid": tid, "args": args}
        self._events.append(json.dumps(event, separators=(",", ":")))

    def record(self, work: Work) -> None:
        """Buffer the complete event of `work`, which has just completed."""
        end = time.perf_counter()
        group = work._comm.name
        tid = self._tids.get(group)
        if tid is None:
            tid = self._tids[group] = len(self._tids) + 1
            self._meta("thread_name", tid, {"name": group})
        args: dict[str, Any] = {
            "op": work.op,
            "seq": work.seq,
            "group": group,
            "transport": None,
            "bytes": None,
            "stages": None,
        }
        if work.info:
            args.update(work.info)
        event = {
            "name": work.op,
            "cat": "hetcomm",
            "ph": "X",
            "ts": round((self._wall0 + work._t0) * 1e6, 3),
            "dur": round((end - work._t0) * 1e6, 3),
            "pid": self.rank,
            "tid": tid,
            "args": args,
        }
        self._events.append(json.dumps(event, separators=(",", ":"), default=str))
        self.count += 1
        if len(self._events) >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        """Write the buffered events; the file is then a complete JSON document."""
        with self._lock:
            if self._file is None or not self._events:
                return
            events, self._events = self._events, []
            text = ("" if self._first else ",\n") + ",\n".join(events)
            self._first = False
            try:
                self._file.seek(self._end)
                self._file.write(text.encode())
                self._end = self._file.tell()
                self._file.write(_FOOTER)
                self._file.flush()
            except OSError as exc:  # a full disk must not fail the operations being traced
                logging.getLogger("hetcomm").warning("trace %s: %s; tracing stops", self.path, exc)
                _work.remove_observer(self.record)
                self._file = None

    def close(self) -> None:
        """Write what is buffered and close the file. Idempotent."""
        self.flush()
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def _world_rank() -> int:
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        return int(mpi.COMM_WORLD.Get_rank())
    for name in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def enable(directory: str, rank: int | None = None, flush_every: int = FLUSH_EVERY) -> TraceWriter:
    """Trace every operation of this process into `directory` from now on (closing an earlier
    trace of this process first)."""
    global _writer
    _work.remove_observer(_decide)  # switched by hand: no completion decides any more
    with _lock:
        old, _writer = _writer, None
    if old is not None:
        old.close()
    writer = TraceWriter(directory, _world_rank() if rank is None else rank, flush_every)
    with _lock:
        _writer = writer
    _work.add_observer(writer.record)
    return writer


def disable() -> None:
    """Stop tracing in this process and write out what was recorded."""
    global _writer
    _work.remove_observer(_decide)
    with _lock:
        old, _writer = _writer, None
    if old is not None:
        _work.remove_observer(old.record)
        old.close()


def current() -> TraceWriter | None:
    """The writer in use, or None when this process does not trace."""
    return _writer


def reset() -> None:
    """Stop tracing and leave it undecided, as in a fresh process: the next operation that
    completes decides from its communicator's config."""
    disable()
    _work.add_observer(_decide)


def decide(config: Any) -> None:
    """Decide now, from `config`, if nothing has decided yet: each Communicator does when it
    is made, so that its first operations can take the calls that make no Work."""
    if not _work.remove_observer(_decide):
        return
    if config.trace is not None:
        enable(config.trace)


def _decide(work: Work) -> None:
    """The first completed operation decides, from its communicator's config, whether this
    process traces; the decision runs once (a second thread that raced it leaves it alone)."""
    if not _work.remove_observer(_decide):
        return
    directory = work._comm.config.trace
    if directory is None:
        return
    enable(directory).record(work)


# undecided until the first operation completes
_work.add_observer(_decide)


@atexit.register
def _close_at_exit() -> None:
    if _writer is not None:
        _writer.close()


# ---- merging ------------------------------------------------------------------------------------


def read_events(path: str) -> list[dict[str, Any]]:
    """The events of one rank's file; a file cut short (a rank killed mid-write) is read event
    by event, one per line, keeping every line that parses."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        events: list[dict[str, Any]] = json.loads(text)["traceEvents"]
        return events
    except (ValueError, KeyError, TypeError):
        pass
    found = []
    for line in text.splitlines():
        line = line.strip().rstrip(",")
        if not (line.startswith("{") and line.endswith("}")):
            continue
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and "ph" in event:
            found.append(event)
    return found


def merge(directory: str, out: str) -> int:
    """Merge the per-rank files of `directory` into one Chrome trace `out`; the number of
    complete events written."""
    paths = sorted(glob.glob(os.path.join(directory, FILE_PATTERN)))
    if not paths:
        raise FileNotFoundError(f"no {FILE_PATTERN} files in {directory}")
    meta: list[dict[str, Any]] = []
    spans: list[dict[str, Any]] = []
    for path in paths:
        for event in read_events(path):
            (meta if event.get("ph") == "M" else spans).append(event)
    spans.sort(key=lambda e: (e.get("ts", 0), e.get("pid", 0)))
    merged = {
        "displayTimeUnit": "ms",
        "otherData": {
            "producer": "hetcomm merge-trace",
            "files": [os.path.basename(p) for p in paths],
        },
        "traceEvents": meta + spans,
    }
    with open(out, "w", encoding="utf-8") as f:
        json.dump(merged, f, separators=(",", ":"))
        f.write("\n")
    return sum(1 for e in spans if e.get("ph") == "X")


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m hetcomm.trace merge DIR OUT.json`: merge a directory of rank traces."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 3 or args[0] != "merge":
        print("usage: python -m hetcomm.trace merge DIR OUT.json", file=sys.stderr)
        return 2
    try:
        count = merge(args[1], args[2])
    except FileNotFoundError as exc:
        print(f"merge-trace: {exc}", file=sys.stderr)
        return 1
    print(f"merge-trace: {count} operations from {args[1]} -> {args[2]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
