"""Rail listeners accept only connections that present their token, and only on their addresses.

One MPI job (a stranger knocking on a live transport's listener), and checks of the Listener on
its own in this process (no MPI needed).
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
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
    world,
)

from hetcomm import introspect
from hetcomm.transports.staged import links


def test_wrong_token_is_refused_and_the_transport_keeps_working(job):
    done = job(token, {"hosts": True}, HETCOMM_RAILS=TWO_RAILS)
    knocker, listener = done.ranks()
    assert knocker["closed_by_peer"] is True, f"the listener did not close it: {knocker['detail']}"
    assert listener["refused"] == 1, done.explain()
    assert "refused a rail connection" in done.stderr and "wrong token" in done.stderr
    for r in (knocker, listener):
        assert r["errors"] == [], f"rank {r['rank']}: {r['errors']}"
    assert done.returncode == 0, done.explain()


# ---- the Listener by itself -------------------------------------------------------------------

ADDR = "127.0.3.1"


@pytest.fixture
def listener() -> Iterator[links.Listener]:
    lst = links.Listener([ADDR], links.new_token(), rank=1)
    yield lst
    lst.close()


def _closed_by_peer(s: socket.socket, limit: float = 5) -> bool:
    s.settimeout(limit)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _refusals(lst: links.Listener, at_least: int, limit: float = 5) -> int:
    end = time.monotonic() + limit
    while lst.refused < at_least and time.monotonic() < end:
        time.sleep(0.01)
    return lst.refused


@pytest.mark.parametrize(
    "hello",
    [b"\0" * links.HELLO.size, b"short", b""],
    ids=["wrong-token", "short-hello", "nothing"],
)
def test_listener_refuses_a_bad_hello(listener, hello, caplog):
    port = listener.ports[ADDR]
    with socket.create_connection((ADDR, port), timeout=5) as s:
        if hello:
            s.sendall(hello)
        if len(hello) < links.HELLO.size:
            s.shutdown(socket.SHUT_WR)  # a hello that ends early
        assert _closed_by_peer(s)
    assert _refusals(listener, 1) == 1
    assert "refused a rail connection" in caplog.text


def test_listener_takes_a_connection_with_its_token(listener):
    spec = links.RailSpec("tcp", 0, ADDR, ADDR, listener.ports[ADDR])
    with contextlib.closing(
        links.connect(spec, 1, listener.token, 0, listener.unix_name, time.monotonic() + 5)
    ) as out:
        conn = listener.take(0, 0, time.monotonic() + 5)
        with contextlib.closing(conn):
            out.sendall(b"ping")
            assert conn.recv(4) == b"ping"
    assert listener.refused == 0


def test_listener_binds_only_its_addresses(listener):
    port = listener.ports[ADDR]
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


# ---- the rank side: scenarios run on every rank of a job (hetcomm.testing.run_scenario) ----


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
        spec = introspect.channels(t)[1].specs[0]
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
    world().Barrier()
    if comm.rank == 1:
        _wait_until(lambda: t.listener.refused > refused_before, 20)
    refused = t.listener.refused - refused_before
    world().Barrier()
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
