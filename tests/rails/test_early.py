"""Shared slots of the shm rail: sends that start before their receive is posted stage their first
chunks early, and every slot comes back whatever becomes of the send; a channel that fails to
open leaves no segment behind; a receiver still landing chunks after its sender closed gets them
all."""

from __future__ import annotations


def test_early_chunks_go_and_every_slot_comes_back(job):
    done = job("early")
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
    done = job("open_fails")
    sender, receiver = done.ranks()
    assert receiver.get("made") is True, done.explain()  # its segment existed when it failed
    assert "injected failure" in (receiver["error"] or ""), done.explain()
    assert "CommTimeout" in (sender["error"] or ""), done.explain()
    assert sender["failed_after_s"] < 10, done.explain()
    for r in (sender, receiver):
        assert r["left"] is False, f"rank {r['rank']} left its segment\n{done.explain()}"
    assert done.returncode == 0, done.explain()


def test_closing_with_a_send_waiting_on_early_chunks(job):
    done = job("close_waiting")
    sender, receiver = done.ranks()
    assert sender["early_chunks"] >= 1, done.explain()
    assert sender["held_after_close"] == 0, done.explain()  # their copies ended, slots given back
    assert "close_error" not in sender and sender["close_s"] < 5, done.explain()
    assert "closed while waiting to send" in (sender["error"] or ""), done.explain()
    assert "close_error" not in receiver, done.explain()
    assert done.returncode == 0, done.explain()


def test_a_receive_completes_after_its_sender_closed(job):
    done = job("sender_closes_first")
    _, receiver = done.ranks()
    assert receiver["error"] is None and receiver["errors"] == [], done.explain()
    assert receiver["recv_s"] > 2.5, done.explain()  # it outlasted the sender's close
    assert done.returncode == 0, done.explain()
