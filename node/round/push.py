"""A node nobody can dial: where its packet goes, and the check a holder makes before taking one.

    targets = await push_plan(s, round)          # [] for a node peers can dial
    multiaddrs = targets[0] if targets else announcement.multiaddrs   # what its submission names
    s.spawn(push_own(s, round, targets, report)) # after the submission was accepted
    s.exchange.accept_pushes(partial(accept_push, s))   # every node takes pushes, within its limits

Whether peers can dial this node is the coordinator's dial-back at join (coordinator/reachability.py)
or its operator's `network.behind_nat`; `Session.reachable` holds it. Such a node submits its
packet under the addresses of the first member of the packet's tree (node/exchange/topology.py,
`push_targets`: reachable members, faster uplinks first, the same order on every peer), so every
fetcher asks that member, and pushes the packet there over a stream it opens itself
(node/exchange/push.py); a member that refuses (full, busy) hands the push to the next, which
announces its copy in the DHT, where fetchers look next.
"""

from __future__ import annotations

import logging

from node.exchange.topology import push_targets
from node.round.prefetch import live_members
from node.round.reports import RoundReport
from node.round.session import Session

log = logging.getLogger("locoswarm.node")

MAX_TARGETS = 4  # members a push is offered to, in order


async def push_plan(s: Session, round: int) -> list[list[str]]:
    """The multiaddrs of the members this node pushes its packet of `round` to, in order; [] when
    peers can dial it (or no reachable member is known)."""
    if s.reachable is not False:
        return []
    members = await live_members(s)
    order = push_targets(round, s.peer_id, members.addresses, members.uplinks, members.reachable)
    return [members.addresses[m] for m in order if members.addresses.get(m)][:MAX_TARGETS]


async def push_own(s: Session, round: int, targets: list[list[str]], report: RoundReport) -> None:
    """Push this node's packet of `round` to the first target that takes it (logged either way)."""
    try:
        holder = await s.exchange.push(round, s.peer_id, targets, timeout_s=s.config.network.fetch_timeout_s)
    except KeyError:  # nothing held to push (a withheld packet: node/faults.py)
        return
    report.pushed_to = holder
    if holder is None:
        log.warning(
            "round %d: no reachable peer took this node's packet (%d asked); peers fetch it only over"
            " connections this node opened",
            round,
            len(targets),
        )


async def accept_push(s: Session, round: int, publisher: str, digest: str) -> bool:
    """Whether `publisher` submitted `digest` for `round`, as the coordinator's view of the round says."""
    view = await s.client.round(round)
    entries = view.submitted if view.state == "open" else view.manifest
    return any(e.peer_id == publisher and e.packet_digest == digest for e in entries)
