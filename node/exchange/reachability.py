"""Can peers on other networks dial this node? Multiaddr classification, in plain words.

    report = assess_reachability(exchange.visible_maddrs)   # what P2PExchange.reachability_check returns
    log.info("reachability: %s", report.advice)

NAT options live in `ExchangeConfig` (node/exchange/config.py): `use_relay` (on by default, as in
hivemind) lets this node reach peers through libp2p relays; `use_auto_relay` makes a node behind
NAT reachable through one; `client_mode` joins the DHT without serving DHT requests (for nodes
nobody can dial). The node's doctor (node/cli/doctor.py) runs the same check before joining.
Also here: the multiaddr helpers the exchange uses to tell loopback listen addresses, to group
a hint's addresses by the libp2p id they end in, to write a relayed (circuit) address, to bound
what a node nobody can dial dials for connection reversal (`peers_to_dial`), and to encode an
address the way p2pd reads it (`p2pd_multiaddr`).
"""

from __future__ import annotations

import ipaddress
import logging

import base58
from hivemind.utils.multiaddr import Multiaddr
from hivemind.utils.multiaddr.exceptions import Error as MultiaddrError

from node.exchange.base import Reachability

log = logging.getLogger(__name__)

CIRCUIT = "/p2p-circuit"
MAX_DIAL_ADDRS = 4  # addresses of one peer dialled for connection reversal, at most
_P2P_CODE = b"\xa5\x03"  # varint of the multicodec 0x01a5 (p2p)


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
            "/ip4/<public IP>/tcp/PORT, or pass --relay-via <a relay's multiaddr>."
        )
    else:
        advice = (
            "This node announces private addresses only: peers outside this network cannot dial it. Forward "
            "a port and pass --announce-maddrs /ip4/<public IP>/tcp/PORT, or pass --relay-via <a relay's "
            "multiaddr> (reachable through that relay), or --behind-nat (push packets to reachable peers)."
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
    """Multiaddrs ending in /p2p/<libp2p id>, grouped by that id (others are logged and skipped); a
    relayed address names its relay's id first and the holder's last."""
    by_holder: dict[str, list[str]] = {}
    for text in maddrs:
        holder = text.rpartition("/p2p/")[2]
        try:
            Multiaddr(text)
        except MultiaddrError:  # does not parse (a ValueError too)
            holder = ""
        if not holder or "/" in holder:
            log.warning("ignoring hinted holder %r: not a multiaddr ending in /p2p/<id>", text)
            continue
        by_holder.setdefault(holder, []).append(text)
    return by_holder


def peers_to_dial(
    targets: list[list[str]], own_id: str, max_peers: int, max_addrs: int = MAX_DIAL_ADDRS
) -> dict[str, list[str]]:
    """The peers a node nobody can dial dials for connection reversal, from `targets` (each a peer's
    multiaddrs ending in /p2p/<libp2p id>, as a heartbeat answer lists them): grouped by id, never
    `own_id`, at most `max_peers` ids with at most `max_addrs` addresses each. Only the first
    `max_peers` lists and their first `max_addrs` addresses are read, so however long or hostile
    the list, at most `max_peers` dials of `max_addrs` addresses follow."""
    read = [m for maddrs in targets[:max_peers] for m in maddrs[:max_addrs]]
    picked = [(peer, maddrs[:max_addrs]) for peer, maddrs in addresses_by_holder(read).items() if peer != own_id]
    return dict(picked[:max_peers])


def circuit_address(relay_maddr: str, holder_id: str) -> str:
    """The address that reaches `holder_id` through the relay at `relay_maddr` (ending in
    /p2p/<relay id>): `<relay_maddr>/p2p-circuit/p2p/<holder_id>`."""
    if "/p2p/" not in relay_maddr or CIRCUIT in relay_maddr:
        raise ValueError(f"a relay's address ends in /p2p/<its libp2p id> and is not relayed itself: {relay_maddr!r}")
    return f"{relay_maddr}{CIRCUIT}/p2p/{holder_id}"


def is_relayed(maddr: str) -> bool:
    return CIRCUIT in maddr


def p2pd_multiaddr(text: str) -> Multiaddr:
    """`text` as p2pd parses it. hivemind's Multiaddr writes each /p2p/<id> part as a CID (version,
    codec, multihash), where go-multiaddr reads a bare multihash: p2pd refuses such an address with
    "length greater than remaining number of bytes in buffer". A relayed address keeps the relay's
    /p2p/<id> inside, so the parts are encoded here, the /p2p/ ones as length-prefixed multihashes."""
    encoded, rest = b"", text
    while "/p2p/" in rest:
        head, _, tail = rest.partition("/p2p/")
        peer, slash, rest = tail.partition("/")
        rest = slash + rest
        digest = base58.b58decode(peer)
        if not 0 < len(digest) < 128:  # one varint byte for the length
            raise ValueError(f"not a libp2p id: {peer!r} in {text!r}")
        encoded += (Multiaddr(head).to_bytes() if head else b"") + _P2P_CODE + bytes([len(digest)]) + digest
    return Multiaddr(encoded + (Multiaddr(rest).to_bytes() if rest else b""))
