"""A tcp rail that breaks while a 64 MiB message is in flight; every rail breaking.

The job opens the channel with a small message, then rank 0 sends 64 MiB (1 MiB chunks) over
two loopback rails while a thread of one rank shuts down a link's socket
(`introspect.channels(transport)[peer].links[i].sock.shutdown(SHUT_RDWR)`) once chunks are moving.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import numpy as np
from _rails import (
    TWO_RAILS,
    MiB,
    _wait_until,
    close,
    first_difference,
    open_comm,
    pattern,
    rail_bytes,
    staged,
    timed,
    world,
)

from hetcomm import introspect

MIB64 = 64 << 20
TIMEOUT_S = 6  # HETCOMM_TIMEOUT of these jobs: the failures below must come within it


def failing(job, side: int, links: str, landed: int = 1):
    """The job's result; run again (twice at most) should the message have been complete
    before the cut (a busy machine can starve the cutting thread)."""
    for _ in range(3):
        done = job(
            fail,
            {
                "hosts": True,
                "side": side,
                "links": links,
                "mib": 64,
                "chunk_bytes": 1 << 20,
                "landed": landed,
            },
            HETCOMM_RAILS=TWO_RAILS,
            HETCOMM_TIMEOUT=str(TIMEOUT_S),
        )
        if len(done.results) == 2 and done.results[side].get("shut", {}).get("in_flight"):
            break
    return done


def test_sender_side_rail_failure_resends_on_the_other_rail(job):
    done = failing(job, side=0, links="one")
    sender, receiver = done.ranks()
    assert sender["shut"]["in_flight"], f"the link was cut too late: {sender['shut']}"
    assert sender["error"] is None and receiver["error"] is None, done.explain()
    assert receiver["mismatch"] == "", f"received bytes differ: {receiver['mismatch']}"
    rails = sender["rails"]
    # the cut rail carried a part, the other one the rest; no chunk counted twice
    assert 0 < rails.get("tcp0", 0) < MIB64, rails
    # bytes sent per rail count resends: chunks the cut rail had not seen acknowledged went
    # again over tcp1, and the receiver counted each chunk once (the data check above)
    assert rails.get("tcp1", 0) > 0 and sum(rails.values()) >= MIB64, rails
    assert sender["alive"] == [False, True]
    assert len(sender["dead"]) == 1 and sender["dead"][0].startswith("tcp0"), sender["dead"]
    assert "failed" in done.stderr and "other rails" in done.stderr, "the failure is not logged"
    assert done.returncode == 0, done.explain()


def test_receiver_side_rail_failure_resends_on_the_other_rail(job):
    # cut once 16 of the 64 chunks have landed: by then the sender has counted chunks that
    # still sit in the broken link's socket buffers
    done = failing(job, side=1, links="one", landed=16)
    sender, receiver = done.ranks()
    assert receiver["shut"]["in_flight"], f"the link was cut too late: {receiver['shut']}"
    assert sender["error"] is None and receiver["error"] is None, done.explain()
    assert receiver["mismatch"] == "", f"received bytes differ: {receiver['mismatch']}"


def test_no_rail_left_fails_cleanly_within_the_timeout(job):
    """Every link shut down by the sender: its send fails at once naming every rail; the
    receiver's recv fails with CommTimeout within HETCOMM_TIMEOUT; the job ends (no hang)."""
    done = failing(job, side=0, links="all")
    sender, receiver = done.ranks()
    assert sender["shut"]["in_flight"], f"the links were cut too late: {sender['shut']}"
    assert sender["error"] and sender["error"].startswith("PeerLost"), done.explain()
    # (the message names the rails whose send failed; a rail whose receiving thread saw the
    # break first is marked dead without being named in staged_channel.Channel.dead)
    assert "every rail to rank 1 failed: tcp" in sender["error"], sender["error"]
    assert sender["elapsed_s"] < TIMEOUT_S, f"the send took {sender['elapsed_s']} s to fail"
    # the receiver sees its links close too: it fails at once naming them (or, had it not
    # noticed, with CommTimeout at its deadline)
    assert receiver["error"] and receiver["error"].startswith(("PeerLost", "CommTimeout")), (
        done.explain()
    )
    assert receiver["elapsed_s"] < TIMEOUT_S + 3, f"the recv took {receiver['elapsed_s']} s"
    for r in (sender, receiver):
        assert "close_error" not in r and r["close_s"] < 10, r
    assert done.seconds < TIMEOUT_S + 40, done.explain()


def test_send_to_a_peer_that_closed_fails_at_once(job):
    """Over shm, a send waiting for the clear-to-send of a rank that then closes its transport
    fails as soon as the rail goes, not at HETCOMM_TIMEOUT."""
    done = job(gone, {}, HETCOMM_TIMEOUT="20")
    sender, receiver = done.ranks()
    assert receiver["mismatch"] == "" and receiver["error"] is None, done.explain()
    assert sender["error"] and sender["error"].startswith("PeerLost"), done.explain()
    assert "send to rank 1" in sender["error"] and "shm" in sender["error"], sender["error"]
    assert sender["failed_after_s"] < 5, f"the send took {sender['failed_after_s']} s to fail"
    for r in (sender, receiver):
        assert "close_error" not in r and r["close_s"] < 10, r
    assert done.returncode == 0, done.explain()


# ---- the rank side: scenarios run on every rank of a job (hetcomm.testing.run_scenario) ----


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
    ch = introspect.channels(t)[peer]
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

    world().Barrier()
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
        world().Barrier()  # rank 1 closes only now: the send is already waiting
        timed(work.wait, result, "error", "failed_after_s")
    else:
        world().Barrier()
    close(comm, result)
    return result
