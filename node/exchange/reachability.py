"""Can peers on other networks dial this node? Multiaddr classification, in plain words.

    report = assess_reachability(exchange.visible_maddrs)   # what P2PExchange.reachability_check returns
    log.info("reachability: %s", report.advice)

NAT options live in `ExchangeConfig` (node/exchange/config.py): `use_relay` (on by default, as in
hivemind) lets this node reach peers through libp2p relays; `use_auto_relay` makes a node behind
NAT reachable through one; `client_mode` joins the DHT without serving DHT requests (for nodes
nobody can dial). The node's doctor (node/cli/doctor.py) runs the same check before joining.
Also here: the multiaddr helpers the exchange uses to tell loopback listen addresses and to group
a hint's addresses by the libp2p id they end in.
"""

from __future__ import annotations

import ipaddress
import logging

from hivemind.utils.multiaddr import Multiaddr
from hivemind.utils.multiaddr.exceptions import Error as MultiaddrError

from node.exchange.base import Reachability

log = logging.getLogger(__name__)


def assess_reachability(maddrs: list[str]) -> Reachability:
    """Classify announced multiaddrs and say in one sentence what to do if nobody can dial them."""
    public, relayed, loopback = [], False, True
    for text in maddrs:
        maddr = Multiaddr(text)
        if "p2p-circuit" in text:
            relayed = True
        ip = ip_of(maddr)
        if ip is None:
            loopback = False
            continue
        loopback &= ip.is_loopback
        if ip.is_global:
            public.append(text)
    reachable = bool(public) or relayed
    if public:
        advice = "This node announces a public address; peers on other networks can dial it if the port is open."
    elif relayed:
        advice = "This node is reachable through a libp2p relay; transfers to it go through the relay."
    elif loopback:
        advice = (
            "This node listens on loopback only: only processes on this machine can reach it. To join peers "
            "elsewhere, pass --host-maddrs /ip4/0.0.0.0/tcp/PORT and --announce-maddrs "
            "/ip4/<public IP>/tcp/PORT, or enable --auto-relay / client mode."
        )
    else:
        advice = (
            "This node announces private addresses only: peers outside this network cannot dial it. Forward "
            "a port and pass --announce-maddrs /ip4/<public IP>/tcp/PORT, or enable --auto-relay "
            "(reachable through a relay) or client mode (fetches only, serves nobody)."
        )
    return Reachability(list(maddrs), public, relayed, loopback and bool(maddrs), reachable, advice)


def ip_of(maddr: Multiaddr) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    for proto in ("ip4", "ip6"):
        try:
            return ipaddress.ip_address(maddr.value_for_protocol(proto))
        except (MultiaddrError, ValueError):  # no such part (ProtocolLookupError), or not an IP
            continue
    return None


def is_loopback(maddr: Multiaddr) -> bool:
    ip = ip_of(maddr)
    return ip is not None and ip.is_loopback


def addresses_by_holder(maddrs: list[str]) -> dict[str, list[str]]:
    """Multiaddrs ending in /p2p/<libp2p id>, grouped by that id (others are logged and skipped)."""
    by_holder: dict[str, list[str]] = {}
    for text in maddrs:
        try:
            holder = Multiaddr(text).value_for_protocol("p2p")
        except MultiaddrError:  # does not parse (a ValueError too), or has no /p2p/ part
            log.warning("ignoring hinted holder %r: not a multiaddr with /p2p/<id>", text)
            continue
        by_holder.setdefault(holder, []).append(text)
    return by_holder
