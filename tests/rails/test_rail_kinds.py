"""Every rail kind carries staged send/recv and all_reduce correctly; two tcp rails share a
message. Jobs of 2 ranks with HETCOMM_TRANSPORT=staged, on plain loopback."""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import pytest
from _rails import (
    TWO_RAILS,
    MiB,
    close,
    first_difference,
    open_comm,
    pattern,
    rail_bytes,
    staged,
)

import hetcomm
from hetcomm import introspect

# rail kind -> (HETCOMM_* variables, each rank its own host?)
KINDS = {
    "shm": ({}, False),  # one host: shared memory
    "tcp": ({"HETCOMM_RAILS": TWO_RAILS}, True),  # two simulated hosts, two loopback rails
    "mpi": ({"HETCOMM_RAILS": "mpi"}, True),  # the MPI rail
}
# one communicator each (the chunk size is set before its first operation); zero-length and
# one-element arrays in each
CHUNKINGS = [
    # 4096 B and 16384 B messages are 1 and 4 whole chunks
    {
        "name": "chunks-divide",
        "dtype": "float32",
        "chunk_bytes": 4096,
        "counts": [0, 1, 1024, 4096],
    },
    # 7992 B and 20000 B are not multiples of 3000
    {
        "name": "chunks-do-not-divide",
        "dtype": "float64",
        "chunk_bytes": 3000,
        "counts": [0, 1, 999, 2500],
    },
    # an odd chunk size also splits elements between chunks
    {"name": "odd-chunk", "dtype": "int16", "chunk_bytes": 1001, "counts": [0, 1, 3001]},
]


# ids "shm-rail", ...: a test id "mpi" would look like pytest-mpi's marker and be skipped
@pytest.mark.parametrize("kind", list(KINDS), ids=[f"{k}-rail" for k in KINDS])
def test_rail_carries_send_recv_and_all_reduce(job, kind):
    variables, hosts = KINDS[kind]
    done = job(roundtrip, {"hosts": hosts, "chunkings": CHUNKINGS}, **variables)
    for r in done.ranks():
        assert r["errors"] == [], f"rank {r['rank']}: {r['errors']}\n{done.explain()}"
        assert set(r["cases"]) == {c["name"] for c in CHUNKINGS}
        for chunking in CHUNKINGS:
            case = r["cases"][chunking["name"]]
            assert case["chunk_bytes"] == chunking["chunk_bytes"]
            # the rails between the two ranks are of the expected kind; only they carried bytes
            assert case["specs"] and all(s.startswith(kind) for s in case["specs"]), case
            assert case["rails"] and all(n.startswith(kind) for n in case["rails"]), case
    assert done.returncode == 0, done.explain()


def test_two_tcp_rails_both_carry_bytes(job):
    """16 MiB in 256 KiB chunks from rank 0 to rank 1: both rails take chunks, and together
    exactly the message (no chunk sent twice)."""
    done = job(
        stripe, {"hosts": True, "mib": 16, "chunk_bytes": 256 << 10}, HETCOMM_RAILS=TWO_RAILS
    )
    sender, receiver = done.ranks()
    assert receiver["errors"] == [], done.explain()
    rails = sender["rails"]
    assert set(rails) == {"tcp0", "tcp1"}, f"bytes per rail: {rails}"
    assert min(rails.values()) > 0, f"a rail carried nothing: {rails}"
    assert sum(rails.values()) == 16 << 20, f"bytes per rail: {rails}"
    assert done.returncode == 0, done.explain()


# ---- the rank side: scenarios run on every rank of a job (hetcomm.testing.run_scenario) ----


def roundtrip(params: dict[str, Any]) -> dict[str, Any]:
    """For each chunking {name, dtype, chunk_bytes, counts} in params['chunkings'], on a fresh
    communicator (the chunk size is set before its first operation), and for each element
    count: send/recv 0->1 and 1->0, all_reduce SUM in place and all_reduce MAX out of place."""
    out: dict[str, Any] = {"errors": [], "cases": {}}
    for chunking in params["chunkings"]:
        comm = open_comm(params)
        t = staged(comm, chunking["chunk_bytes"])
        errors = _roundtrip(comm, np.dtype(chunking["dtype"]), chunking["counts"])
        peer = 1 - comm.rank
        out["errors"] += [f"{chunking['name']}: {e}" for e in errors]
        out["cases"][chunking["name"]] = {
            "rails": rail_bytes(t),
            "specs": [str(s) for s in introspect.channels(t)[peer].specs]
            if peer in introspect.channels(t)
            else [],
            "chunk_bytes": t.chunk_bytes,
        }
        close(comm, out)
    return out


def _roundtrip(comm: Any, dtype: np.dtype, counts: list[int]) -> list[str]:
    peer = 1 - comm.rank
    errors: list[str] = []

    def draw(seed: int, count: int) -> np.ndarray:
        # whole numbers: sums are exact in every dtype, so results compare bit for bit
        return np.random.default_rng(seed).integers(-1000, 1000, count).astype(dtype)

    for case, count in enumerate(counts):
        for src in (0, 1):
            data = draw(1000 * case + src, count)
            if comm.rank == src:
                sent = data.copy()
                comm.send(sent, peer, tag=case)
                if first_difference(sent, data):
                    errors.append(f"count {count}: send changed its input")
            else:
                got = np.full(count, 7, dtype=dtype)
                comm.recv(got, src, tag=case)
                why = first_difference(got, data)
                if why:
                    errors.append(f"count {count}, send {src}->{comm.rank}: {why}")
        ins = [draw(77 + 10 * case + r, count) for r in range(comm.size)]  # every rank's input
        x = ins[comm.rank].copy()
        comm.all_reduce(x)
        why = first_difference(x, np.sum(ins, axis=0).astype(dtype))
        if why:
            errors.append(f"count {count}: all_reduce SUM: {why}")
        y = np.full(count, 7, dtype=dtype)
        comm.all_reduce(ins[comm.rank], out=y, op=hetcomm.ReduceOp.MAX)
        why = first_difference(y, np.max(ins, axis=0).astype(dtype))
        if why:
            errors.append(f"count {count}: all_reduce MAX out of place: {why}")
    return errors


def stripe(params: dict[str, Any]) -> dict[str, Any]:
    """Rank 0 sends params['mib'] MiB to rank 1 in small chunks: which rails carried them?"""
    comm = open_comm(params)
    t = staged(comm, params.get("chunk_bytes", 256 << 10))
    if "weights" in params:  # one per rail of HETCOMM_RAILS, as `hetcomm tune` gives them
        addrs = os.environ["HETCOMM_RAILS"].split(",")  # the same list on both ranks
        t.rail_weights = {f"tcp {a}->{a}": w for a, w in zip(addrs, params["weights"])}
    n = int(params.get("mib", 16) * MiB)
    data = pattern(n, 5)
    errors: list[str] = []
    comm.barrier()
    start = time.monotonic()
    if comm.rank == 0:
        comm.send(data, 1)
    else:
        got = np.zeros(n, np.uint8)
        comm.recv(got, 0)
        why = first_difference(got, data)
        if why:
            errors.append(why)
    result = {"errors": errors, "rails": rail_bytes(t), "seconds": time.monotonic() - start}
    close(comm, result)
    return result
