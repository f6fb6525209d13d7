"""Fetching a round's packets while it is still open, and starting the decoding of each as it arrives.

The coordinator's long-poll answers at every new submission, so packets move while the slower
peers (and this node) still train; only the last ones are left for after the close. Each packet
spreads down its own tree of the run's live members (node/exchange/topology.py): this node asks
its parent there first. Each packet that arrives is handed to the session's `EarlyDecodes`
(node/training/decode.py, which owns decoding and its workers), off the round's critical path;
the round's `prepare` (node/round/steps.py) takes those results.

A publisher the coordinator flags `withheld_packet` (a packet of its was dropped as unfetchable) is
a suspect: its packet is given up once no copy of it is arriving (node/exchange/fetch.py), and not
asked again after the close (`Prefetch.suspects`).

In a bounded round (``outer.max_contributors`` M > 0, protocol/selection.py) the submissions are not
fetched while the round is open: which of them the manifest takes is known only at the close, and
fetching only the manifest's packets is what bounds the bytes a node receives to M packets a round.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from node.exchange.base import MirrorCopy
from node.exchange.topology import tree_parent
from node.round.session import Session
from node.training.decode import PacketKey
from protocol.http import ManifestEntry, RoundView

log = logging.getLogger("locoswarm.node")


@dataclass(slots=True)
class Prefetch:
    """One round's submissions being watched, and the fetches started for them."""

    task: asyncio.Task  # returns the closed round's view
    early: dict[PacketKey, asyncio.Task]
    started: dict[PacketKey, float]  # when each early fetch began (the loop's clock)
    suspects: set[str]  # publishers flagged `withheld_packet` when the round's members were read

    @classmethod
    def start(cls, s: Session, round: int) -> "Prefetch":
        early: dict[PacketKey, asyncio.Task] = {}
        started: dict[PacketKey, float] = {}
        suspects: set[str] = set()
        task = asyncio.create_task(_watch_submissions(s, round, early, started, suspects))
        return cls(task, early, started, suspects)

    def cancel(self) -> None:
        self.task.cancel()
        for fetch in self.early.values():
            fetch.cancel()


async def _watch_submissions(
    s: Session,
    round: int,
    early: dict[PacketKey, asyncio.Task],
    started: dict[PacketKey, float],
    suspects: set[str],
) -> RoundView:
    """Fetch each of the round's packets as soon as it is submitted, into `early` (`started`: when),
    until the round closes; returns the closed round's view. `suspects` gets the members flagged
    `withheld_packet`."""
    members = await live_members(s)
    suspects |= members.withheld
    if members.addresses:  # only members are served as tree children (node/exchange/serve.py)
        s.exchange.set_members(
            {m.rpartition("/p2p/")[2] for maddrs in members.addresses.values() for m in maddrs if "/p2p/" in m}
        )
    bounded = s.run.outer.max_contributors > 0
    # A bounded round is only waited on until it closes: its submissions wake nobody here.
    view = await s.client.round(round, wait_s=30, submitted_gt=None if bounded else 0)
    while True:
        # A closed round lists its packets in the manifest only: the last submission is seen
        # there, and its fetch starts here too, beside those still running. A bounded round's
        # submissions are not fetched before the pick: a node receives the manifest's M only.
        for e in view.manifest if view.state == "closed" else [] if bounded else view.submitted:
            if e.peer_id != s.peer_id and (e.peer_id, e.packet_digest) not in early:
                parent = tree_parent(
                    round,
                    e.peer_id,
                    s.peer_id,
                    members.addresses,
                    s.run.exchange.tree_fanout,
                    members.uplinks,
                    members.reachable,
                )
                parent_maddrs = e.multiaddrs if parent == e.peer_id else members.addresses.get(parent, [])
                pushed_here = parent == e.peer_id and members.reachable.get(parent) is False
                if pushed_here:
                    parent_maddrs = []  # nobody can dial it: it pushes the packet here (node/round/push.py)
                early[e.peer_id, e.packet_digest] = asyncio.create_task(
                    _fetch_early(
                        s,
                        round,
                        e,
                        {e.peer_id: parent_maddrs} if parent_maddrs else None,
                        pushed_here,
                        e.peer_id in suspects,
                    )
                )
                started[e.peer_id, e.packet_digest] = asyncio.get_running_loop().time()
        if view.state == "closed":
            return view
        view = await s.client.round(round, wait_s=30, submitted_gt=None if bounded else view.num_submitted)


async def _fetch_early(
    s: Session, round: int, entry: ManifestEntry, parents, pushed_here: bool = False, suspect: bool = False
) -> dict[str, bytes]:
    """One submitted packet, fetched (`pushed_here`: its publisher pushes it to this node, awaited
    first; `suspect`: given up once no copy of it arrives); its decoding starts at once."""
    got = await s.exchange.fetch(
        round,
        {entry.peer_id: entry.packet_digest},
        {entry.peer_id: entry.multiaddrs},
        timeout_s=s.config.network.fetch_timeout_s,
        parents=parents,
        mirrors={entry.peer_id: MirrorCopy(entry.mirror_url, entry.packet_size_bytes)} if entry.mirror_url else None,
        pushed_here=(entry.peer_id,) if pushed_here else (),
        suspects=(entry.peer_id,) if suspect else (),
    )
    if (payload := got.get(entry.peer_id)) is not None:
        s.decoded.start(
            s.outer,
            payload,
            bytes.fromhex(entry.public_key),
            peer_id=entry.peer_id,
            packet_digest=entry.packet_digest,
            run_id=s.run_id,
            round=round,
        )
    return got


@dataclass(frozen=True, slots=True)
class Members:
    """The run's live peers by peer id (this node included), as the trees need them."""

    addresses: dict[str, list[str]]
    uplinks: dict[str, float | None]  # stated at join
    reachable: dict[str, bool | None]  # can peers dial it (coordinator/reachability.py)
    withheld: frozenset[str] = frozenset()  # flagged `withheld_packet`: a packet of theirs was dropped


async def live_members(s: Session) -> Members:
    """The run's live peers; none if the coordinator does not answer (packets are then fetched
    without a tree)."""
    try:
        status = await s.client.status(history=0)  # the members only: no round history
    except Exception as e:  # the tree is an optimisation; fetching works without it
        log.debug("reading the run's members failed: %r", e)
        return Members({}, {}, {})
    live = [p for p in status.peers if p.status == "live"]
    addresses = {p.peer_id: p.listen_multiaddrs for p in live}
    return Members(
        addresses | {s.peer_id: addresses.get(s.peer_id, [])},
        {p.peer_id: p.uplink_mbps for p in live},
        {p.peer_id: p.reachable for p in live} | {s.peer_id: s.reachable},
        frozenset(p.peer_id for p in live if "withheld_packet" in p.flags),
    )
