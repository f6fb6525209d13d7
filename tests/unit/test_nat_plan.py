"""The network lab's NAT without namespaces: which hosts go behind NAT and with what addresses
(tools/netlab/nat.py, Topology's segment), the router's rules, the emulator's routes to a router's
LAN, and the per-peer manifest counts of tools/netlab/report.py. tests/integration/test_netlab_nat.py
builds them for real."""

import heapq

import pytest

from tools.netlab.lab import main
from tools.netlab.linkem import VNET_HDR, LinkEmulator
from tools.netlab.nat import LAN, NAT_TABLE, UPLINK, nat_hosts, plan_nat
from tools.netlab.report import format_peers, peer_rows
from tools.netlab.topology import LinkSpec, Topology


def ipv4_packet(dest: str, payload_bytes: int) -> bytes:
    header = bytearray(20)
    header[0] = 0x45
    header[16:20] = bytes(int(x) for x in dest.split("."))
    return VNET_HDR.pack(0, 0, 0, 0, 0, 0) + bytes(header) + bytes(20 + payload_bytes)


def test_the_last_peers_go_behind_nat_each_with_a_router_and_a_lan_of_its_own():
    assert nat_hosts(8, 3) == [6, 7, 8]
    assert nat_hosts(3, 0) == [] and nat_hosts(2, 2) == [1, 2]
    with pytest.raises(ValueError, match="0 to 3"):
        nat_hosts(3, 4)
    routers = plan_nat("lsnl-7-", "10.213.8", [6, 7])
    assert sorted(routers) == [6, 7]
    r6 = routers[6]
    assert (r6.namespace, r6.uplink_ip) == ("lsnl-7-nat6", "10.213.8.7")  # h6's own segment address
    assert (r6.router_lan_ip, r6.host_lan_ip, r6.lan_subnet) == ("192.168.6.1", "192.168.6.2", "192.168.6.0/24")
    assert routers[7].lan_subnet != r6.lan_subnet
    with pytest.raises(ValueError):
        plan_nat("lsnl-7-", "10.213.8", [0])


def test_the_router_masquerades_out_of_its_uplink_and_forwards_in_only_replies():
    router = plan_nat("lsnl-7-", "10.213.8", [3])[3]
    rules = router.ruleset()
    assert f"table ip {NAT_TABLE}" in rules
    assert f'oifname "{UPLINK}" masquerade' in rules and "hook postrouting priority srcnat" in rules
    assert "hook forward priority filter; policy drop;" in rules
    assert "ct state established,related accept" in rules
    assert f'iifname "{LAN}" oifname "{UPLINK}" accept' in rules
    assert "dnat" not in rules and "redirect" not in rules  # no port forwarding
    commands = router.setup_commands("lsnl-7-h3")
    flat = [" ".join(command) for command, _ in commands]
    assert "ip -n lsnl-7-h3 route add default via 192.168.3.1" in flat
    assert "ip netns exec lsnl-7-nat3 sysctl -q -w net.ipv4.ip_forward=1" in flat
    assert commands[-1] == (["ip", "netns", "exec", "lsnl-7-nat3", "nft", "-f", "-"], rules)
    # Nothing is made outside the lab's two namespaces.
    assert all("lsnl-7-nat3" in line or "lsnl-7-h3" in line for line in flat)


def test_routers_take_their_hosts_places_on_the_segment_and_the_relay_is_one_more_member():
    topology = Topology(5, LinkSpec(rate_mbps=100), rates_mbps=[1000, 10, 100, 10, 100], nat_hosts=[3, 4], relay=True)
    prefix, subnet = topology.prefix, topology.subnet
    assert topology.hosts[3].ip == "192.168.3.2" and topology.hosts[2].ip == f"{subnet}.3"
    assert topology.nat[3].uplink_ip == f"{subnet}.4" and sorted(topology.nat) == [3, 4]
    segment = [(p.name, p.namespace, p.ip, p.rate_mbps) for p in topology.segment()]
    assert segment == [
        ("h0", f"{prefix}h0", f"{subnet}.1", 1000),
        ("h1", f"{prefix}h1", f"{subnet}.2", 10),
        ("h2", f"{prefix}h2", f"{subnet}.3", 100),
        ("nat3", f"{prefix}nat3", f"{subnet}.4", 10),
        ("nat4", f"{prefix}nat4", f"{subnet}.5", 100),
        ("relay", f"{prefix}relay", f"{subnet}.6", 1000),
    ]
    assert Topology(3, LinkSpec(rate_mbps=100)).relay is None
    with pytest.raises(ValueError, match="h0 stays public"):
        Topology(3, LinkSpec(rate_mbps=100), nat_hosts=[0])


def test_the_lab_refuses_more_nat_hosts_than_peers_before_building_anything(capsys):
    assert main(["--peers", "2", "--nat", "3"]) == 2
    assert "--nat takes 0 to --peers (2)" in capsys.readouterr().err


def test_the_emulator_carries_a_packet_for_a_routers_lan_to_the_router():
    em = LinkEmulator(
        [("ns-a", "10.9.0.1", 8.0), ("ns-r", "10.9.0.2", 8.0)],
        delay_ms=20.0,
        loss_pct=0.0,
        routes=[("192.168.2.0/24", "10.9.0.2")],
    )
    assert em.destination(bytes([10, 9, 0, 2])) == 1
    assert em.destination(bytes([192, 168, 2, 2])) == 1
    assert em.destination(bytes([192, 168, 3, 2])) is None  # another LAN: nobody's
    em.sent(0, ipv4_packet("192.168.2.2", 1000), now=0.0)
    em.sent(0, ipv4_packet("8.8.8.8", 1000), now=0.0)
    assert [event[3] for event in heapq.nsmallest(9, em.events)] == [1]
    assert em.hosts[0].counters.dropped_unroutable == 1


def _view(k, manifest, dropped=(), state="closed"):
    return {
        "round": k,
        "state": state,
        "manifest": [{"peer_id": p} for p in manifest],
        "dropped": {p: "unfetchable" for p in dropped},
    }


def test_per_peer_rows_count_the_final_manifests_that_hold_each_peers_packet():
    rounds = {
        0: _view(0, ["pa", "pb", "pc"]),
        1: _view(1, ["pa", "pb"], dropped=["pc"]),
        2: _view(2, ["pa"]),
        3: _view(3, [], state="open"),
    }  # an open round is not counted
    reports = [{"rounds": [{}, {}, {}]}, {"rounds": [{}, {}]}, {"peer_id": None, "rounds": [{"pushed_to": "12D3"}]}]
    peers = [
        {"peer_id": "pa", "standing": "contributor", "reachable": True},
        {"peer_id": "pc", "standing": "not_waited", "reachable": False},
    ]
    rows = peer_rows(["pa", "pb", "pc"], [False, False, True], rounds, reports, peers)
    assert [(r["host"], r["behind_nat"], r["rounds_in_manifest"], r["rounds"]) for r in rows] == [
        ("h1", False, 3, 3),
        ("h2", False, 2, 3),
        ("h3", True, 1, 3),
    ]
    assert [r["rounds_dropped"] for r in rows] == [0, 0, 1]
    assert [r["rounds_applied"] for r in rows] == [3, 2, 1]
    assert [r["standing"] for r in rows] == ["contributor", None, "not_waited"]
    assert [(r["reachable"], r["rounds_pushed"]) for r in rows] == [(True, 0), (None, 0), (False, 1)]
    unknown = peer_rows([None], [True], rounds, [{"rounds": []}])[0]
    assert (unknown["peer_id"], unknown["rounds_in_manifest"], unknown["rounds"]) == (None, 0, 3)
    with pytest.raises(ValueError):
        peer_rows(["pa"], [False, True], rounds, reports[:1])

    table = format_peers(rows).splitlines()
    assert table[0].split() == [
        "host", "peer", "NAT", "reachable", "path", "in", "manifest", "pushed", "dropped", "applied", "standing",
        "xfer/ideal", "util",
    ]  # fmt: skip
    assert table[3].split() == ["h3", "pc", "yes", "no", "push", "1/3", "1", "1", "1", "not_waited", "-", "-"]
