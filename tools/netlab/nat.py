"""Hosts behind NAT in the network lab: each one behind a router namespace of its own, as a volunteer
behind a home router that nobody can dial.

    hosts = nat_hosts(num_peers=8, num_nat=3)               # [6, 7, 8]: the last three peers' hosts
    routers = plan_nat("lsnl-42-", "10.213.43", hosts)      # {6: NatRouter(...), ...}
    for command, stdin in routers[6].setup_commands(host_namespace="lsnl-42-h6"): ...
    topology.probe_nat(6, prober=1)    # tools/netlab/topology.py: inbound blocked, outbound masqueraded

A NAT'd host hI sits on a LAN of its own, 192.168.I.0/24 (the host .2, the router .1, over an
unshaped veth pair `eth0` <-> `lan0`), with its default route via the router. The router's uplink,
`eth0`, takes hI's place on the lab's shared segment (hI's segment address, hI's link rate and
delay), so what the other hosts see of hI is the router. The router forwards the LAN's connections
out with their source rewritten to its uplink address (nftables `masquerade` on the uplink) and
forwards nothing in but their replies (`ct state established,related`); with no port forwarding, a
connection to the router's address finds nobody listening and is refused. The rules live in the
router's namespace (table `ip lsnl_nat`) and go with it when the lab deletes the namespace.

Every NAT'd host has a LAN of its own numbers, so an address never names two hosts in the lab;
real home networks often share 192.168.1.0/24, which the lab does not model.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass

NAT_TABLE = "lsnl_nat"
UPLINK = "eth0"  # the router's interface on the lab's segment
LAN = "lan0"  # the router's interface towards its host


@dataclass(frozen=True, kw_only=True, slots=True)
class NatRouter:
    """The router in front of lab host h<host>."""

    host: int  # the lab host behind it
    namespace: str  # the router's network namespace
    uplink_ip: str  # its address on the lab's segment: the NAT'd host's address as every other host sees it
    lan_prefix: str  # the first three octets of its LAN, a /24: "192.168.<host>"

    @property
    def router_lan_ip(self) -> str:
        return f"{self.lan_prefix}.1"

    @property
    def host_lan_ip(self) -> str:
        """The NAT'd host's own address: what its programs bind to and announce."""
        return f"{self.lan_prefix}.2"

    @property
    def lan_subnet(self) -> str:
        return f"{self.lan_prefix}.0/24"

    def ruleset(self) -> str:
        """The router's nftables rules: masquerade out of the uplink, forward in only replies."""
        return (
            f"table ip {NAT_TABLE} {{\n"
            f"  chain postrouting {{\n"
            f"    type nat hook postrouting priority srcnat; policy accept;\n"
            f'    oifname "{UPLINK}" masquerade\n'
            f"  }}\n"
            f"  chain forward {{\n"
            f"    type filter hook forward priority filter; policy drop;\n"
            f"    ct state established,related accept\n"
            f'    iifname "{LAN}" oifname "{UPLINK}" accept\n'
            f"  }}\n"
            f"}}\n"
        )

    def setup_commands(self, host_namespace: str) -> list[tuple[list[str], str | None]]:
        """(command, stdin) pairs that build the LAN side, once both namespaces exist and the
        router's uplink is up: the veth pair, addresses, the host's default route, forwarding, rules."""
        router, host = self.namespace, host_namespace
        return [
            # Made in the router's namespace with its far end placed straight into the host's.
            (["ip", "-n", router, "link", "add", LAN, "type", "veth", "peer", "name", "eth0", "netns", host], None),
            (["ip", "-n", router, "addr", "add", f"{self.router_lan_ip}/24", "dev", LAN], None),
            (["ip", "-n", router, "link", "set", LAN, "up"], None),
            (["ip", "-n", host, "addr", "add", f"{self.host_lan_ip}/24", "dev", "eth0"], None),
            (["ip", "-n", host, "link", "set", "eth0", "up"], None),
            (["ip", "-n", host, "route", "add", "default", "via", self.router_lan_ip], None),
            (["ip", "netns", "exec", router, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"], None),
            (["ip", "netns", "exec", router, "nft", "-f", "-"], self.ruleset()),
        ]


def nat_hosts(num_peers: int, num_nat: int) -> list[int]:
    """The hosts put behind NAT: the last `num_nat` of the peers' hosts h1..hN (h0, the
    coordinator's, stays public)."""
    if not 0 <= num_nat <= num_peers:
        raise ValueError(f"--nat takes 0 to {num_peers} hosts (the peers'), not {num_nat}")
    return list(range(num_peers - num_nat + 1, num_peers + 1))


def plan_nat(prefix: str, subnet: str, hosts: list[int]) -> dict[int, NatRouter]:
    """A router for each host in `hosts`; `subnet` is the segment's first three octets, where host
    i's address is .i+1 (the router takes it over)."""
    if any(not 1 <= i <= 254 for i in hosts):
        raise ValueError(f"NAT'd hosts are h1..h254, not {hosts}")
    return {
        i: NatRouter(host=i, namespace=f"{prefix}nat{i}", uplink_ip=f"{subnet}.{i + 1}", lan_prefix=f"192.168.{i}")
        for i in hosts
    }


def firewall_available() -> tuple[bool, str]:
    """Whether this machine has what the NAT routers need (nft), and if not, why."""
    if shutil.which("nft") is None:
        return False, "hosts behind NAT need nftables (`nft`; Debian: apt-get install nftables)"
    return True, "ok"
