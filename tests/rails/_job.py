"""One MPI job of the rail tests: `python -m mpi4py _job.py SCENARIO [JSON parameters]`.

Every rank prints one line `RESULT {json}` (its findings) and exits 0 unless the job itself
broke; the test that started the job (tests/rails/test_*.py) parses those lines. Two ranks,
HETCOMM_TRANSPORT=staged. Each rank stands for its own host when the parameters say
`"hosts": true` (HETCOMM_HOST=host<rank>, given through the Config), so that tcp rails join them.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

import hetcomm
from hetcomm.arrays import as_buffer
from hetcomm.testing import simulated_config

WORLD = MPI.COMM_WORLD
RANK = WORLD.Get_rank()
MiB = 1 << 20


def open_comm(params: dict[str, Any], **options: Any) -> Any:
    """A communicator over COMM_WORLD; each rank its own host when params['hosts']."""
    hosts = [f"host{i}" for i in range(WORLD.Get_size())] if params.get("hosts") else None
    return hetcomm.init(config=simulated_config(RANK, hosts=hosts, **options))


def staged(comm: Any, chunk_bytes: int | None = None) -> Any:
    """The communicator's staged transport, made now (before any operation) so that its chunk
    size can still be changed. These jobs test the rails: eager messages are off."""
    comm._transport("send", as_buffer(np.zeros(1, np.uint8)))
    t = comm._transports["staged"]
    t.eager_bytes = 0
    if chunk_bytes is not None:
        t.chunk_bytes = chunk_bytes
    return t


def pattern(nbytes: int, seed: int) -> np.ndarray:
    """Bytes that differ from chunk to chunk and from message to message."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def rail_bytes(t: Any) -> dict[str, int]:
    """transport.stats summed per rail: 'tcp0 127.0.1.1 -> ...' counts as 'tcp0'."""
    out: dict[str, int] = {}
    for name, n in list(t.stats.items()):
        key = name.split()[0]
        out[key] = out.get(key, 0) + n
    return out


def first_difference(got: np.ndarray, want: np.ndarray) -> str:
    if got.shape != want.shape:
        return f"shape {got.shape} != {want.shape}"
    bad = np.flatnonzero(got.reshape(-1).view(np.uint8) != want.reshape(-1).view(np.uint8))
    if not len(bad):
        return ""
    return f"{len(bad)} bytes differ, first at byte {int(bad[0])}"


def timed(call: Any, result: dict[str, Any], error: str, seconds: str) -> None:
    """Run `call()`, putting into `result` how long it took (key `seconds`) and what it raised,
    if anything (key `error`)."""
    t0 = time.monotonic()
    try:
        call()
    except Exception as exc:
        result[error] = f"{type(exc).__name__}: {exc}"
    result[seconds] = round(time.monotonic() - t0, 3)


def close(comm: Any, result: dict[str, Any]) -> None:
    """Close `comm` (also after a failed operation: that stops the transport's threads, which
    must not be inside MPI calls when MPI finalizes), timing it."""
    timed(comm.close, result, "close_error", "close_s")


# ---- scenarios --------------------------------------------------------------------------------


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
            "specs": [str(s) for s in t._channels[peer].specs] if peer in t._channels else [],
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


def _wait_until(what: Callable[[], bool], limit: float) -> bool:
    end = time.monotonic() + limit
    while not what():
        if time.monotonic() > end:
            return False
        time.sleep(0.0005)
    return True


def fail(params: dict[str, Any]) -> dict[str, Any]:
    """A large message from rank 0 to rank 1; while it is in flight, rank params['side'] shuts
    down link 0 (or every link, params['links'] == 'all') of its channel to the other rank."""
    comm = open_comm(params)
    t = staged(comm, params.get("chunk_bytes", 1 << 20))
    n = int(params.get("mib", 64) * MiB)
    data = pattern(n, 11)
    peer = 1 - comm.rank
    closer = params.get("side", 0)
    # open the channel first (a small message), so that the links exist when the big one starts
    warm = np.zeros(4, np.uint8)
    if comm.rank == 0:
        comm.send(warm, 1)
    else:
        comm.recv(warm, 0)
    t.stats.clear()
    ch = t._channels[peer]
    which = ch.links if params.get("links") == "all" else ch.links[:1]
    shut: dict[str, Any] = {}
    landed_before_cut = int(params.get("landed", 1))
    sent_before = [link.sent_bytes for link in ch.links]

    def cut() -> None:
        # the sender cuts once link 0 has carried a chunk of the message, the receiver once a
        # chunk has landed; "in_flight": the message was not complete yet when the cut came
        if comm.rank == 0:
            _wait_until(lambda: ch.links[0].sent_bytes - sent_before[0] >= t.chunk_bytes, 30)
            in_flight = sum(k.sent_bytes for k in ch.links) - sum(sent_before) < n
        else:
            ops: list[Any] = []

            def landed() -> bool:
                ops[:] = [op for op in list(t.receives.values()) if op.region.nbytes == n]
                # after params["landed"] chunks (default 1)
                return bool(ops) and ops[0].left <= len(ops[0].spans) - landed_before_cut

            _wait_until(landed, 30)
            in_flight = bool(ops) and ops[0].left > 0
        for link in which:
            try:
                link.sock.shutdown(socket.SHUT_RDWR)
            except OSError as exc:
                shut["error"] = str(exc)
        shut["after_s"] = round(time.monotonic() - t0, 4)
        shut["in_flight"] = in_flight

    WORLD.Barrier()
    t0 = time.monotonic()
    cutter = threading.Thread(target=cut, daemon=True)
    if comm.rank == closer:
        cutter.start()
    error, got = None, None
    try:
        if comm.rank == 0:
            comm.send(data, 1)
        else:
            got = np.zeros(n, np.uint8)
            comm.recv(got, 0)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    elapsed = time.monotonic() - t0
    if comm.rank == closer:
        cutter.join(5)
    result = {
        "error": error,
        "elapsed_s": round(elapsed, 3),
        "shut": shut,
        "rails": rail_bytes(t),
        "link_bytes": [link.sent_bytes - b for link, b in zip(ch.links, sent_before)],
        "alive": [link.alive for link in ch.links],
        "dead": list(ch.dead),
        "timeout": comm.config.timeout,
        "mismatch": first_difference(got, data) if got is not None and error is None else None,
    }
    close(comm, result)
    return result


def token(params: dict[str, Any]) -> dict[str, Any]:
    """Rank 0 knocks on rank 1's rail listener with a wrong token; rank 1 must refuse it and
    keep working."""
    from hetcomm.transports.staged import links

    comm = open_comm(params)
    t = staged(comm)
    refused_before = t.listener.refused  # before any traffic: the knock cannot come earlier
    data = pattern(3 * MiB + 5, 3)
    got = np.zeros_like(data)
    errors: list[str] = []
    # open the channel (rank 0 connects to rank 1's listener: it learns the port)
    if comm.rank == 0:
        comm.send(data, 1)
    else:
        comm.recv(got, 0)
    closed_by_peer, detail = None, ""
    if comm.rank == 0:
        spec = t._channels[1].specs[0]
        with socket.create_connection((spec.remote, spec.port), timeout=10) as s:
            s.sendall(b"\x5a" * links.HELLO.size)  # 24 bytes that are not rank 1's token
            s.settimeout(10)
            try:
                closed_by_peer = s.recv(1) == b""
                detail = "recv returned b''" if closed_by_peer else "the listener sent data"
            except ConnectionResetError:
                closed_by_peer, detail = True, "connection reset"
            except TimeoutError:
                closed_by_peer, detail = False, "still open after 10 s"
    WORLD.Barrier()
    if comm.rank == 1:
        _wait_until(lambda: t.listener.refused > refused_before, 20)
    refused = t.listener.refused - refused_before
    WORLD.Barrier()
    # the transport still works, both ways
    for src in (0, 1):
        got = np.zeros_like(data)
        if comm.rank == src:
            comm.send(data, 1 - src, tag=9)
        else:
            comm.recv(got, src, tag=9)
            why = first_difference(got, data)
            if why:
                errors.append(f"after the refusal, {src}->{1 - src}: {why}")
    x = np.full(1000, comm.rank + 1, np.int64)
    comm.all_reduce(x)
    if not (x == 3).all():
        errors.append(f"all_reduce after the refusal gave {x[:3]}")
    result = {
        "errors": errors,
        "refused": refused,
        "closed_by_peer": closed_by_peer,
        "detail": detail,
        "rails": rail_bytes(t),
    }
    close(comm, result)
    return result


def hello(params: dict[str, Any]) -> dict[str, Any]:
    """What the launch gave this rank: its host, its rails, and the rails to the other rank."""
    comm = open_comm(params)
    t = staged(comm)
    data = pattern(1 * MiB + 3, 8)
    got = np.zeros_like(data)
    if comm.rank == 0:
        comm.send(data, 1)
    else:
        comm.recv(got, 0)
    result = {
        "hosts": [r.host for r in comm.topology],
        "rails_config": comm.config.rails,
        "specs": [str(s) for s in t._channels[1 - comm.rank].specs],
        "mismatch": first_difference(got, data) if comm.rank == 1 else "",
        "rails": rail_bytes(t),
    }
    close(comm, result)
    return result


def gone(params: dict[str, Any]) -> dict[str, Any]:
    """After one message has opened the channel, rank 1 closes its communicator without posting
    a receive, and rank 0 sends to it: the send must fail at once, naming the rail, instead of
    waiting for the timeout (its clear-to-send can never come)."""
    comm = open_comm(params)
    staged(comm)
    data = pattern(64 * 1024, 5)
    got = np.zeros_like(data)
    if comm.rank == 0:
        comm.send(data, 1)
    else:
        comm.recv(got, 0)
    result: dict[str, Any] = {
        "error": None,
        "mismatch": first_difference(got, data) if comm.rank == 1 else "",
    }
    if comm.rank == 0:
        work = comm.send(data, 1, tag=3, async_op=True)  # waits for rank 1's clear-to-send
        WORLD.Barrier()  # rank 1 closes only now: the send is already waiting
        timed(work.wait, result, "error", "failed_after_s")
    else:
        WORLD.Barrier()
    close(comm, result)
    return result


def early(params: dict[str, Any]) -> dict[str, Any]:
    """Sends over shm that start before their receive is posted copy their first chunks into
    shared slots at once (early), and take the rest once the clear-to-send comes. Rank 0 sends,
    rank 1 receives; 4 KiB chunks, so a message of 40 KiB has eleven. In turn:
    - "late": one message, received 0.2 s after the send started;
    - "reversed": six messages in flight (tags 1-6), received in the reverse order with
      blocking receives: sends waiting for their clear-to-send hold at most half the slots,
      so the others always have slots;
    - "mismatch": the receive is 8 bytes short: both ranks fail, naming the sizes;
    - "timeout": a send whose receive never comes times out (1 s);
    and after each, every slot of rank 0 is free again and none is held early."""
    comm = open_comm(params)
    t = staged(comm, 4096)
    result: dict[str, Any] = {"errors": [], "early_slots": {}, "free_slots": {}, "slots": 0}
    nbytes = 40 * 1024 + 12

    def settle(case: str) -> None:
        # the receiver hands each slot back by a message: wait until all of them are back
        if comm.rank != 0:
            return
        ch = t._channels[1]
        _wait_until(lambda: len(ch.shm_out._free) == ch.shm_out.slots, 10)
        result["slots"] = ch.shm_out.slots
        result["early_slots"][case] = ch.early
        result["free_slots"][case] = len(ch.shm_out._free)

    # "late"
    data = pattern(nbytes, 11)
    got = np.zeros_like(data)
    if comm.rank == 0:
        comm.recv(got[:1], 1)  # opens the channel; rank 1 sends one byte first
        work = comm.send(data, 1, tag=1, async_op=True)
        result["early_chunks_late"] = len(
            t.cts.waiting and next(iter(t.cts.waiting.values()))[1].early
        )
        work.wait()
    else:
        comm.send(data[:1], 0)
        time.sleep(0.2)
        comm.recv(got, 0, tag=1)
        if d := first_difference(got, data):
            result["errors"].append(f"late: {d}")
    WORLD.Barrier()
    settle("late")
    # "reversed"
    msgs = [pattern(nbytes + 8 * k, 20 + k) for k in range(6)]
    if comm.rank == 0:
        works = [comm.send(m, 1, tag=k + 1, async_op=True) for k, m in enumerate(msgs)]
        for w in works:
            w.wait()
    else:
        time.sleep(0.2)
        for k in reversed(range(6)):
            out = np.zeros_like(msgs[k])
            comm.recv(out, 0, tag=k + 1)
            if d := first_difference(out, msgs[k]):
                result["errors"].append(f"reversed, tag {k + 1}: {d}")
    WORLD.Barrier()
    settle("reversed")
    # "mismatch"
    if comm.rank == 0:
        work = comm.send(data, 1, tag=7, async_op=True)
        timed(work.wait, result, "mismatch_error", "mismatch_s")
    else:
        time.sleep(0.2)
        short = np.zeros(nbytes - 8, np.uint8)
        timed(lambda: comm.recv(short, 0, tag=7), result, "mismatch_error", "mismatch_s")
    WORLD.Barrier()
    settle("mismatch")
    # "timeout"
    if comm.rank == 0:
        t.timeout = 1.0
        work = comm.send(data, 1, tag=8, async_op=True)
        timed(work.wait, result, "timeout_error", "timeout_s")
        t.timeout = 30.0
    WORLD.Barrier()
    settle("timeout")  # (the timeout has aborted rank 0's communicator, as any timeout does)
    close(comm, result)
    return result


def open_fails(params: dict[str, Any]) -> dict[str, Any]:
    """Rank 1 fails while their shm channel opens: after the first exchange (cards), where each
    rank has made its shared segment, it raises instead of sending the segment's name. Rank 0
    times out (2 s) waiting for it. Neither rank may leave its segment in /dev/shm."""
    comm = open_comm(params)
    t = staged(comm)
    t.timeout = 2.0
    peer = 1 - comm.rank
    mine = f"/dev/shm/hetcomm-{t.token.hex()[:12]}-{comm.rank}-{peer}"
    result: dict[str, Any] = {"error": None}
    if comm.rank == 1:
        swap, calls = t._swap, []

        def failing(values: dict[int, Any], deadline: float) -> dict[int, Any]:
            calls.append(values)
            if len(calls) == 2:  # the segments' names
                result["made"] = os.path.exists(mine)
                raise RuntimeError("injected failure while opening the channel")
            return swap(values, deadline)

        t._swap = failing
    data = np.zeros(1024, np.uint8)
    if comm.rank == 0:
        timed(lambda: comm.send(data, 1), result, "error", "failed_after_s")
    else:
        timed(lambda: comm.recv(data, 0), result, "error", "failed_after_s")
    result["left"] = os.path.exists(mine)
    WORLD.Barrier()
    close(comm, result)
    return result


def close_waiting(params: dict[str, Any]) -> dict[str, Any]:
    """Rank 0 closes its communicator while a send to rank 1, whose receive never comes, waits
    with early chunks in the shared slots: the send fails saying so, and close returns."""
    comm = open_comm(params)
    t = staged(comm, 4096)
    data = pattern(64 * 1024, 3)
    result: dict[str, Any] = {"error": None, "early_chunks": 0}
    if comm.rank == 0:
        comm.send(data[:1], 1)  # opens the channel
        work = comm.send(data, 1, tag=5, async_op=True)
        waiting = list(t.cts.waiting.values())
        result["early_chunks"] = len(waiting[0][1].early) if waiting else 0
        close(comm, result)
        result["held_after_close"] = t._channels[1].early  # slots still held by waiting sends
        timed(work.wait, result, "error", "failed_after_s")
        WORLD.Barrier()
    else:
        comm.recv(data[:1], 0)
        WORLD.Barrier()  # rank 0 has closed
        close(comm, result)
    return result


def sender_closes_first(params: dict[str, Any]) -> dict[str, Any]:
    """Rank 0's send completes once its chunks are announced, and rank 0 closes its transport
    at once, while rank 1, slowed down (0.8 s a chunk), still lands them: its slot hand-backs
    then find rank 0's socket closed. The receive must still complete with every byte (they
    are in the shared segment rank 1 has mapped)."""
    comm = open_comm(params)
    t = staged(comm, 1 << 20)
    data = pattern((4 << 20) + 5, 8)
    got = np.zeros_like(data)
    result: dict[str, Any] = {"errors": [], "error": None}
    comm.barrier()
    if comm.rank == 0:
        comm.send(data[:1], 1)  # opens the channel
        comm.send(data, 1, tag=2)
        close(comm, result)
    else:
        comm.recv(got[:1], 0)
        ch = t._channels[0]
        deliver = ch._deliver

        def slow(op: Any, off: int, chunk: np.ndarray) -> None:
            time.sleep(0.8)
            deliver(op, off, chunk)

        ch._deliver = slow
        timed(lambda: comm.recv(got, 0, tag=2), result, "error", "recv_s")
        if d := first_difference(got, data):
            result["errors"].append(d)
        close(comm, result)
    return result


SCENARIOS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "close_waiting": close_waiting,
    "sender_closes_first": sender_closes_first,
    "early": early,
    "open_fails": open_fails,
    "roundtrip": roundtrip,
    "stripe": stripe,
    "fail": fail,
    "token": token,
    "hello": hello,
    "gone": gone,
}


def main() -> None:
    name = sys.argv[1]
    params = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    try:
        result = SCENARIOS[name](params)
    except Exception as exc:
        result = {"crash": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
    result["rank"] = RANK
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
