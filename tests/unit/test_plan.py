"""Unit tests for hetcomm.plan: transport choice from the members' facts (pure, no MPI)."""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np
import pytest

from hetcomm.errors import HetcommError, TransportUnavailable
from hetcomm.plan import (
    COLLECTIVES,
    DIRECT_MIN_BYTES,
    OPS,
    SIZE_CLASSES,
    SMALL_BYTES,
    Choice,
    Member,
    PlanTable,
    choose,
    islands,
    plan_table,
    size_class,
)

TRANSPORTS = ("mpi", "nccl", "direct", "staged", "hier")
# Parameter ids are written "t=mpi", never a bare "mpi": pytest-mpi skips (without --with-mpi)
# every test whose keywords include "mpi", and a parameter id becomes a keyword.
POINT_TO_POINT = ("send", "recv")
LARGE = SMALL_BYTES * 16


def available(*names: str, **reasons: str) -> dict[str, str | None]:
    """Every transport: None for `names`, the given reason for `reasons`, else 'not installed'."""
    out: dict[str, str | None] = {}
    for t in TRANSPORTS:
        out[t] = None if t in names else reasons.get(t, f"{t} is not installed")
    return out


EVERYTHING = available(*TRANSPORTS)
NOTHING = available()


def same_vendor(
    vendor: str, n: int = 4, hosts: Sequence[str] = ("a",), aware: bool = False
) -> list[Member]:
    return [Member(i, hosts[i % len(hosts)], vendor, f"{vendor}-uuid-{i}", aware) for i in range(n)]


def mixed(hosts: Sequence[str] = ("a", "b"), aware: bool = False) -> list[Member]:
    """2 nvidia on hosts[0], 2 amd on hosts[-1]."""
    return [
        Member(0, hosts[0], "nvidia", "gpu-0", aware),
        Member(1, hosts[0], "nvidia", "gpu-1", aware),
        Member(2, hosts[-1], "amd", "gpu-2", aware),
        Member(3, hosts[-1], "amd", "gpu-3", aware),
    ]


def cpu_only(n: int = 3, hosts: Sequence[str] = ("a",)) -> list[Member]:
    return [Member(i, hosts[i % len(hosts)], "cpu", None, False) for i in range(n)]


def pick(
    members: Sequence[Member],
    op: str = "all_reduce",
    memory: str = "device",
    nbytes: int = LARGE,
    requested: str = "auto",
    unavailable: dict[str, str | None] | None = None,
    direct_min: int = SMALL_BYTES,
) -> Choice:
    """choose() with the crossover at the size-class boundary (direct for large messages only)
    unless `direct_min` says otherwise; the default crossover has tests of its own below."""
    return choose(
        members,
        op=op,
        memory=memory,
        nbytes=nbytes,
        requested=requested,
        unavailable=EVERYTHING if unavailable is None else unavailable,
        group="g",
        direct_min=direct_min,
    )


# ---- size classes and islands -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("nbytes", "cls"),
    [
        (0, "small"),
        (1, "small"),
        (SMALL_BYTES - 1, "small"),
        (SMALL_BYTES, "small"),
        (SMALL_BYTES + 1, "large"),
        (2**40, "large"),
    ],
)
def test_size_class_boundaries(nbytes: int, cls: str) -> None:
    assert size_class(nbytes) == cls
    assert cls in SIZE_CLASSES


def test_size_class_random() -> None:
    rng = np.random.default_rng()
    for n in rng.integers(0, 4 * SMALL_BYTES, size=200):
        assert size_class(int(n)) == ("small" if n <= SMALL_BYTES else "large")


def test_small_bytes_is_64_kib() -> None:
    assert SMALL_BYTES == 65536


def test_ops_tables() -> None:
    assert set(COLLECTIVES) < set(OPS)
    assert set(OPS) - set(COLLECTIVES) == {"send", "recv", "barrier"}


def test_islands_group_by_host_and_vendor_in_order_of_appearance() -> None:
    members = [
        Member(0, "b", "amd", "d0", False),
        Member(1, "a", "nvidia", "d1", False),
        Member(2, "b", "amd", "d2", False),
        Member(3, "a", "amd", "d3", False),
        Member(4, "a", "nvidia", "d4", False),
        Member(5, "b", "nvidia", "d5", False),
    ]
    assert islands(members) == [(0, 2), (1, 4), (3,), (5,)]


def test_islands_simple_cases() -> None:
    assert islands([]) == []
    assert islands(mixed()) == [(0, 1), (2, 3)]
    assert islands(mixed(hosts=("a",))) == [(0, 1), (2, 3)]
    assert islands(same_vendor("nvidia", 4, hosts=("a", "b"))) == [(0, 2), (1, 3)]
    assert islands(same_vendor("amd", 3)) == [(0, 1, 2)]
    assert islands(cpu_only(2)) == [(0, 1)]


def test_islands_use_member_rank_not_position() -> None:
    members = [Member(7, "a", "nvidia", "x", False), Member(3, "a", "nvidia", "y", False)]
    assert islands(members) == [(7, 3)]


# ---- argument checks ----------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["allreduce", "All_Reduce", "scatter", "", "gather"])
def test_unknown_op(op: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"unknown operation {op!r}")):
        pick(mixed(), op=op)


@pytest.mark.parametrize("memory", ["cuda", "gpu", "Host", "", "cpu"])
def test_unknown_memory(memory: str) -> None:
    with pytest.raises(
        ValueError, match=re.escape(f"memory must be 'host' or 'device', got {memory!r}")
    ):
        pick(mixed(), memory=memory)


def test_value_errors_are_not_transport_unavailable() -> None:
    with pytest.raises(ValueError) as info:
        pick(mixed(), op="nope", unavailable=NOTHING)
    assert not isinstance(info.value, HetcommError)


# ---- host buffers -------------------------------------------------------------------------------


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("nbytes", [0, SMALL_BYTES, LARGE])
def test_host_buffers_go_through_mpi(op: str, nbytes: int) -> None:
    for members in (mixed(), same_vendor("nvidia"), cpu_only(), mixed(aware=True)):
        c = pick(members, op=op, memory="host", nbytes=nbytes)
        assert c == Choice("mpi", "host buffers: MPI moves them directly")


def test_host_buffers_choose_mpi_even_when_it_is_listed_unavailable() -> None:
    # host memory is always MPI's job: the automatic plan does not consult `unavailable`
    assert pick(mixed(), memory="host", unavailable=NOTHING).transport == "mpi"


# ---- forced transports --------------------------------------------------------------------------


@pytest.mark.parametrize("name", TRANSPORTS, ids=[f"t={t}" for t in TRANSPORTS])
def test_forced_transport_device(name: str) -> None:
    c = pick(same_vendor("nvidia", aware=True), requested=name)
    assert c == Choice(name, "forced by HETCOMM_TRANSPORT")


@pytest.mark.parametrize("name", ["mpi", "staged", "direct", "hier"], ids=lambda t: f"t={t}")
def test_forced_transport_host(name: str) -> None:
    c = pick(mixed(), memory="host", requested=name)
    assert c == Choice(name, "forced by HETCOMM_TRANSPORT")


def test_forced_transport_overrides_the_automatic_choice() -> None:
    members = same_vendor("nvidia")
    assert pick(members).transport == "nccl"
    assert pick(members, requested="staged").transport == "staged"
    assert pick(members, memory="host", requested="staged").transport == "staged"


def test_forced_transport_not_installed() -> None:
    un = available("mpi", "staged", nccl="libnccl.so.2 not found")
    with pytest.raises(TransportUnavailable) as info:
        pick(same_vendor("nvidia"), requested="nccl", unavailable=un, op="broadcast")
    assert str(info.value) == (
        "group 'g': HETCOMM_TRANSPORT asks for 'nccl' for broadcast on device buffers, "
        "but libnccl.so.2 not found"
    )


def test_forced_transport_not_in_this_installation() -> None:
    un = {"mpi": None, "staged": None}
    with pytest.raises(TransportUnavailable) as info:
        pick(mixed(), requested="hier", unavailable=un)
    msg = str(info.value)
    assert "asks for 'hier' for all_reduce on device buffers" in msg
    assert msg.endswith("but 'hier' is not a transport of this installation (mpi, staged)")


def test_forced_mpi_on_device_without_gpu_aware_members() -> None:
    members = [
        Member(0, "a", "nvidia", "d0", True),
        Member(1, "a", "nvidia", "d1", False),
        Member(2, "b", "amd", "d2", True),
        Member(3, "b", "amd", "d3", False),
    ]
    with pytest.raises(TransportUnavailable) as info:
        pick(members, requested="mpi", op="send")
    assert str(info.value) == (
        "group 'g': HETCOMM_TRANSPORT asks for 'mpi' for send on device buffers, but the MPI "
        "library is not GPU-aware on ranks [1, 3]: a device pointer would crash it"
    )


def test_forced_mpi_on_device_with_every_member_gpu_aware() -> None:
    assert pick(mixed(aware=True), requested="mpi").transport == "mpi"


def test_forced_mpi_on_host_without_gpu_aware_members() -> None:
    assert pick(mixed(), memory="host", requested="mpi").transport == "mpi"


def test_forced_nccl_for_host_memory() -> None:
    with pytest.raises(TransportUnavailable) as info:
        pick(same_vendor("nvidia"), memory="host", requested="nccl", op="all_gather")
    assert str(info.value) == (
        "group 'g': HETCOMM_TRANSPORT asks for 'nccl' for all_gather on host buffers, "
        "but NCCL moves device buffers only"
    )


def test_forced_reason_comes_before_the_memory_check() -> None:
    un = available("mpi", nccl="not built in this version")
    with pytest.raises(TransportUnavailable, match=r"but not built in this version$"):
        pick(same_vendor("nvidia"), memory="host", requested="nccl", unavailable=un)


def test_forced_error_names_the_group() -> None:
    with pytest.raises(TransportUnavailable, match=r"^group 'pipeline-3': "):
        choose(
            mixed(),
            op="recv",
            memory="device",
            nbytes=8,
            requested="mpi",
            unavailable=EVERYTHING,
            group="pipeline-3",
        )


# ---- device buffers, automatic choice -----------------------------------------------------------


@pytest.mark.parametrize(("vendor", "lib"), [("nvidia", "NCCL"), ("amd", "RCCL")])
@pytest.mark.parametrize("op", OPS)
def test_single_vendor_distinct_devices_nccl(vendor: str, lib: str, op: str) -> None:
    for hosts in (("a",), ("a", "b")):
        for nbytes in (1, LARGE):
            c = pick(same_vendor(vendor, hosts=hosts), op=op, nbytes=nbytes)
            assert c == Choice("nccl", f"every member is {vendor} with its own device: {lib}")


def test_single_member_is_nccl() -> None:
    assert pick(same_vendor("amd", n=1)).transport == "nccl"


def test_shared_device_is_not_nccl() -> None:
    members = [
        Member(0, "a", "nvidia", "gpu-0", True),
        Member(1, "a", "nvidia", "gpu-0", True),  # the same GPU as rank 0
        Member(2, "a", "nvidia", "gpu-1", True),
    ]
    c = pick(members, nbytes=1)
    assert c.transport != "nccl"
    assert c == Choice("mpi", "the MPI library is GPU-aware on every member")


def test_shared_device_rejection_is_reported() -> None:
    members = [Member(0, "a", "amd", "g", False), Member(1, "a", "amd", "g", False)]
    with pytest.raises(TransportUnavailable) as info:
        pick(members, unavailable=available("nccl"))
    assert "nccl: two ranks share a device (NCCL refuses a duplicate GPU)" in str(info.value)


def test_nccl_unavailable_falls_through() -> None:
    un = available("mpi", "staged", nccl="RCCL library missing")
    assert pick(same_vendor("amd", aware=True), unavailable=un).transport == "mpi"
    assert pick(same_vendor("amd", aware=False), unavailable=un).transport == "staged"
    with pytest.raises(TransportUnavailable, match="nccl: RCCL library missing"):
        pick(same_vendor("amd"), unavailable=available(nccl="RCCL library missing"))


@pytest.mark.parametrize("op", COLLECTIVES)
@pytest.mark.parametrize("hosts", [("a", "b"), ("a",)])
def test_mixed_vendors_collective_is_hier(op: str, hosts: tuple[str, ...]) -> None:
    """Across hosts, or on one host whose GPUs cannot map each other (two real vendors)."""
    no_peer = available(
        "mpi", "nccl", "staged", "hier", direct="GPUs of vendors amd, nvidia: no IPC between them"
    )
    for nbytes in (1, LARGE):
        c = pick(mixed(hosts=hosts), op=op, nbytes=nbytes, unavailable=no_peer)
        assert c == Choice("hier", "2 vendor islands: native inside, staged/direct between")


@pytest.mark.parametrize("op", COLLECTIVES)
def test_islands_of_one_host_that_map_each_other_go_direct(op: str) -> None:
    """Simulated vendors on one GPU: one hop over mapped memory beats the hierarchy."""
    for nbytes, direct_min in ((1, 0), (LARGE, 0), (LARGE, SMALL_BYTES)):
        c = pick(mixed(hosts=("a",)), op=op, nbytes=nbytes, direct_min=direct_min)
        assert c.transport == "direct"
    # small messages kept off direct by the crossover fall back to the hierarchy
    assert pick(mixed(hosts=("a",)), op=op, nbytes=1).transport == "hier"


def test_hier_reason_counts_islands() -> None:
    members = [*mixed(), Member(4, "c", "nvidia", "gpu-4", False)]
    assert pick(members).reason.startswith("3 vendor islands")


@pytest.mark.parametrize("op", POINT_TO_POINT)
def test_mixed_vendors_point_to_point_is_not_hier(op: str) -> None:
    c = pick(mixed(), op=op)
    assert c.transport != "hier"
    assert c.transport == "staged"  # two hosts, no GPU-aware MPI


def test_mixed_vendors_without_hier() -> None:
    un = available("mpi", "staged", "nccl", "direct")
    assert pick(mixed(), unavailable=un).transport == "staged"
    assert pick(mixed(aware=True), unavailable=un).transport == "mpi"


def test_one_host_direct_for_large_only() -> None:
    members = mixed(hosts=("a",))
    un = available("direct", "mpi", "staged", "nccl")  # no hier: reach the direct rule
    assert pick(members, op="all_reduce", nbytes=LARGE, unavailable=un) == Choice(
        "direct", "one host, peer memory mapped: GPU-to-GPU copies"
    )
    assert pick(members, nbytes=SMALL_BYTES + 1, unavailable=un).transport == "direct"
    assert pick(members, nbytes=SMALL_BYTES, unavailable=un).transport == "staged"
    assert pick(members, nbytes=1, unavailable=un).transport == "staged"


@pytest.mark.parametrize("op", POINT_TO_POINT)
def test_one_host_point_to_point_direct_for_large(op: str) -> None:
    members = mixed(hosts=("a",), aware=True)
    assert pick(members, op=op, nbytes=LARGE).transport == "direct"
    assert pick(members, op=op, nbytes=16).transport == "mpi"


def test_two_hosts_never_direct() -> None:
    c = pick(mixed(hosts=("a", "b")), op="send", nbytes=LARGE)
    assert c.transport != "direct"


def test_direct_unavailable_on_one_host() -> None:
    un = available("mpi", "staged", "nccl", "hier")
    assert pick(mixed(hosts=("a",)), op="send", nbytes=LARGE, unavailable=un).transport == "staged"


def test_all_gpu_aware_is_mpi() -> None:
    c = pick(mixed(aware=True), op="send")
    assert c == Choice("mpi", "the MPI library is GPU-aware on every member")


def test_one_member_not_gpu_aware_is_not_mpi() -> None:
    members = [*mixed(aware=True)[:3], Member(3, "b", "amd", "gpu-3", False)]
    assert pick(members, op="recv").transport == "staged"


def test_staged_fallback() -> None:
    c = pick(mixed(), op="send", unavailable=available("staged", "mpi"))
    assert c == Choice(
        "staged",
        "no native library or GPU-aware MPI serves these members: "
        "staged copies through pinned host memory",
    )


def test_nothing_available_lists_each_rejected_transport() -> None:
    un = available(
        nccl="NCCL: no such library",
        mpi="libmpi missing",
        staged="staging disabled",
        hier="hier not built",
        direct="no peer access",
    )
    with pytest.raises(TransportUnavailable) as info:
        pick(mixed(), op="send", unavailable=un)
    msg = str(info.value)
    assert msg == (
        "group 'g': no transport can move device buffers for send: "
        "nccl: members span vendors amd, nvidia; mpi: not GPU-aware on ranks [0, 1, 2, 3]; "
        "staged: staging disabled"
    )
    assert info.value.why == (  # type: ignore[attr-defined]
        "no transport: nccl: members span vendors amd, nvidia; "
        "mpi: not GPU-aware on ranks [0, 1, 2, 3]; staged: staging disabled"
    )


def test_nothing_available_single_vendor() -> None:
    with pytest.raises(TransportUnavailable) as info:
        pick(same_vendor("nvidia", hosts=("a", "b")), unavailable=available(nccl="no NCCL"))
    msg = str(info.value)
    for part in (
        "nccl: no NCCL",
        "mpi: not GPU-aware on ranks [0, 1, 2, 3]",
        "staged: staged is not installed",
    ):
        assert part in msg


def test_unavailable_without_entry_defaults_to_not_installed() -> None:
    with pytest.raises(TransportUnavailable) as info:
        pick(same_vendor("nvidia"), unavailable={})
    assert "nccl: not installed" in str(info.value)
    assert "staged: not installed" in str(info.value)


def test_nothing_available_reports_why_mpi_is_unavailable() -> None:
    un = available(mpi="MPI has no device support compiled in", staged="staging disabled")
    with pytest.raises(TransportUnavailable) as info:
        pick(mixed(aware=True), op="send", unavailable=un)
    msg = str(info.value)
    assert "not GPU-aware on ranks []" not in msg
    assert "mpi: MPI has no device support compiled in" in msg


def test_nothing_available_names_hier_and_direct() -> None:
    un = available(hier="hier not built", direct="no peer access")
    with pytest.raises(TransportUnavailable) as info:
        pick(mixed(hosts=("a",)), op="all_reduce", nbytes=LARGE, unavailable=un)
    msg = str(info.value)
    assert "hier: hier not built" in msg
    assert "direct: no peer access" in msg


def test_cpu_only_members() -> None:
    members = cpu_only(3)
    assert pick(members, memory="host").transport == "mpi"
    # CPU ranks handing "device" memory: never NCCL, the fall-backs decide
    assert pick(members, op="send", nbytes=1, unavailable=available("staged")).transport == "staged"
    with pytest.raises(TransportUnavailable, match="nccl: CPU-only members"):
        pick(members, unavailable=available())


def test_cpu_member_among_gpus_spans_vendors() -> None:
    members = [*same_vendor("nvidia", n=2), Member(2, "a", "cpu", None, False)]
    with pytest.raises(TransportUnavailable, match="nccl: members span vendors cpu, nvidia"):
        pick(members, op="send", unavailable=available())


def test_random_member_sets_always_decide() -> None:
    """Whatever the members, auto either chooses an available transport or says why not."""
    rng = np.random.default_rng()
    vendors = ("nvidia", "amd", "cpu")
    for _ in range(200):
        n = int(rng.integers(1, 7))
        members = [
            Member(
                i,
                f"h{rng.integers(0, 3)}",
                vendors[rng.integers(0, 3)],
                f"d{rng.integers(0, 8)}",
                bool(rng.integers(0, 2)),
            )
            for i in range(n)
        ]
        un = {t: (None if rng.integers(0, 2) else f"{t} off") for t in TRANSPORTS}
        op = OPS[rng.integers(0, len(OPS))]
        nbytes = int(rng.integers(0, 4 * SMALL_BYTES))
        try:
            c = pick(members, op=op, nbytes=nbytes, unavailable=un)
        except TransportUnavailable as exc:
            assert str(exc).startswith(f"group 'g': no transport can move device buffers for {op}")
            assert un["staged"] is not None  # staged, when there, always catches the rest
            continue
        assert un[c.transport] is None
        if c.transport == "hier":
            assert op in COLLECTIVES and len(islands(members)) > 1
        if c.transport == "direct":
            assert nbytes > SMALL_BYTES and len({m.host for m in members}) == 1
        if c.transport == "mpi":
            assert all(m.gpu_aware for m in members)
        if c.transport == "nccl":
            assert len({m.vendor for m in members}) == 1 and members[0].vendor != "cpu"
            assert len({m.device for m in members}) == n


# ---- plan tables --------------------------------------------------------------------------------


def expected_keys(memories: Sequence[str] = ("host", "device")) -> list[tuple[str, str, str]]:
    return [
        (op, memory, cls)
        for memory in memories
        for op in OPS
        if not (op == "barrier" and memory == "device")
        for cls in ("small", "large")
    ]


def test_plan_table_rows_cover_every_case() -> None:
    table = plan_table(mixed(hosts=("a",)), requested="auto", unavailable=EVERYTHING, group="g")
    assert isinstance(table, PlanTable)
    assert table.group == "g"
    assert [row[:3] for row in table.rows] == expected_keys()
    assert len(table.rows) == 2 * len(OPS) + 2 * (len(OPS) - 1)


def test_plan_table_rows_match_choose() -> None:
    members = mixed(hosts=("a",))
    table = plan_table(
        members, requested="auto", unavailable=EVERYTHING, group="g", direct_min=SMALL_BYTES
    )
    for op, memory, cls, transport, reason in table.rows:
        nbytes = SMALL_BYTES if cls == "small" else SMALL_BYTES * 1024
        assert pick(members, op=op, memory=memory, nbytes=nbytes) == Choice(transport, reason)
    assert table.lookup("all_reduce", "device", "small") == (
        "hier",
        "2 vendor islands: native inside, staged/direct between",
    )
    assert table.lookup("send", "device", "large")[0] == "direct"
    assert table.lookup("send", "device", "small")[0] == "staged"
    assert table.lookup("barrier", "host", "small")[0] == "mpi"


def test_plan_table_memories_argument() -> None:
    table = plan_table(
        mixed(),
        requested="auto",
        unavailable=EVERYTHING,
        group="g",
        direct_min=SMALL_BYTES,
        memories=("device",),
    )
    assert [row[:3] for row in table.rows] == expected_keys(("device",))


def test_plan_table_lookup_missing() -> None:
    table = plan_table(mixed(), requested="auto", unavailable=EVERYTHING, group="g")
    with pytest.raises(KeyError):
        table.lookup("barrier", "device", "small")
    with pytest.raises(KeyError):
        table.lookup("all_reduce", "device", "medium")


def test_plan_table_failed_choices_show_as_none() -> None:
    table = plan_table(mixed(), requested="auto", unavailable=NOTHING, group="g")
    assert table.lookup("send", "host", "large")[0] == "mpi"
    transport, why = table.lookup("send", "device", "large")
    assert transport == "none"
    assert why.startswith("no transport: nccl: members span vendors amd, nvidia; mpi: ")


def test_plan_table_forced_failure_shows_the_reason_only() -> None:
    table = plan_table(same_vendor("nvidia"), requested="nccl", unavailable=EVERYTHING, group="g")
    assert table.lookup("all_reduce", "host", "small") == ("none", "NCCL moves device buffers only")
    assert table.lookup("all_reduce", "device", "large") == ("nccl", "forced by HETCOMM_TRANSPORT")


def test_plan_table_str_merges_lines() -> None:
    table = plan_table(
        mixed(hosts=("a",)),
        requested="auto",
        unavailable=EVERYTHING,
        group="g",
        direct_min=SMALL_BYTES,
    )
    assert str(table) == "\n".join(
        [
            "plan of group 'g':",
            "  host   every op -> mpi: host buffers: MPI moves them directly",
            "  device all_reduce, reduce, broadcast, all_gather, reduce_scatter, all_to_all "
            "(small) -> "
            "hier: 2 vendor islands: native inside, staged/direct between",
            "  device every op (large) -> direct: one host, peer memory mapped: GPU-to-GPU copies",
            "  device send, recv (small) -> staged: no native library or GPU-aware MPI serves "
            "these members: staged copies through pinned host memory",
        ]
    )


def test_plan_table_str_every_op_for_device() -> None:
    table = plan_table(same_vendor("amd"), requested="auto", unavailable=EVERYTHING, group="dp")
    assert str(table).splitlines() == [
        "plan of group 'dp':",
        "  host   every op -> mpi: host buffers: MPI moves them directly",
        "  device every op -> nccl: every member is amd with its own device: RCCL",
    ]


def test_plan_table_str_per_size_class() -> None:
    members = [Member(0, "a", "nvidia", "g", True), Member(1, "a", "nvidia", "g", True)]
    table = plan_table(
        members, requested="auto", unavailable=EVERYTHING, group="g", direct_min=SMALL_BYTES
    )
    lines = str(table).splitlines()
    assert "  device every op (small) -> mpi: the MPI library is GPU-aware on every member" in lines
    assert (
        "  device every op (large) -> direct: one host, peer memory mapped: GPU-to-GPU copies"
        in lines
    )
    assert len(lines) == 4


def test_plan_table_str_forced() -> None:
    table = plan_table(same_vendor("nvidia"), requested="nccl", unavailable=EVERYTHING, group="g")
    assert str(table).splitlines() == [
        "plan of group 'g':",
        "  host   all_reduce, reduce, broadcast, all_gather, reduce_scatter, all_to_all, send, "
        "recv -> none: NCCL moves device buffers only",
        "  host   barrier -> nccl: forced by HETCOMM_TRANSPORT",
        "  device every op -> nccl: forced by HETCOMM_TRANSPORT",
    ]


def test_plan_table_str_nothing() -> None:
    table = plan_table(mixed(), requested="auto", unavailable=NOTHING, group="g")
    lines = str(table).splitlines()
    # collectives also name hier, which applies to them only: two device lines
    assert len(lines) == 4
    assert all(
        line.startswith("  device ") and "none: no transport: nccl: members span vendors" in line
        for line in lines[2:]
    )
    assert "hier:" in lines[2] and "hier:" not in lines[3]


def test_plan_table_str_is_built_from_rows() -> None:
    table = PlanTable(
        "x",
        (
            ("send", "device", "small", "mpi", "r1"),
            ("send", "device", "large", "staged", "r2"),
            ("recv", "device", "small", "mpi", "r1"),
            ("barrier", "host", "small", "mpi", "r3"),
            ("barrier", "host", "large", "mpi", "r3"),
        ),
    )
    assert str(table).splitlines() == [
        "plan of group 'x':",
        "  device send, recv (small) -> mpi: r1",
        "  device send (large) -> staged: r2",
        "  host   barrier -> mpi: r3",
    ]


# ---- the measured crossover between direct and staged ----------------------------------------


def test_default_crossover_sends_small_messages_direct_too() -> None:
    members = [Member(r, "a", "nvidia", "gpu-0", False) for r in range(2)]  # a shared GPU
    assert DIRECT_MIN_BYTES == 0
    for nbytes in (8, SMALL_BYTES, LARGE):
        assert pick(members, nbytes=nbytes, direct_min=DIRECT_MIN_BYTES).transport == "direct"


def test_crossover_above_the_small_class_keeps_small_messages_staged() -> None:
    members = [Member(r, "a", "nvidia", "gpu-0", False) for r in range(2)]
    small = pick(members, nbytes=8, direct_min=SMALL_BYTES)
    assert small.transport == "staged"
    table = plan_table(
        members, requested="auto", unavailable=EVERYTHING, group="g", direct_min=SMALL_BYTES
    )
    assert table.lookup("send", "device", "small")[0] == "staged"
    assert table.lookup("send", "device", "large")[0] == "direct"
    huge = pick(members, nbytes=LARGE, direct_min=LARGE * 2)
    assert huge.transport == "staged"
