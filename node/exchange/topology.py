"""Where each packet's copies come from: the distribution trees of a round's members.

Pure functions of the round, the member list and the members' stated uplinks, so every peer
computes the same trees without talking (the cost model is in `tree_parent`'s docstring).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping


def uplink_class(uplink_mbps: float | None) -> float:
    """Which uplinks `tree_parent` treats as equals: rates within a factor of two (floor of log2);
    an unstated rate counts as the fastest."""
    return math.inf if not uplink_mbps or uplink_mbps <= 0 else math.floor(math.log2(uplink_mbps))


def tree_parent(
    round: int,
    publisher: str,
    peer: str,
    members: Iterable[str],
    fanout: int = 2,
    uplinks: Mapping[str, float | None] | None = None,
    reachable: Mapping[str, bool | None] | None = None,
) -> str | None:
    """Whom `peer` should fetch `publisher`'s round-`round` packet from: its parent in a tree of
    the round's members rooted at the publisher (None: `peer` is the publisher or not a member).

    Every peer computes the same trees from the same member list, without talking. The members
    are put in a ring, shuffled by a hash of the round (so positions change from round to round);
    the tree of a packet lays out the members that follow its publisher on the ring as a heap of
    the given fan-out. Over one round's trees every member takes every position once, so each
    forwards the same number of copies (N-1 per round, counting its own packet's first ones), as
    many as it receives: no uplink carries more than its share. Copies are forwarded while they
    arrive (cut-through), so a hop costs a piece's latency. A peer with another member list
    computes other trees: it may ask a peer that does not expect it, which costs time, never
    correctness (any holder serves any verified copy).

    With `uplinks` (the members' stated upload rates in Mbps, as the coordinator lists them), each
    tree takes the publisher's successors by `uplink_class`, fastest first, ring order within a
    class: the slow links sit at the leaves, where they forward nothing, and the members of each
    class share the forwarding evenly. A publisher slower than the fastest of the others sends
    one copy, to the first of them, which roots the rest of the tree: its uplink carries the
    packet once, at its full rate, instead of `fanout` times at a fraction of it.

    With `reachable` (False: peers cannot dial that member, coordinator/reachability.py), members
    nobody can dial sit at the leaves of every tree, behind the others: nobody could ask them for
    a copy. A publisher nobody can dial sends one copy, by pushing it (node/exchange/push.py) to
    the first member of its tree (`push_targets`), which roots the rest.
    """
    heap = _heap(round, publisher, members, uplinks, reachable)
    if fanout < 1:
        raise ValueError("fanout must be at least 1")
    if peer == publisher or peer not in heap:
        return None
    position = heap.index(peer)
    one_copy = not _dialable(reachable, publisher) or (
        uplinks and uplink_class(uplinks.get(publisher)) < uplink_class(uplinks.get(heap[1]))
    )
    if one_copy and len(heap) > 2:
        return publisher if position == 1 else heap[1 + (position - 2) // fanout]  # heap[1] roots the rest
    return heap[(position - 1) // fanout]


def push_targets(
    round: int,
    publisher: str,
    members: Iterable[str],
    uplinks: Mapping[str, float | None] | None = None,
    reachable: Mapping[str, bool | None] | None = None,
) -> list[str]:
    """The members a publisher nobody can dial pushes its packet to, in order: the first roots its
    tree (`tree_parent`), the others are asked when it refuses; only members peers can dial."""
    heap = _heap(round, publisher, members, uplinks, reachable)
    return [m for m in heap[1:] if _dialable(reachable, m)]


def _dialable(reachable: Mapping[str, bool | None] | None, member: str) -> bool:
    return reachable is None or reachable.get(member) is not False


def _heap(
    round: int,
    publisher: str,
    members: Iterable[str],
    uplinks: Mapping[str, float | None] | None,
    reachable: Mapping[str, bool | None] | None,
) -> list[str]:
    """The publisher, then the members in the order its tree lays them out (see `tree_parent`)."""
    ring = sorted(set(members) | {publisher}, key=lambda m: hashlib.sha256(f"{round}/{m}".encode()).digest())
    start = ring.index(publisher)
    heap = ring[start:] + ring[:start]  # the publisher first, then the members after it
    if uplinks or reachable:  # stable: ring order within a class
        heap[1:] = sorted(heap[1:], key=lambda m: (not _dialable(reachable, m), -uplink_class((uplinks or {}).get(m))))
    return heap
