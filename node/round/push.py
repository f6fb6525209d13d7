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

A pass where every target refused or failed is tried again, after 2 s, then twice as long each
time up to 30 s, for as long as the packet can still matter: until this node applied the round
after it (the swarm agreed on it, so its peers have this round's packets), the session stops, or
`PUSH_PATIENCE_S` passed. A holder checks each push with the coordinator, so while the
coordinator is unreachable every push is refused; the retries carry the packet over an outage of
minutes, and the round cannot close before the coordinator is back anyway.

After a restart such a node serves again the packets it kept on disk (node/round/loop.py
`serve_kept_packets`), which nobody can fetch from it: the copies it pushed before may have died
with their holders. It pushes each of them again (`push_kept`). Before, a chaos run that killed
every node after a round closed lost the NAT'd node's packet of that round (amended out), then of
the next, and the second drop excluded it for four rounds (a chaos run, `tools.chaos --seed 5
--adversary undialable`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable

from node.exchange.topology import push_targets
from node.round.prefetch import live_members
from node.round.reports import RoundReport
from node.round.session import Session

log = logging.getLogger("locoswarm.node")

MAX_TARGETS = 4  # members a push is offered to, in order
PUSH_RETRY_FIRST_S = 2.0  # pause after the first pass nobody took the packet in; doubles
PUSH_RETRY_MAX_S = 30.0
PUSH_PATIENCE_S = 900.0  # the longest a packet is pushed for (a coordinator outage of minutes)


async def push_plan(s: Session, round: int) -> list[list[str]]:
    """The multiaddrs of the members this node pushes its packet of `round` to, in order; [] when
    peers can dial it, its operator turned pushing off (`--no-push`), or no reachable member is
    known."""
    if s.reachable is not False or not s.config.network.push_packets:
        return []
    members = await live_members(s)
    order = push_targets(round, s.peer_id, members.addresses, members.uplinks, members.reachable)
    return [members.addresses[m] for m in order if members.addresses.get(m)][:MAX_TARGETS]


async def push_own(s: Session, round: int, targets: list[list[str]], report: RoundReport | None = None) -> None:
    """Push this node's packet of `round` to the first target that takes it, pass after pass while
    the packet can still matter (logged either way); the holder goes into `report`."""
    loop = asyncio.get_running_loop()
    give_up_at = loop.time() + PUSH_PATIENCE_S
    pause_s = PUSH_RETRY_FIRST_S
    while True:
        try:
            holder = await s.exchange.push(round, s.peer_id, targets, timeout_s=s.config.network.fetch_timeout_s)
        except KeyError:  # nothing held to push (a withheld packet: node/faults.py)
            return
        if holder is not None:
            if report is not None:
                report.pushed_to = holder
            return
        if not _still_needed(s, round) or loop.time() + pause_s > give_up_at:
            log.warning(
                "round %d: no reachable peer took this node's packet (%d asked); peers fetch it only over"
                " connections this node opened",
                round,
                len(targets),
            )
            return
        log.info("round %d: no reachable peer took this node's packet; pushing again in %.0f s", round, pause_s)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(s.stopping.wait(), pause_s)
        if not _still_needed(s, round):
            return
        pause_s = min(2 * pause_s, PUSH_RETRY_MAX_S)
        with contextlib.suppress(Exception):  # the members may have changed; the coordinator may be away
            targets = await push_plan(s, round) or targets


def push_kept(s: Session, rounds: Iterable[int]) -> None:
    """After a restart, push again this node's packets of `rounds`, kept on disk and served again,
    when nobody can dial it: each planned and pushed in the background, so that the node's start
    does not wait on the coordinator's member list (an outage of minutes)."""
    if s.reachable is not False or not s.config.network.push_packets:
        return
    for round in rounds:
        s.spawn(_plan_and_push(s, round))


async def _plan_and_push(s: Session, round: int) -> None:
    await push_own(s, round, await push_plan(s, round))


def _still_needed(s: Session, round: int) -> bool:
    """Whether peers may still fetch this node's packet of `round`: until this node applied the
    round after it (the swarm agreed on round + 1, which starts from round's packets)."""
    params_round = s.state.params_round
    return not s.stopping.is_set() and (params_round is None or params_round <= round + 1)


async def accept_push(s: Session, round: int, publisher: str, digest: str) -> bool:
    """Whether `publisher` submitted `digest` for `round`, as the coordinator's view of the round says."""
    view = await s.client.round(round)
    entries = view.submitted if view.state == "open" else view.manifest
    return any(e.peer_id == publisher and e.packet_digest == digest for e in entries)
