"""Keeping a node in the swarm's one DHT: mending the islands a whole-swarm restart leaves.

    members = live_member_addresses(status, exclude_peer=my_id, fresh_s=timeout / 2)  # at start
    task = start_mending(session, heartbeat_timeout_s)  # beside the heartbeats; None without a DHT

Nodes restarted at the same moment each find every address they were given dead (the peers that
died with them) and start a DHT of their own (node/exchange/host.py). hivemind never looks for
peers it was not given, so each would stay an island for good: its records (the snapshot it
serves from its checkpoint, the copies it holds) invisible to the others, and a node with an
empty disk would never find a snapshot holder. `keep_in_swarm` mends it from the coordinator's
list of live members: while this node's routing table holds no other peer it asks every
REJOIN_ALONE_S, and every REJOIN_EVERY_S otherwise (islands of several nodes merge too); members
missing from the routing table are dialled and their DHT nodes pinged (`P2PExchange.rejoin_dht`),
which enters each side in the other's table, so one exchange of pings merges two islands. The
common case, a node whose table knows every member, costs one status read a minute.

A table can also empty while the mender sleeps its minute: a node paused (SIGSTOP, a suspended
laptop) wakes with every peer timed out of it. So the mender looks at the table every
REJOIN_ALONE_S, and mends at once when the table is empty or when a step asks (`Session.mend_dht`:
a catch-up whose lookup found live authors' packets announced by nobody). A test's paused node
otherwise waited up to the minute with an empty table while its replay found no holder, and the
run's short rounds had all ended when it was mended.

Only members seen within half the heartbeat timeout (two heartbeats) are dialled: a restarted
coordinator keeps dead peers live, with their old addresses, for a grace period (coordinator/
service.py, "Restart grace"), and a dead address costs a dial time-out.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import TYPE_CHECKING

from node.round.coordinator_client import CoordinatorCallFailed

if TYPE_CHECKING:
    from node.round.session import Session
    from protocol.http import RunStatus

log = logging.getLogger("locoswarm.node")

REJOIN_ALONE_S = 2.0  # with no other peer in this node's DHT, look for the live members this often
REJOIN_EVERY_S = 60.0  # otherwise this often: members missing from the routing table are dialled
MAX_REJOIN_PEERS = 16  # members dialled in one pass (random ones when more are missing)


def live_member_addresses(status: RunStatus, *, exclude_peer: str | None, fresh_s: float) -> list[str]:
    """The multiaddrs of the run's live members other than `exclude_peer` that the coordinator heard
    from within `fresh_s` (or two of the member's heartbeat periods, in a swarm big enough to
    stretch them) of its `now`; the others may be dead peers kept live by a restart grace."""
    return [
        m
        for p in status.peers
        if p.status == "live"
        and p.peer_id != exclude_peer
        and status.now - p.last_seen_at <= max(fresh_s, 2 * (p.heartbeat_interval_s or 0.0))
        for m in p.listen_multiaddrs
    ]


def start_mending(s: Session, heartbeat_timeout_s: float) -> asyncio.Task | None:
    """`keep_in_swarm` in the background, for an exchange with a DHT to mend (None otherwise)."""
    if getattr(s.exchange, "rejoin_dht", None) is None:  # the in-memory exchange has no DHT
        return None
    return asyncio.create_task(keep_in_swarm(s, heartbeat_timeout_s))


async def keep_in_swarm(s: Session, heartbeat_timeout_s: float) -> None:
    """Forever (cancel it): enter the DHT of the live members this node's routing table lacks."""
    exchange = s.exchange
    last = time.monotonic()
    while True:
        try:
            await asyncio.wait_for(s.mend_dht.wait(), REJOIN_ALONE_S)
        except asyncio.TimeoutError:
            if exchange.dht_peers and time.monotonic() - last < REJOIN_EVERY_S:
                continue
        s.mend_dht.clear()
        last = time.monotonic()
        try:
            status = await s.client.status(history=0)
        except CoordinatorCallFailed as e:  # an outage is logged by the client; the next pass asks again
            log.debug("DHT rejoin: no member list: %s", e)
            continue
        by_peer: dict[str, list[str]] = {}
        for maddr in live_member_addresses(status, exclude_peer=s.peer_id, fresh_s=heartbeat_timeout_s / 2):
            by_peer.setdefault(maddr.rpartition("/p2p/")[2], []).append(maddr)
        missing = [holder for holder in by_peer if holder and holder not in exchange.dht_peers]
        if not missing:
            continue
        picked = random.sample(missing, min(MAX_REJOIN_PEERS, len(missing)))
        try:
            joined = await exchange.rejoin_dht([m for holder in picked for m in by_peer[holder]])
        except Exception as e:  # mending is best effort: the next pass tries again
            log.warning("DHT rejoin failed: %r", e)
            continue
        if joined:
            log.info(
                "DHT: %d live member%s entered this node's routing table (it knew %d of %d): %s",
                len(joined),
                "" if len(joined) == 1 else "s",
                len(by_peer) - len(missing),
                len(by_peer),
                ", ".join(joined),
            )
