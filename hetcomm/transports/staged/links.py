"""Rails: the links a staged transfer stripes its chunks over (tcp per NIC, shm, mpi)."""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import secrets
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("hetcomm")

# Every message on a rail starts with this header: kind, slot, op id, chunk index, byte offset,
# byte count. DATA is followed by the payload on the same link; SLOT says the payload lies in
# shared slot `slot`; FREE hands a shared slot back; ERROR fails the op on the receiver; BYE
# closes the link; CTS is a receive's clear-to-send (its kind in `slot`, its two keys in `chunk`
# and `offset`). Nothing on a rail is ever unpickled: headers are fixed binary structs.
HEADER = struct.Struct("<Bxxxi4Q")
# ACK: the receiver has written chunk `chunk` of its op `op`; until then the sender keeps the
# chunk, and puts it back for the other rails if this link dies in either direction.
# WAKE: a thread of the peer dozes on a board of the pair (board.py) that this rank just wrote.
DATA, SLOT, FREE, ERROR, BYE, ACK, CTS, WAKE = 1, 2, 3, 4, 5, 6, 7, 8
# The first bytes of a connection: the listener's token, the connecting rank, the rail index.
HELLO = struct.Struct("<16sII")
TOKEN_BYTES = 16
HELLO_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class RailSpec:
    """One rail of a pair of ranks: its kind and the local and remote addresses it joins."""

    kind: str  # "tcp", "shm" or "mpi"
    index: int
    local: str = ""  # tcp: this rank's IPv4 address; shm: unused
    remote: str = ""  # tcp: the peer's IPv4 address
    port: int = 0  # tcp: the peer's listening port for this rail

    def __str__(self) -> str:
        if self.kind == "tcp":
            return f"tcp{self.index} {self.local} -> {self.remote}:{self.port}"
        return f"{self.kind}{self.index}"


class RailError(ConnectionError):
    """A rail broke (peer gone, connection reset, bad token); its chunks go to other rails."""


class Link:
    """A connected stream socket carrying headers and payloads; safe for one sender thread and
    one receiver thread at a time."""

    def __init__(self, sock: socket.socket, spec: RailSpec, peer: int) -> None:
        self.sock = sock
        self.spec = spec
        self.peer = peer
        self.sent_bytes = 0
        self.alive = True
        self._send_lock = threading.Lock()
        # chunks sent on this link and not yet acknowledged: (receiver op id, chunk) -> item
        self.unacked: dict[tuple[int, int], Any] = {}
        # notified when an acknowledgement or a failure empties `unacked` (rail windows)
        self.unacked_lock = threading.Condition()
        sock.settimeout(None)
        if sock.family != socket.AF_UNIX:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(
        self,
        kind: int,
        slot: int,
        op: int,
        chunk: int,
        offset: int,
        nbytes: int,
        payload: Any = None,
    ) -> None:
        """Send one message; raises RailError when the link is broken."""
        head = HEADER.pack(kind, slot, op, chunk, offset, nbytes)
        try:
            with self._send_lock:
                if payload is None:
                    self.sock.sendall(head)
                else:
                    self.sock.sendall(head)
                    self.sock.sendall(payload)
                    self.sent_bytes += nbytes
        except OSError as exc:
            self.alive = False
            raise RailError(f"rail {self.spec} to rank {self.peer}: {exc}") from exc

    def recv_header(self) -> tuple[int, int, int, int, int, int]:
        """Read one header: (kind, slot, op, chunk, offset, nbytes)."""
        buf = bytearray(HEADER.size)
        self.recv_into(memoryview(buf))
        kind, slot, op, chunk, offset, nbytes = HEADER.unpack(buf)
        return kind, slot, op, chunk, offset, nbytes

    def recv_into(self, view: memoryview) -> None:
        """Fill `view` exactly; raises RailError when the link closes first."""
        got, n = 0, len(view)
        try:
            while got < n:
                k = self.sock.recv_into(view[got:], n - got)
                if k == 0:
                    raise RailError(f"rail {self.spec} from rank {self.peer}: closed by the peer")
                got += k
        except OSError as exc:
            self.alive = False
            raise RailError(f"rail {self.spec} from rank {self.peer}: {exc}") from exc

    def close(self) -> None:
        """Shut the socket down and close it; the link is dead from now on."""
        self.alive = False
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()


class Listener:
    """Listening sockets of one rank: one per tcp rail address and one unix socket for shm
    doorbells. Accepts only connections that present this rank's token."""

    def __init__(self, addresses: list[str], token: bytes, rank: int) -> None:
        self.token = token
        self.rank = rank
        self.ports: dict[str, int] = {}
        self._socks: list[socket.socket] = []
        self._arrived: dict[tuple[int, int], socket.socket] = {}
        self._cond = threading.Condition()
        self._closed = False
        self.refused = 0
        for addr in addresses:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((addr, 0))
            s.listen(64)
            self.ports[addr] = s.getsockname()[1]
            self._socks.append(s)
        # abstract unix socket: no file to clean up, visible only inside this network namespace
        self.unix_name = f"hetcomm-{os.getpid()}-{secrets.token_hex(6)}"
        u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        u.bind("\0" + self.unix_name)
        u.listen(64)
        self._socks.append(u)
        self._thread = threading.Thread(
            target=self._accept_loop, name="hetcomm-accept", daemon=True
        )
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                ready, _, _ = select.select(self._socks, [], [], 0.2)
            except (OSError, ValueError):
                return
            for s in ready:
                try:
                    conn, addr = s.accept()
                except OSError:
                    continue
                threading.Thread(target=self._greet, args=(conn, addr), daemon=True).start()

    def _greet(self, conn: socket.socket, addr: Any) -> None:
        conn.settimeout(HELLO_TIMEOUT_S)
        try:
            data = b""
            while len(data) < HELLO.size:
                part = conn.recv(HELLO.size - len(data))
                if not part:
                    raise OSError("closed before the hello")
                data += part
            token, peer, rail = HELLO.unpack(data)
        except OSError as exc:
            self._refuse(conn, addr, f"no valid hello ({exc})")
            return
        if not hmac.compare_digest(token, self.token):
            self._refuse(conn, addr, "wrong token")
            return
        with self._cond:
            self._arrived[(peer, rail)] = conn
            self._cond.notify_all()

    def _refuse(self, conn: socket.socket, addr: Any, why: str) -> None:
        self.refused += 1
        log.warning("rank %d refused a rail connection from %s: %s", self.rank, addr or "unix", why)
        with contextlib.suppress(OSError):
            conn.close()

    def take(self, peer: int, rail: int, deadline: float) -> socket.socket:
        """The connection `peer` opened for `rail`, waiting until `deadline` (monotonic)."""
        with self._cond:
            while (peer, rail) not in self._arrived:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    raise RailError(f"rank {peer} did not connect rail {rail} in time")
                self._cond.wait(min(left, 0.5))
            return self._arrived.pop((peer, rail))

    def close(self) -> None:
        """Close every listening socket."""
        self._closed = True
        for s in self._socks:
            with contextlib.suppress(OSError):
                s.close()
        with self._cond:
            for conn in self._arrived.values():
                with contextlib.suppress(OSError):
                    conn.close()
            self._arrived.clear()
            self._cond.notify_all()


def connect(
    spec: RailSpec, peer: int, token: bytes, rank: int, unix_name: str, deadline: float
) -> socket.socket:
    """Open `spec` to `peer` (bound to the rail's own address) and present `token`."""
    while True:
        try:
            if spec.kind == "shm":
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(max(0.1, deadline - time.monotonic()))
                s.connect("\0" + unix_name)
            else:
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                s.settimeout(max(0.1, deadline - time.monotonic()))
                s.bind((spec.local, 0))  # leave through this rail's NIC
                s.connect((spec.remote, spec.port))
            s.sendall(HELLO.pack(token, rank, spec.index))
            return s
        except OSError as exc:
            with contextlib.suppress(Exception):
                s.close()
            if time.monotonic() >= deadline:
                raise RailError(f"cannot open rail {spec} to rank {peer}: {exc}") from exc
            time.sleep(0.05)


def new_token() -> bytes:
    """A fresh random token for a listener."""
    return secrets.token_bytes(TOKEN_BYTES)
