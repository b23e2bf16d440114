"""Peer memory mapping between processes of one host: CUDA IPC (HIP IPC on ROCm), cached.

A device pointer is described by its allocation (base, size, a never-reused buffer id) and its
offset in it. The allocation's IPC handle travels to a peer once; the peer opens it once and
keeps the mapping until the transport closes (a registration cache on both sides). Memory of
CuPy, torch's caching allocator and Numba all comes from cudaMalloc/hipMalloc, which IPC serves.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

log = logging.getLogger("hetcomm")

# one record per exposed buffer, exchanged over MPI as raw bytes
RECORD = np.dtype(
    [("id", "<u8"), ("offset", "<u8"), ("nbytes", "<u8"), ("has", "<u8"), ("handle", "V64")]
)
_WORDS = RECORD.itemsize // 8  # a record's 64-bit words: id, offset, nbytes, has, the handle
_BUFFER_ID = 7  # CU_POINTER_ATTRIBUTE_BUFFER_ID == HIP_POINTER_ATTRIBUTE_BUFFER_ID
_LAZY_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess / hipIpcMemLazyEnablePeerAccess


class _Driver:
    """The two driver queries the runtime API lacks: an allocation's range and its buffer id."""

    def __init__(self, hip: bool) -> None:
        if hip:
            lib = ctypes.CDLL("libamdhip64.so")
            self._range = lib.hipMemGetAddressRange
            self._attr = lib.hipPointerGetAttribute
        else:
            lib = ctypes.CDLL("libcuda.so.1")
            self._range = lib.cuMemGetAddressRange_v2
            self._attr = lib.cuPointerGetAttribute
        self._range.argtypes = [
            ctypes.POINTER(ctypes.c_uint64),
            ctypes.POINTER(ctypes.c_size_t),
            ctypes.c_uint64,
        ]
        self._attr.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]

    def buffer_id(self, ptr: int) -> int:
        """The never-reused id of the allocation holding device address `ptr` (one query)."""
        ident = ctypes.c_uint64()
        rc = self._attr(ctypes.byref(ident), _BUFFER_ID, ctypes.c_uint64(ptr))
        if rc != 0:
            raise RuntimeError(f"no buffer id for device address {ptr:#x} (error {rc})")
        return int(ident.value)

    def allocation(self, ptr: int) -> tuple[int, int, int]:
        """(base, size, buffer id) of the allocation holding device address `ptr`."""
        base, size, ident = ctypes.c_uint64(), ctypes.c_size_t(), ctypes.c_uint64()
        rc = self._range(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
        if rc != 0:
            raise RuntimeError(f"the driver does not know device address {ptr:#x} (error {rc})")
        rc = self._attr(ctypes.byref(ident), _BUFFER_ID, ctypes.c_uint64(ptr))
        if rc != 0:
            raise RuntimeError(f"no buffer id for device address {ptr:#x} (error {rc})")
        return int(base.value), int(size.value), int(ident.value)


class PeerMap:
    """Exports this rank's allocations and imports peers', each once (the registration cache)."""

    def __init__(self, cupy: Any) -> None:
        self.rt = cupy.cuda.runtime
        self.driver = _Driver(bool(getattr(self.rt, "is_hip", False)))
        # buffer id -> (base, record template: id, has, handle set) of each allocation of ours
        # described so far: ids are never reused, so a hit needs one driver query (the id)
        self._allocs: dict[int, tuple[int, np.ndarray]] = {}
        self._told: set[tuple[int, int]] = set()  # (peer, buffer id) that peer holds the handle of
        self._mapped: dict[tuple[int, int], int] = {}  # (peer, buffer id) -> our mapping's base
        self._known: dict[tuple[int, int], bytes] = {}  # handles received, not yet opened
        self.hits = 0
        self.misses = 0

    def describe(
        self, ptr: int, nbytes: int, audience: Iterable[int], full: bool = False
    ) -> np.ndarray:
        """The record of `nbytes` at `ptr` for the ranks in `audience`; the handle rides along
        only when one of them has not had it yet, or always (`full`: for records that may
        overtake or be overtaken by others, which cannot rely on an earlier one)."""
        ident = self.driver.buffer_id(ptr)
        known = self._allocs.get(ident)
        if known is None:
            base, _, ident = self.driver.allocation(ptr)
            template = np.zeros(1, RECORD)
            template["id"], template["has"] = ident, 1
            template["handle"] = np.frombuffer(bytes(self.rt.ipcGetMemHandle(base)), "V64")[0]
            known = self._allocs[ident] = (base, template)
        base, template = known
        rec = template.copy()
        words = rec.view(np.uint64)  # id, offset, nbytes, has, then the handle's 8 words
        words[1], words[2] = ptr - base, nbytes
        if not full:
            new = [p for p in audience if (p, ident) not in self._told]
            if new:
                self._told.update((p, ident) for p in new)
            else:
                words[3:] = 0  # no handle
        return rec

    def learn(self, peer: int, rec: np.void) -> None:
        """Keep the handle a record carries: `peer` will not send it again."""
        if int(rec["has"]):
            key = (peer, int(rec["id"]))
            if key not in self._mapped:
                self._known[key] = bytes(rec["handle"])

    def learn_rows(self, table: np.ndarray, ranks: Iterable[int]) -> None:
        """learn() every record of rows `ranks` of `table` (one row of records a rank), the
        records' words read in one pass: a structured field read costs about a microsecond."""
        words = table.view(np.uint64)
        for p in ranks:
            row = words[p].tolist()
            for at in range(0, len(row), _WORDS):
                key = (p, row[at])
                if row[at + 3] and key not in self._mapped:
                    self._known[key] = bytes(table[p, at // _WORDS]["handle"])

    def addresses(self, table: np.ndarray, col: int, rank: int, mine: int) -> list[int]:
        """Our address of column `col` of every rank's records in `table` (one row a rank;
        this rank's own: `mine`), the records' words read in one pass."""
        rows = table.view(np.uint64)[:, col * _WORDS : col * _WORDS + 4].tolist()
        return [
            mine if p == rank else self._mapping(p, ident, has, table, col) + offset
            for p, (ident, offset, _, has) in enumerate(rows)
        ]

    def row(self, table: np.ndarray, p: int) -> list[tuple[int, int]]:
        """(our address, bytes) of each record of row `p` of `table` (rank p's records; an
        empty one's (0, 0)), the words read in one pass."""
        words, out = table[p].view(np.uint64).tolist(), []
        for at in range(0, len(words), _WORDS):
            ident, offset, nbytes, has = words[at : at + 4]
            if not nbytes:
                out.append((0, 0))
                continue
            out.append((self._mapping(p, ident, has, table, at // _WORDS) + offset, nbytes))
        return out

    def _mapping(self, p: int, ident: int, has: int, table: np.ndarray, col: int) -> int:
        """_base for the record at `table[p, col]` whose words were read already: the record
        itself is taken out of the table only where the handle must be opened."""
        base = self._mapped.get((p, ident))
        if base is None:
            return self._base(p, ident, has, table[p, col])
        self.hits += 1
        return base

    def address(self, peer: int, rec: np.ndarray) -> tuple[int, int]:
        """Our address of the bytes a one-record array from `peer` describes, and their count:
        the record's words read in one pass."""
        ident, offset, nbytes, has = rec.view(np.uint64)[:4].tolist()
        return self._base(peer, ident, has, rec[0]) + offset, nbytes

    def resolve(self, peer: int, rec: np.void) -> int:
        """Our address of the bytes `rec` (sent by `peer`) describes, opening the handle once."""
        return self._base(peer, int(rec["id"]), int(rec["has"]), rec) + int(rec["offset"])

    def _base(self, peer: int, ident: int, has: int, rec: np.void) -> int:
        """Our mapping of `peer`'s allocation `ident`, opened from the handle learnt before or
        the one `rec` carries (has) the first time."""
        key = (peer, ident)
        base = self._mapped.get(key)
        if base is not None:
            self.hits += 1
            return base
        handle = self._known.pop(key, None)
        if handle is None and has:
            handle = bytes(rec["handle"])
        if handle is None:
            raise RuntimeError(
                f"rank {peer} sent no handle for buffer {ident} and it is not "
                "mapped here: the registration caches disagree"
            )
        base = int(self.rt.ipcOpenMemHandle(handle, _LAZY_PEER_ACCESS))
        self._mapped[key] = base
        self.misses += 1
        return base

    @property
    def mapped(self) -> int:
        """How many peer allocations this rank has mapped."""
        return len(self._mapped)

    def close(self) -> None:
        """Unmap every peer allocation this rank opened."""
        for base in self._mapped.values():
            try:
                self.rt.ipcCloseMemHandle(base)
            except Exception as exc:  # the others must still be closed
                log.debug("closing a peer mapping failed: %s", exc)
        self._mapped.clear()
        self._known.clear()
        self._told.clear()


class Described:
    """Full records (handles included) of this rank's buffers, kept per (address, bytes) while
    the allocation there is the one they were made for: its buffer id, never reused, is one
    driver query at each use. A training loop lends and reduces the same buffers call after
    call; describing them afresh each time (a range query, a record copied and filled, the
    records joined) took 15-25 us of a 4-rank all_reduce's 110 on an H100's host. A record
    handed out is shared by later calls of the same buffer: read it, never write it."""

    def __init__(self, peers: PeerMap, most: int = 4096) -> None:
        self.peers = peers
        self._most = most  # records kept; past it they start over instead of growing
        self._kept: dict[Any, tuple[Any, np.ndarray]] = {}

    def one(self, ptr: int, nbytes: int) -> np.ndarray:
        """The record (a one-record array) of `nbytes` at `ptr`."""
        ident = self.peers.driver.buffer_id(ptr)
        key = (ptr, nbytes)
        kept = self._kept.get(key)
        if kept is not None and kept[0] == ident:
            return kept[1]
        rec = self.peers.describe(ptr, nbytes, (), full=True)
        self._keep(key, ident, rec)
        return rec

    def many(self, spans: tuple[tuple[int, int], ...]) -> np.ndarray:
        """The records of `spans` ((address, bytes) each) as one array, an empty span's all
        zeros (no allocation to name)."""
        buffer_id = self.peers.driver.buffer_id
        kept = self._kept.get(spans)
        if kept is not None:
            for (ptr, n), ident in zip(spans, kept[0]):
                if n and buffer_id(ptr) != ident:
                    break
            else:
                return kept[1]
        recs = np.concatenate(
            [
                self.peers.describe(ptr, n, (), full=True) if n else np.zeros(1, RECORD)
                for ptr, n in spans
            ]
        )
        self._keep(spans, tuple(int(i) for i in recs["id"]), recs)
        return recs

    def _keep(self, key: Any, ident: Any, recs: np.ndarray) -> None:
        if len(self._kept) >= self._most:
            self._kept.clear()
        self._kept[key] = (ident, recs)


def probe(
    mpi_comm: Any, node_of: Sequence[int], has_device: Sequence[bool]
) -> list[str | None] | None:
    """Once per init, collective over `mpi_comm` (world ranks in order): can each rank map the
    memory of the other device ranks of its node? Ranks alone on their node, or without a
    device, take no part. Per rank: None where it can, else why not; None for all when nothing
    is to be mapped anywhere (Topology.with_peer_mapping keeps it for the plan)."""
    rank = mpi_comm.Get_rank()
    nodes: dict[int, list[int]] = {}
    for r, (node, dev) in enumerate(zip(node_of, has_device, strict=True)):
        if dev:
            nodes.setdefault(node, []).append(r)
    if not any(len(v) > 1 for v in nodes.values()):
        return None  # nothing to map anywhere: no collective needed, every rank knows it
    mine = nodes.get(node_of[rank], []) if has_device[rank] else []
    handle, why, mem = b"", None, None
    rt: Any = None
    if len(mine) > 1:
        try:
            import cupy

            rt = cupy.cuda.runtime
            mem = cupy.cuda.alloc(256)
            handle = bytes(rt.ipcGetMemHandle(mem.ptr))
        except Exception as exc:
            why = f"exporting device memory failed ({exc})"
    handles = mpi_comm.allgather(handle)
    if len(mine) > 1 and why is None:
        for peer in mine:
            if peer == rank:
                continue
            if not handles[peer]:
                why = f"rank {peer} could not export its memory"
                break
            try:
                ptr = rt.ipcOpenMemHandle(handles[peer], _LAZY_PEER_ACCESS)
                rt.ipcCloseMemHandle(ptr)
            except Exception as exc:
                why = (
                    f"opening rank {peer}'s memory handle failed ({exc}); IPC may be "
                    "disabled in this container"
                )
                break
    verdicts = mpi_comm.allgather(why)
    del mem
    for r, v in enumerate(verdicts):
        if v is not None and rank == 0:
            log.warning("peer mapping unavailable on world rank %d: %s; the plan uses staged", r, v)
    return list(verdicts)
