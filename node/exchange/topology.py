"""Where each packet's copies come from: the distribution trees of a round's members.

Pure functions of the round, the member list and the members' stated uplinks, so every peer
computes the same trees without talking (the cost model is in `tree_parent`'s docstring).
"""

from __future__ import annotations

import hashlib
import heapq
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

    With `uplinks` (the members' stated upload rates in Mbps, as the coordinator lists them), only
    the members of the fastest `uplink_class` forward: they make the heap (ring order), and every
    slower member is a leaf, hung on the forwarder that offers it the most (uplink over its
    children plus one; ties to the shallower). A slow uplink forwarding splits its few Mbps
    between its children and its own packet's first copy, which every peer waits for; a fast one
    barely notices a slow child (TCP leaves it the rest). Where the fastest are too few, so that
    the best offer falls under a leaf's own uplink over the fan-out, that leaf forwards too (the
    fastest leftovers first). A publisher slower than the forwarders sends one copy, to the first
    of them, which roots the rest of the tree: its uplink carries the packet once, at its full
    rate, instead of `fanout` times at a fraction of it.

    With `reachable` (False: peers cannot dial that member, coordinator/reachability.py), members
    nobody can dial never forward, as leaves of every tree: nobody could ask them for a copy. A
    publisher nobody can dial sends one copy, by pushing it (node/exchange/push.py) to the first
    member of its tree (`push_targets`), which roots the rest.
    """
    if fanout < 1:
        raise ValueError("fanout must be at least 1")
    if peer == publisher:
        return None
    return _tree(round, publisher, members, fanout, uplinks, reachable).get(peer)


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


def _tree(
    round: int,
    publisher: str,
    members: Iterable[str],
    fanout: int,
    uplinks: Mapping[str, float | None] | None,
    reachable: Mapping[str, bool | None] | None,
) -> dict[str, str]:
    """Every member's parent in `publisher`'s tree (see `tree_parent`)."""
    heap = _heap(round, publisher, members, uplinks, reachable)
    rates = uplinks or {}
    stated = [r for r in rates.values() if r and r > 0]
    default_rate = max(stated, default=1.0)  # an unstated uplink counts as the fastest

    def rate(m: str) -> float:
        return r if (r := rates.get(m)) and r > 0 else default_rate

    dialable = [m for m in heap[1:] if _dialable(reachable, m)]
    top = max((uplink_class(rates.get(m)) for m in dialable), default=None)
    forwarders = [m for m in dialable if uplink_class(rates.get(m)) == top]
    leaves = [m for m in heap[1:] if m not in forwarders]
    one_copy = bool(forwarders) and (
        not _dialable(reachable, publisher) or uplink_class(rates.get(publisher)) < (top or 0)
    )
    parent: dict[str, str] = {}
    if one_copy:  # the publisher's one copy roots a heap of the forwarders
        parent[forwarders[0]] = publisher
        backbone = forwarders
    else:
        backbone = [publisher, *forwarders]
    for i in range(1, len(backbone)):
        parent[backbone[i]] = backbone[(i - 1) // fanout]
    # What each forwarder's children ask of its uplink (their own rates), over that uplink: each
    # leaf goes to the least loaded (the first, shallowest, of equals).
    load = {m: 0.0 for m in backbone if not (one_copy and m == publisher)}
    for child, m in parent.items():
        if m in load:
            load[m] += rate(child)
    queue = [(load[m] / rate(m), i, m) for i, m in enumerate(load)]
    heapq.heapify(queue)
    leaves.sort(key=lambda m: -uplink_class(rates.get(m)))  # stable: the fastest choose first
    for i, leaf in enumerate(leaves, start=len(queue)):
        if not queue:  # nobody forwards: the publisher serves all
            parent[leaf] = publisher
            continue
        _, order, best = heapq.heappop(queue)
        parent[leaf] = best
        load[best] += rate(leaf)
        heapq.heappush(queue, (load[best] / rate(best), order, best))
        if load[best] / rate(best) > fanout and _dialable(reachable, leaf):
            load[leaf] = 0.0  # the fast ones are too few: this one forwards too
            heapq.heappush(queue, (0.0, i, leaf))
    return parent


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
