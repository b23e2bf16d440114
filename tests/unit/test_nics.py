"""Unit tests for hetcomm.nics: interface discovery, rail specifications, subnet warnings."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest

from hetcomm.nics import (
    Nic,
    RailSpecError,
    addresses_of,
    describe,
    list_nics,
    parse_rails,
    shared_subnet_warnings,
)

ADDRS: dict[str, list[tuple[str, int]]] = {
    "eth0": [("10.0.0.5", 24)],
    "eth1": [("10.0.1.5", 24), ("10.0.9.9", 16)],
    "ib0": [("10.1.0.5", 16)],
    "virt0": [("172.17.0.1", 16)],
    "veth0": [("172.18.0.1", 16)],
    "down0": [("10.2.0.5", 24)],
    "lo": [("127.0.0.1", 8)],
    "lo2": [("127.0.0.2", 8)],
    "noip0": [],
}


def _iface(
    root: Path, name: str, operstate: str, flags: int, type_: int = 1, speed: str | None = None
) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "operstate").write_text(operstate + "\n")
    (d / "flags").write_text(f"{flags:#x}\n")
    (d / "type").write_text(f"{type_}\n")
    if speed is not None:
        (d / "speed").write_text(speed + "\n")
    return d


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    net = tmp_path / "class" / "net"
    net.mkdir(parents=True)
    _iface(net, "ib0", "up", 0x1003, type_=32, speed="100000")
    _iface(net, "eth1", "up", 0x1003, speed="-1")
    _iface(net, "eth0", "up", 0x1003, speed="25000")
    _iface(net, "virt0", "unknown", 0x1091)  # no speed file at all
    _iface(net, "down0", "down", 0x1002, speed="10000")
    _iface(net, "dormant0", "unknown", 0x1002)  # unknown but IFF_UP clear
    _iface(net, "lo", "unknown", 0x9, type_=772)
    _iface(net, "lo2", "unknown", 0x1, type_=772)  # loopback by type only
    _iface(net, "noip0", "up", 0x1003, speed="1000")
    real = _iface(tmp_path / "devices" / "virtual" / "net", "veth0", "up", 0x1003, speed="10000")
    (net / "veth0").symlink_to(real)
    (net / "bonding_masters").write_text("bond0\n")  # a plain file, not an interface
    return net


def fake_addresses(name: str) -> list[tuple[str, int]]:
    return ADDRS[name]


def test_list_nics_filters_sorts_and_reads_values(sysfs: Path) -> None:
    nics = list_nics(sysfs, addresses=fake_addresses)
    assert nics == [
        Nic("eth0", "10.0.0.5", 24, 25000),
        Nic("eth1", "10.0.1.5", 24, None),  # speed -1; only the first address is used
        Nic("ib0", "10.1.0.5", 16, 100000),
        Nic("veth0", "172.18.0.1", 16, None),  # virtual device: its speed is made up
        Nic("virt0", "172.17.0.1", 16, None),  # operstate unknown + IFF_UP; no speed file
    ]
    assert nics[0].subnet == "10.0.0.0/24"
    assert nics[2].subnet == "10.1.0.0/16"


def test_list_nics_include_loopback(sysfs: Path) -> None:
    names = [n.name for n in list_nics(str(sysfs), include_loopback=True, addresses=fake_addresses)]
    assert names == ["eth0", "eth1", "ib0", "lo", "lo2", "veth0", "virt0"]


def test_list_nics_unreadable_speed_and_missing_sysfs(tmp_path: Path) -> None:
    _iface(tmp_path, "eth0", "up", 0x1003, speed="not a number")
    assert list_nics(tmp_path, addresses=fake_addresses)[0].speed_mbps is None
    assert list_nics(tmp_path / "absent", addresses=fake_addresses) == []


def test_nic_validates() -> None:
    with pytest.raises(ValueError):
        Nic("eth0", "10.0.0.300", 24, None)
    with pytest.raises(ValueError):
        Nic("eth0", "10.0.0.3", 33, None)


def test_real_machine() -> None:
    nics = list_nics()
    assert isinstance(nics, list)
    for nic in nics:
        assert isinstance(nic, Nic)
        assert not ipaddress.IPv4Address(nic.ipv4).is_loopback
        assert nic.name != "lo"
        assert 0 <= nic.prefixlen <= 32
    assert addresses_of("nosuchnic0") == []
    lo = Path("/sys/class/net/lo")
    if not lo.exists() or not int((lo / "flags").read_text(), 16) & 0x1:
        pytest.skip("this machine has no 'lo' that is up")
    assert addresses_of("lo") == [("127.0.0.1", 8)]
    with_lo = list_nics(include_loopback=True)
    assert Nic("lo", "127.0.0.1", 8, None) in with_lo
    assert [n.name for n in with_lo] == sorted(n.name for n in with_lo)


ETH0 = Nic("eth0", "10.0.0.5", 24, 25000)
ETH1 = Nic("eth1", "10.0.1.5", 24, None)
IB0 = Nic("ib0", "10.1.0.5", 16, 100000)
HOST = [ETH0, ETH1, IB0]
HAS = "eth0 (10.0.0.5/24), eth1 (10.0.1.5/24), ib0 (10.1.0.5/16)"


def test_parse_rails_auto() -> None:
    assert parse_rails("auto", HOST) == HOST
    assert parse_rails(" AUTO ", HOST) == HOST


def test_parse_rails_names_and_addresses() -> None:
    assert parse_rails("eth0,eth1", HOST) == [ETH0, ETH1]
    assert parse_rails(" ib0 , 10.0.0.5 ", HOST) == [IB0, ETH0]
    assert parse_rails("10.0.1.5", HOST) == [ETH1]


def test_parse_rails_loopback_emulation() -> None:
    assert parse_rails("127.0.1.1,127.0.2.1", HOST) == [
        Nic("lo", "127.0.1.1", 8, None),
        Nic("lo", "127.0.2.1", 8, None),
    ]
    lo = Nic("lo", "127.0.0.1", 8, None)
    assert parse_rails("127.0.0.1", [lo], loopback_ok=False) == [lo]  # a listed NIC


@pytest.mark.parametrize(
    ("spec", "nics", "message"),
    [
        (
            "",
            HOST,
            f"HETCOMM_RAILS is empty; give 'auto' or a comma-separated list of interface "
            f"names or IPv4 addresses (this host has {HAS})",
        ),
        ("  ", HOST, "HETCOMM_RAILS is empty"),
        (
            "eth0,,eth1",
            HOST,
            f"HETCOMM_RAILS 'eth0,,eth1' has an empty entry (this host has {HAS})",
        ),
        ("eth0,", HOST, "HETCOMM_RAILS 'eth0,' has an empty entry"),
        ("eth7", HOST, f"HETCOMM_RAILS names 'eth7', but this host has {HAS}"),
        (
            "eth0",
            [],
            "HETCOMM_RAILS names 'eth0', but this host has no usable network interface "
            "(up, non-loopback, with an IPv4 address)",
        ),
        (
            "10.9.9.9",
            HOST,
            f"HETCOMM_RAILS names address '10.9.9.9', which no interface on this "
            f"host has; this host has {HAS}",
        ),
        (
            "eth0,eth0",
            HOST,
            "HETCOMM_RAILS 'eth0,eth0' selects eth0 (10.0.0.5) twice (as 'eth0' and 'eth0')",
        ),
        (
            "eth0,10.0.0.5",
            HOST,
            "HETCOMM_RAILS 'eth0,10.0.0.5' selects eth0 (10.0.0.5) twice "
            "(as 'eth0' and '10.0.0.5')",
        ),
        ("127.0.1.1,127.0.1.1", HOST, "selects lo (127.0.1.1) twice"),
        (
            "auto,eth0",
            HOST,
            "HETCOMM_RAILS 'auto,eth0' combines 'auto' with other entries; "
            "give either 'auto' or a list of interfaces",
        ),
        ("eth0,auto", HOST, "combines 'auto' with other entries"),
        (
            "auto",
            [],
            "HETCOMM_RAILS is 'auto', but this host has no usable network interface "
            "(up, non-loopback, with an IPv4 address)",
        ),
    ],
)
def test_parse_rails_errors(spec: str, nics: list[Nic], message: str) -> None:
    with pytest.raises(RailSpecError) as info:
        parse_rails(spec, nics)
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


def test_parse_rails_loopback_not_ok() -> None:
    with pytest.raises(RailSpecError) as info:
        parse_rails("127.0.1.1", HOST, loopback_ok=False)
    assert str(info.value) == (
        "HETCOMM_RAILS names address '127.0.1.1', which no interface on this host has "
        f"(loopback addresses are not allowed here); this host has {HAS}"
    )


def test_shared_subnet_warnings() -> None:
    assert shared_subnet_warnings([]) == []
    assert shared_subnet_warnings(HOST) == []
    a = Nic("eth0", "10.0.0.5", 24, None)
    b = Nic("eth1", "10.0.0.6", 24, None)
    c = Nic("eth2", "10.0.0.7", 24, None)
    d = Nic("eth3", "10.1.0.7", 16, None)
    e = Nic("eth4", "10.1.2.8", 16, None)
    assert shared_subnet_warnings([a, b, IB0]) == [
        "rails eth0 (10.0.0.5) and eth1 (10.0.0.6) share subnet 10.0.0.0/24: Linux routes both "
        "through one interface, so they will not add bandwidth"
    ]
    assert shared_subnet_warnings([a, d, b, c, e]) == [
        "rails eth0 (10.0.0.5), eth1 (10.0.0.6) and eth2 (10.0.0.7) share subnet 10.0.0.0/24: "
        "Linux routes all of them through one interface, so they will not add bandwidth",
        "rails eth3 (10.1.0.7) and eth4 (10.1.2.8) share subnet 10.1.0.0/16: Linux routes both "
        "through one interface, so they will not add bandwidth",
    ]
    loopbacks = parse_rails("127.0.1.1,127.0.2.1,127.0.3.1", HOST)
    assert shared_subnet_warnings([*loopbacks, a]) == []


def test_describe() -> None:
    assert describe([ETH0]) == "eth0  10.0.0.5/24  25000 Mb/s"
    assert describe([ETH0, ETH1, Nic("lo", "127.0.0.1", 8, None)]).splitlines() == [
        "eth0  10.0.0.5/24  25000 Mb/s",
        "eth1  10.0.1.5/24  speed ?",
        "lo    127.0.0.1/8  speed ?",
    ]
    assert describe([]) == ""
