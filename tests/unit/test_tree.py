"""The distribution trees of node.exchange.topology.tree_parent: one per packet, computed alike by every peer."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from node.exchange.topology import push_targets, tree_parent

MEMBERS = [f"peer-{i}" for i in range(8)]


def parents(round: int, publisher: str, members: list[str], fanout: int) -> dict[str, str]:
    return {m: tree_parent(round, publisher, m, members, fanout) for m in members if m != publisher}


@pytest.mark.parametrize("n, fanout", [(2, 2), (3, 2), (8, 2), (8, 1), (13, 3), (40, 2)])
def test_each_packet_has_a_tree_rooted_at_its_publisher(n, fanout):
    members = MEMBERS[:n] if n <= len(MEMBERS) else [f"m{i}" for i in range(n)]
    for round in range(3):
        for publisher in members:
            tree = parents(round, publisher, members, fanout)
            assert tree_parent(round, publisher, publisher, members, fanout) is None
            assert max(Counter(tree.values()).values()) <= fanout
            for member in tree:  # every chain of parents reaches the publisher, none loops
                hops, node = 0, member
                while node != publisher:
                    node, hops = tree[node], hops + 1
                    assert hops < n
                # a heap of this fan-out is shallow: one stream's latency per level
                assert hops <= (n - 1 if fanout == 1 else math.ceil(math.log(n * (fanout - 1) + 1, fanout)))


@pytest.mark.parametrize("fanout", [1, 2, 3])
def test_over_a_round_every_member_forwards_as_many_copies_as_it_receives(fanout):
    for round in range(4):
        sent = Counter(p for publisher in MEMBERS for p in parents(round, publisher, MEMBERS, fanout).values())
        assert sent == {m: len(MEMBERS) - 1 for m in MEMBERS}


def test_positions_change_from_round_to_round():
    seen = {tree_parent(round, "peer-0", "peer-5", MEMBERS) for round in range(20)}
    assert len(seen) > 2


def test_a_peer_outside_the_member_list_has_no_parent_and_order_of_the_list_does_not_matter():
    assert tree_parent(0, "peer-0", "stranger", MEMBERS) is None
    shuffled = MEMBERS[::-1]
    assert parents(5, "peer-3", MEMBERS, 2) == parents(5, "peer-3", shuffled, 2)
    # A publisher missing from the list (it left after submitting) still roots its packet's tree.
    assert set(parents(1, "gone", MEMBERS, 2).values()) <= set(MEMBERS) | {"gone"}
    with pytest.raises(ValueError):
        tree_parent(0, "peer-0", "peer-1", MEMBERS, fanout=0)


def test_stated_uplinks_put_the_slow_links_at_the_leaves_and_the_fast_ones_share_the_forwarding():
    """Two 10 Mbps members among six at 100 and 120 Mbps (one class): the slow ones forward
    nothing but their own packet's first copy, the fast ones share the rest, and every tree is
    still a tree of fan-out 2 rooted at its publisher (a slow publisher's one copy adds a hop)."""
    uplinks = {m: 10.0 if m in ("peer-1", "peer-6") else 100.0 + 20 * (i % 2) for i, m in enumerate(MEMBERS)}
    for round in range(4):
        trees = {p: {m: tree_parent(round, p, m, MEMBERS, 2, uplinks) for m in MEMBERS if m != p} for p in MEMBERS}
        for publisher, tree in trees.items():
            assert max(Counter(tree.values()).values()) <= 2
            assert all(tree[slow] != slow for slow in ("peer-1", "peer-6") if slow in tree)
            for member in tree:
                hops, node = 0, member
                while node != publisher:
                    node, hops = tree[node], hops + 1
                    assert hops <= (4 if uplinks[publisher] == 10.0 else 3)
            forwarders = set(tree.values()) - {publisher}
            assert not forwarders & {"peer-1", "peer-6"}
            if uplinks[publisher] == 10.0:  # a slow publisher sends one copy, to a fast member
                [(first, _)] = [(m, p) for m, p in tree.items() if p == publisher]
                assert uplinks[first] > 10.0
        sent = Counter(p for publisher, tree in trees.items() for p in tree.values() if p != publisher)
        fast_sent = [sent[m] for m in MEMBERS if uplinks[m] > 10]
        # Even over the fast publishers' trees; a slow publisher's tree adds up to 2 x fan-out to
        # the fast members that follow it on the ring.
        assert max(fast_sent) - min(fast_sent) <= 4 and sum(fast_sent) == sum(sent.values())
    # Unstated uplinks count as fast; with none stated, the trees are the plain ones.
    assert parents(2, "peer-0", MEMBERS, 2) == {m: tree_parent(2, "peer-0", m, MEMBERS, 2, {}) for m in MEMBERS[1:]}
    partly = {"peer-1": 10.0}
    assert all(
        tree_parent(r, p, m, MEMBERS, 2, partly) != "peer-1"
        for r in range(3)
        for p in MEMBERS
        if p != "peer-1"
        for m in MEMBERS
        if m != p
    )


def test_members_nobody_can_dial_are_leaves_and_push_their_packet_to_the_first_reachable_one():
    """Two members behind NAT among eight: in every tree they forward nothing; a NAT'd publisher
    sends one copy, to the first member of `push_targets`, which roots the rest of its tree; and
    `push_targets` names reachable members only, that one first."""
    behind = {"peer-2", "peer-5"}
    reachable = {m: m not in behind for m in MEMBERS}
    for round in range(4):
        for publisher in MEMBERS:
            tree = {m: tree_parent(round, publisher, m, MEMBERS, 2, None, reachable) for m in MEMBERS if m != publisher}
            assert not (set(tree.values()) - {publisher}) & behind, "nobody asks a NAT'd member for a copy"
            targets = push_targets(round, publisher, MEMBERS, None, reachable)
            assert not set(targets) & behind and len(targets) == 6 - (publisher not in behind)
            if publisher in behind:
                assert [m for m, p in tree.items() if p == publisher] == [targets[0]], "one copy, pushed"
                for member in tree:  # every other member's path leads through that one
                    node = member
                    while tree[node] != publisher:
                        node = tree[node]
                    assert node == targets[0]
    # Unknown reachability (None) counts as reachable: the trees are the plain ones.
    unknown = {m: None for m in MEMBERS}
    assert parents(1, "peer-0", MEMBERS, 2) == {
        m: tree_parent(1, "peer-0", m, MEMBERS, 2, None, unknown) for m in MEMBERS[1:]
    }


def _depth(tree: dict[str, str], member: str, publisher: str) -> int:
    hops = 0
    while member != publisher:
        member, hops = tree[member], hops + 1
        assert hops <= len(tree)
    return hops


def test_only_the_fastest_reachable_forward_and_slow_leaves_go_where_the_load_is_least():
    """The lab's mix: four members on 10 Mbps (one behind NAT), four on 100 (two behind NAT). In
    every tree no slow member and no NAT'd one forwards; the fast NAT'd leaves hang on the two
    fast reachable members, never on a slow one; and those two share the leaves, so neither
    carries more than its fan-out's worth (2 x 100 Mbps) of children."""
    slow, behind = {"peer-0", "peer-2", "peer-4", "peer-6"}, {"peer-5", "peer-6", "peer-7"}
    uplinks = {m: 10.0 if m in slow else 100.0 for m in MEMBERS}
    reachable = {m: m not in behind for m in MEMBERS}
    fast_reachable = set(MEMBERS) - slow - behind
    for round in range(6):
        for publisher in MEMBERS:
            tree = {
                m: tree_parent(round, publisher, m, MEMBERS, 2, uplinks, reachable) for m in MEMBERS if m != publisher
            }
            forwarders = set(tree.values()) - {publisher}
            assert forwarders <= fast_reachable
            for parent in forwarders:
                assert sum(uplinks[c] for c, p in tree.items() if p == parent) <= 2 * 100.0
            if publisher in slow or publisher in behind:  # one copy, to a fast reachable member
                assert [m for m, p in tree.items() if p == publisher] == [
                    push_targets(round, publisher, MEMBERS, uplinks, reachable)[0]
                ]
            assert all(_depth(tree, m, publisher) <= 3 for m in tree)


def test_where_the_fastest_are_too_few_the_next_forward_too():
    """One member on 100 Mbps among forty on 10: in a slow publisher's tree it takes slow leaves
    up to its fan-out's worth of its uplink (20 of them), then slow members forward as well, each
    to at most its fan-out; in its own tree the slow ones make the heap below it."""
    members = ["fast", *(f"slow-{i}" for i in range(40))]
    uplinks = {m: 100.0 if m == "fast" else 10.0 for m in members}
    for publisher in ("fast", "slow-3", "slow-17"):
        tree = {m: tree_parent(0, publisher, m, members, 2, uplinks) for m in members if m != publisher}
        children = Counter(tree.values())
        if publisher != "fast":
            assert children[publisher] == 1 and tree["fast"] == publisher
            assert 19 <= children["fast"] <= 21
        assert max(n for m, n in children.items() if m != "fast") <= 3
        assert all(_depth(tree, m, publisher) <= 8 for m in tree)
