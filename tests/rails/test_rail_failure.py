"""A tcp rail that breaks while a 64 MiB message is in flight; every rail breaking.

The job opens the channel with a small message, then rank 0 sends 64 MiB (1 MiB chunks) over
two loopback rails while a thread of one rank shuts down a link's socket
(`introspect.channels(transport)[peer].links[i].sock.shutdown(SHUT_RDWR)`) once chunks are moving.
"""

from __future__ import annotations

from _rails import TWO_RAILS

MIB64 = 64 << 20
TIMEOUT_S = 6  # HETCOMM_TIMEOUT of these jobs: the failures below must come within it


def failing(job, side: int, links: str, landed: int = 1):
    """The job's result; run again (twice at most) should the message have been complete
    before the cut (a busy machine can starve the cutting thread)."""
    for _ in range(3):
        done = job(
            "fail",
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
    done = job("gone", {}, HETCOMM_TIMEOUT="20")
    sender, receiver = done.ranks()
    assert receiver["mismatch"] == "" and receiver["error"] is None, done.explain()
    assert sender["error"] and sender["error"].startswith("PeerLost"), done.explain()
    assert "send to rank 1" in sender["error"] and "shm" in sender["error"], sender["error"]
    assert sender["failed_after_s"] < 5, f"the send took {sender['failed_after_s']} s to fail"
    for r in (sender, receiver):
        assert "close_error" not in r and r["close_s"] < 10, r
    assert done.returncode == 0, done.explain()
