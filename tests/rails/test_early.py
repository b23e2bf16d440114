"""Shared slots of the shm rail: sends that start before their receive is posted stage their first
chunks early, and every slot comes back whatever becomes of the send; a channel that fails to
open leaves no segment behind; a receiver still landing chunks after its sender closed gets them
all."""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
from _rails import (
    _wait_until,
    close,
    first_difference,
    open_comm,
    pattern,
    staged,
    timed,
    world,
)

from hetcomm import introspect


def test_early_chunks_go_and_every_slot_comes_back(job):
    done = job(early)
    sender, receiver = done.ranks()
    for r in (sender, receiver):
        assert r["errors"] == [], f"rank {r['rank']}: {r['errors']}\n{done.explain()}"
    # the first send found its receive not yet posted and staged chunks early (at most half
    # the slots, at most early_chunks of them)
    assert 1 <= sender["early_chunks_late"] <= min(4, sender["slots"] // 2), done.explain()
    for case in ("late", "reversed", "mismatch", "timeout"):
        assert sender["early_slots"][case] == 0, (case, done.explain())
        assert sender["free_slots"][case] == sender["slots"], (case, done.explain())
    for r in (sender, receiver):
        assert "40972 bytes" in r.get("mismatch_error", ""), done.explain()
        assert "40964" in r.get("mismatch_error", ""), done.explain()
    assert "CommTimeout" in sender.get("timeout_error", ""), done.explain()
    assert sender["timeout_s"] < 10, done.explain()
    assert done.returncode == 0, done.explain()


def test_a_channel_that_fails_to_open_leaves_no_segment(job):
    done = job(open_fails)
    sender, receiver = done.ranks()
    assert receiver.get("made") is True, done.explain()  # its segment existed when it failed
    assert "injected failure" in (receiver["error"] or ""), done.explain()
    assert "CommTimeout" in (sender["error"] or ""), done.explain()
    assert sender["failed_after_s"] < 10, done.explain()
    for r in (sender, receiver):
        assert r["left"] is False, f"rank {r['rank']} left its segment\n{done.explain()}"
    assert done.returncode == 0, done.explain()


def test_closing_with_a_send_waiting_on_early_chunks(job):
    done = job(close_waiting)
    sender, receiver = done.ranks()
    assert sender["early_chunks"] >= 1, done.explain()
    assert sender["held_after_close"] == 0, done.explain()  # their copies ended, slots given back
    assert "close_error" not in sender and sender["close_s"] < 5, done.explain()
    assert "closed while waiting to send" in (sender["error"] or ""), done.explain()
    assert "close_error" not in receiver, done.explain()
    assert done.returncode == 0, done.explain()


def test_a_receive_completes_after_its_sender_closed(job):
    done = job(sender_closes_first)
    _, receiver = done.ranks()
    assert receiver["error"] is None and receiver["errors"] == [], done.explain()
    assert receiver["recv_s"] > 2.5, done.explain()  # it outlasted the sender's close
    assert done.returncode == 0, done.explain()


# ---- the rank side: scenarios run on every rank of a job (hetcomm.testing.run_scenario) ----


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
        ch = introspect.channels(t)[1]
        _wait_until(lambda: introspect.free_slots(ch.shm_out) == ch.shm_out.slots, 10)
        result["slots"] = ch.shm_out.slots
        result["early_slots"][case] = ch.early
        result["free_slots"][case] = introspect.free_slots(ch.shm_out)

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
    world().Barrier()
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
    world().Barrier()
    settle("reversed")
    # "mismatch"
    if comm.rank == 0:
        work = comm.send(data, 1, tag=7, async_op=True)
        timed(work.wait, result, "mismatch_error", "mismatch_s")
    else:
        time.sleep(0.2)
        short = np.zeros(nbytes - 8, np.uint8)
        timed(lambda: comm.recv(short, 0, tag=7), result, "mismatch_error", "mismatch_s")
    world().Barrier()
    settle("mismatch")
    # "timeout"
    if comm.rank == 0:
        t.timeout = 1.0
        work = comm.send(data, 1, tag=8, async_op=True)
        timed(work.wait, result, "timeout_error", "timeout_s")
        t.timeout = 30.0
    world().Barrier()
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
        opener = t._opener  # the channel-opening exchange (staged/connect.py)
        swap, calls = opener._swap, []

        def failing(values: dict[int, Any], deadline: float) -> dict[int, Any]:
            calls.append(values)
            if len(calls) == 2:  # the segments' names
                result["made"] = os.path.exists(mine)
                raise RuntimeError("injected failure while opening the channel")
            return swap(values, deadline)

        opener._swap = failing
    data = np.zeros(1024, np.uint8)
    if comm.rank == 0:
        timed(lambda: comm.send(data, 1), result, "error", "failed_after_s")
    else:
        timed(lambda: comm.recv(data, 0), result, "error", "failed_after_s")
    result["left"] = os.path.exists(mine)
    world().Barrier()
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
        # slots still held by waiting sends
        result["held_after_close"] = introspect.channels(t)[1].early
        timed(work.wait, result, "error", "failed_after_s")
        world().Barrier()
    else:
        comm.recv(data[:1], 0)
        world().Barrier()  # rank 0 has closed
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
        ch = introspect.channels(t)[0]
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
