"""The transport contract's pieces that need no MPI: capabilities and the peer-mapping facts."""

from __future__ import annotations

from hetcomm.topology import NOT_PROBED, RankInfo, Topology
from hetcomm.transports.base import NodeReduce


def _rank(i: int) -> RankInfo:
    return RankInfo(
        rank=i,
        world_rank=10 + i,
        host="h",
        vendor="nvidia",
        detected_vendor="nvidia",
        device_index=i,
        device_uuid=None,
        local_rank=i,
        local_size=3,
        node=0,
        nics=(),
        gpu_aware=False,
        mpi_gpu="no",
    )


def test_mpi_transport_has_the_node_reduce_capability() -> None:
    from hetcomm.transports.mpi.transport import MpiTransport
    from hetcomm.transports.staged.transport import StagedTransport

    assert issubclass(MpiTransport, NodeReduce)
    assert not issubclass(StagedTransport, NodeReduce)


def test_peer_mapping_starts_unprobed_and_names_the_first_rank_that_cannot() -> None:
    topo = Topology([_rank(i) for i in range(3)])
    assert topo.peer_mapping_unavailable() == f"rank 10: {NOT_PROBED}"
    assert topo.with_peer_mapping(None) is topo
    ok = topo.with_peer_mapping([None, None, None])
    assert ok.peer_mapping_unavailable() is None
    bad = topo.with_peer_mapping([None, "IPC is disabled", None])
    assert bad.peer_mapping_unavailable() == "rank 11: IPC is disabled"
    # a sub-communicator keeps its members' verdicts
    assert bad.subset([0, 2]).peer_mapping_unavailable() is None
    assert bad.subset([1]).peer_mapping_unavailable() == "rank 11: IPC is disabled"
    assert bad.fingerprint() == topo.fingerprint()
