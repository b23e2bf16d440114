"""A clear-to-send that cannot go because the peer's process is gone fails the receive with
PeerLost naming the peer, a HetcommError, not the rail's ConnectionError."""

from __future__ import annotations

import socket

import pytest
from mpi4py import MPI

from hetcomm.errors import HetcommError, PeerLost
from hetcomm.transports.staged import links
from hetcomm.transports.staged.cts import CTS_P2P, ClearToSend


class Channel:
    """A channel whose doorbell is the shm rail's socket, the peer's end closed."""

    def __init__(self, link: links.Link) -> None:
        self.link = link

    def doorbell(self) -> links.Link:
        return self.link


def test_a_doorbell_to_a_dead_peer_raises_peer_lost() -> None:
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    theirs.close()  # the peer's process is gone
    link = links.Link(mine, links.RailSpec("shm", 0), peer=3)
    cts = ClearToSend(0, MPI.COMM_SELF, {3: Channel(link)}, lambda *_: None)
    try:
        with pytest.raises(PeerLost) as caught:
            cts.send(3, CTS_P2P, 7, 1, 42, 1024)
    finally:
        mine.close()
    assert isinstance(caught.value, HetcommError)
    assert caught.value.ranks == (3,)
    assert "rank 3" in str(caught.value) and isinstance(caught.value.__cause__, links.RailError)
    assert not link.alive
