"""Can peers dial a joining node? The coordinator's dial-back check, in the join route.

    reachable = await dial_back(source, request.listen_multiaddrs)   # True, False, or None (cannot tell)

A node behind a NAT or a firewall can dial out but nobody can dial in, and it cannot tell which
from its own addresses alone (a private address may be forwarded, a public one firewalled). The
coordinator sees the address a join came from: it opens a TCP connection to that address on each
TCP port the node listens on (at most MAX_PORTS, DIAL_TIMEOUT_S each, all at once). One that
connects means peers elsewhere can dial the node there; none means they cannot. It dials only the
caller's own address, so a join cannot aim the coordinator at anyone else. None: no address seen
(a test client), or no TCP port named: a node that names only relayed addresses (`/p2p-circuit`,
reachable through a libp2p relay: node/exchange/host.py) is not dialled, as the relay's port is
not its own, and counts as dialable. The answer is stored with the member (PeerView.reachable)
and sent back in the join's answer; nodes keep members nobody can dial out of the inside of their
packets' trees, and such a node pushes its packet to a reachable one (node/exchange/push.py).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Iterable

log = logging.getLogger(__name__)

MAX_PORTS = 4
DIAL_TIMEOUT_S = 2.0


def tcp_ports(maddrs: Iterable[str]) -> list[int]:
    """The TCP ports named in multiaddrs ("/ip4/x/tcp/PORT/..."), first seen first, at most MAX_PORTS;
    relayed addresses left out."""
    ports: list[int] = []
    for maddr in maddrs:
        if "/p2p-circuit" in maddr:  # the TCP port there is the relay's
            continue
        parts = maddr.split("/")
        for i, part in enumerate(parts[:-1]):
            if part == "tcp" and parts[i + 1].isdigit() and 0 < int(parts[i + 1]) < 65536:
                port = int(parts[i + 1])
                if port not in ports:
                    ports.append(port)
    return ports[:MAX_PORTS]


async def dial_back(source: str | None, maddrs: Iterable[str], timeout_s: float = DIAL_TIMEOUT_S) -> bool | None:
    """Whether a TCP connection to `source` on one of the ports in `maddrs` opens within `timeout_s`."""
    try:
        ip = ipaddress.ip_address(source) if source else None
    except ValueError:  # not an IP (a test client's "testclient")
        ip = None
    ports = tcp_ports(maddrs)
    if ip is None or not ports:
        return None

    async def dial(port: int) -> bool:
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(str(ip), port), timeout_s)
        except (OSError, asyncio.TimeoutError):
            return False
        writer.close()
        try:
            await writer.wait_closed()
        except OSError:
            pass
        return True

    answers = await asyncio.gather(*(dial(p) for p in ports))
    log.debug("dial-back to %s on ports %s: %s", ip, ports, answers)
    return any(answers)
