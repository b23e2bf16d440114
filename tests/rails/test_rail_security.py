"""Rail listeners accept only connections that present their token, and only on their addresses.

One MPI job (a stranger knocking on a live transport's listener), and checks of the Listener on
its own in this process (no MPI needed).
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator

import pytest
from _rails import TWO_RAILS

from hetcomm.transports.staged import links


def test_wrong_token_is_refused_and_the_transport_keeps_working(job):
    done = job("token", {"hosts": True}, HETCOMM_RAILS=TWO_RAILS)
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
