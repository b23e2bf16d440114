"""Every tag a transport sends with on a communicator's service communicator, in one table.

The service communicator (`Communicator.service`, a Dup of the group's own) carries hetcomm's
control messages, so that they never meet the caller's send/recv. Several transports of one
group share it, so their tags must not overlap: `service_ranges` lists each use as a range and
tests/unit/test_tags.py checks that no two ranges meet, for the smallest tag bound MPI allows.
"""

from __future__ import annotations

# ---- fixed tags -------------------------------------------------------------------------------
#: staged: a receive's clear-to-send sent over MPI (between hosts; shm peers use the rail)
STAGED_CTS = 11
#: staged: the rail cards (addresses, token, slot segments) two ranks swap when they connect
STAGED_HELLO = 12
#: staged, the mpi rail: a chunk's header, then its body
STAGED_HEAD, STAGED_BODY = 13, 14
#: hostcoll: the name of a group's shared segment, from rank 0 to the others
HOSTCOLL = 15
#: nccl: the unique id rank 0 of a pair or group hands to the others
NCCL_UID = 21
#: direct: a message the proxy sends itself to leave MPI_Waitany
DIRECT_WAKE = 63

# ---- ranges -----------------------------------------------------------------------------------
#: direct send/recv: 4 tags per user tag from here up (record and "done", for either copier)
DIRECT_P2P = 64
DIRECT_P2P_PER_TAG = 4
#: direct collectives: the top 2 * LEAD_TAGS tags below the MPI tag bound carry records sent to
#: the one-GPU leader and its "done" replies, by collective number modulo LEAD_TAGS
#: (same-tag messages between two ranks stay in order)
LEAD_TAGS = 1024

#: The smallest MPI_TAG_UB the MPI standard allows.
MIN_TAG_UB = 32767

# ---- hier's own communicators (not the service communicator) ---------------------------------
# hier's island/cross/flat parts are Communicators of their own: its tags go to their send and
# recv, in the user's tag space of those parts. Every message of one operation between two ranks
# is the only one between them in that operation, and operations run one after another: one tag
# serves them all; pieces of one operation between two ranks take tags of their own (from the
# element offset both ends know), so no transport has to keep same-tag messages in order.
HIER = 1
HIER_SPAN = 1 << 20


def lead_base(tag_ub: int) -> int:
    """The first tag of direct's collective records, for a service communicator's bound."""
    return tag_ub - 2 * LEAD_TAGS + 1


def direct_p2p_max_user_tag(tag_ub: int) -> int:
    """The largest user tag direct's send/recv can carry under `tag_ub`."""
    return (lead_base(tag_ub) - 1 - DIRECT_P2P - (DIRECT_P2P_PER_TAG - 1)) // DIRECT_P2P_PER_TAG


def service_ranges(tag_ub: int = MIN_TAG_UB) -> dict[str, range]:
    """Each use of the service communicator's tags -> the tags it may send with."""
    fixed = {
        "staged clear-to-send": STAGED_CTS,
        "staged hello": STAGED_HELLO,
        "staged mpi-rail header": STAGED_HEAD,
        "staged mpi-rail body": STAGED_BODY,
        "hostcoll segment name": HOSTCOLL,
        "nccl unique id": NCCL_UID,
        "direct proxy wake": DIRECT_WAKE,
    }
    ranges = {name: range(tag, tag + 1) for name, tag in fixed.items()}
    top_user = direct_p2p_max_user_tag(tag_ub)
    ranges["direct send/recv"] = range(DIRECT_P2P, DIRECT_P2P + DIRECT_P2P_PER_TAG * (top_user + 1))
    ranges["direct collectives"] = range(lead_base(tag_ub), tag_ub + 1)
    return ranges
