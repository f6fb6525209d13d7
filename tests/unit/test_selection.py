"""Bounded rounds' rule (protocol/selection.py): deterministic, the identity when unbounded, round
robin among proven members, a Sybil flood confined to the newcomer places, and an early close that
never changes the pick."""

from __future__ import annotations

import math
import random

import pytest

from protocol.selection import Candidate, newcomer_floor, round_seed, select, settled

SEED = round_seed("run", 5, "ab" * 32)


def members(count: int, proven: bool = True, waited: int = 0, prefix: str = "p") -> list[Candidate]:
    return [Candidate(f"{prefix}{i:03d}", proven, waited) for i in range(count)]


class Swarm:
    """Rounds of the rule as the coordinator keeps its facts: a pick resets waiting; a key whose
    packets earn credit is proven once picked, a `junk` key never is."""

    def __init__(self, honest: int, junk: int = 0):
        self.ids = [f"h{i:03d}" for i in range(honest)] + [f"s{i:03d}" for i in range(junk)]
        self.junk = {p for p in self.ids if p.startswith("s")}
        self.last: dict[str, int | None] = {p: None for p in self.ids}
        self.gaps: dict[str, list[int]] = {p: [] for p in self.ids}

    def candidates(self, r: int) -> list[Candidate]:
        return [Candidate(p, self.last[p] is not None and p not in self.junk, self.waited(p, r)) for p in self.ids]

    def waited(self, peer_id: str, r: int) -> int:
        last = self.last[peer_id]
        return r if last is None else r - 1 - last  # every key is a member from round 0

    def round(self, r: int, max_contributors: int, submitted=None) -> tuple[str, ...]:
        picked = select(self.candidates(r), submitted or self.ids, max_contributors, round_seed("run", r, None)).picked
        for p in picked:
            self.gaps[p].append(self.waited(p, r))
            self.last[p] = r
        return picked


def test_the_pick_is_deterministic_and_the_seed_only_breaks_ties():
    candidates = members(30, waited=1) + members(10, waited=3, prefix="w")
    submitted = [c.peer_id for c in candidates]
    first = select(candidates, submitted, 12, SEED)
    assert first == select(list(reversed(candidates)), list(reversed(submitted)), 12, SEED)
    assert set(first.picked[:10]) == {c.peer_id for c in candidates[30:]}  # the longest waiting first
    other = select(candidates, submitted, 12, round_seed("run", 6, "ab" * 32))
    assert set(other.picked[:10]) == set(first.picked[:10]) and other.picked[10:] != first.picked[10:]


@pytest.mark.parametrize("bound", [0, 40, 41, 1000])
def test_unbounded_or_enough_places_pick_every_submission(bound):
    candidates = members(25) + members(15, proven=False, prefix="n")
    submitted = [c.peer_id for c in candidates if c.peer_id != "p003"]
    chosen = select(candidates, submitted, bound, SEED)
    assert sorted(chosen.picked) == sorted(submitted)
    assert not chosen.ranks["p003"].picked and chosen.ranks["p003"].reason().startswith("not picked")


def test_never_more_than_m_and_never_a_peer_that_did_not_submit():
    rng = random.Random(0)
    for _ in range(200):
        candidates = [Candidate(f"p{i}", rng.random() < 0.6, rng.randrange(6)) for i in range(rng.randrange(1, 50))]
        submitted = [c.peer_id for c in candidates if rng.random() < 0.7]
        bound = rng.randrange(0, 20)
        picked = select(candidates, submitted, bound, SEED).picked
        assert set(picked) <= set(submitted) and len(set(picked)) == len(picked)
        assert len(picked) == (len(submitted) if bound == 0 else min(bound, len(submitted)))


@pytest.mark.parametrize("num_peers,bound", [(64, 8), (64, 16), (20, 6), (33, 32)])
def test_every_member_gets_in_within_ceil_n_over_m_rounds_once_all_are_proven(num_peers, bound):
    swarm = Swarm(num_peers)
    onboarding = math.ceil(num_peers / newcomer_floor(bound)) + 1
    for r in range(onboarding + 4 * math.ceil(num_peers / bound)):
        swarm.round(r, bound)
    assert all(swarm.last[p] is not None for p in swarm.ids), "every newcomer got in"
    settled_gaps = [g for p in swarm.ids for g in swarm.gaps[p][1:]]  # after each one's first pick
    assert max(settled_gaps) <= math.ceil(num_peers / bound)  # round robin: ceil(N/M) - 1, and 1 of slack


def test_a_sybil_flood_of_fresh_keys_does_not_displace_proven_members():
    honest, bound = 12, 8
    swarm = Swarm(honest)
    for r in range(12):  # the honest swarm runs for a while: all proven
        swarm.round(r, bound)
    flooded = Swarm(honest, junk=10 * honest)
    flooded.last = dict(swarm.last) | {p: None for p in flooded.junk}
    per_round_proven = []
    for r in range(12, 40):
        picked = flooded.round(r, bound)
        per_round_proven.append(sum(p not in flooded.junk for p in picked))
        assert sum(p in flooded.junk for p in picked) <= newcomer_floor(bound)
    assert min(per_round_proven) >= bound - newcomer_floor(bound)
    gaps = [g for p in flooded.ids if p not in flooded.junk for g in flooded.gaps[p]]
    assert max(gaps) <= math.ceil(honest / (bound - newcomer_floor(bound)))  # the rotation holds


def test_newcomers_queue_ahead_of_a_later_flood():
    """Honest newcomers that have waited longer take the newcomer places before fresh keys do."""
    proven = members(20)
    newcomers = members(4, proven=False, waited=3, prefix="n")
    flood = members(100, proven=False, waited=0, prefix="s")
    everyone = proven + newcomers + flood
    picked = select(everyone, [c.peer_id for c in everyone], 16, SEED).picked
    assert {c.peer_id for c in newcomers} <= set(picked)
    assert not any(p.startswith("s") for p in picked)


def test_early_close_only_when_nobody_waited_for_could_change_the_pick():
    candidates = [Candidate(f"p{i}", True, waited) for i, waited in enumerate([5, 4, 3, 0, 0, 0])]
    ids = [c.peer_id for c in candidates]
    assert not settled(candidates, [], ids, 2, SEED)
    assert not settled(candidates, ["p0", "p2"], ["p1", "p3", "p4", "p5"], 2, SEED)  # p1 outranks p2
    assert settled(candidates, ["p0", "p1"], ["p2", "p3", "p4", "p5"], 2, SEED)
    rng = random.Random(1)
    for _ in range(300):  # settled: no later submission of a waited-for peer changes the pick
        pool = [Candidate(f"q{i}", rng.random() < 0.7, rng.randrange(4)) for i in range(rng.randrange(2, 16))]
        order = [c.peer_id for c in pool]
        rng.shuffle(order)
        cut = rng.randrange(1, len(order) + 1)
        submitted, waiting = order[:cut], order[cut:]
        bound = rng.randrange(1, 8)
        if settled(pool, submitted, waiting, bound, SEED):
            now = set(select(pool, submitted, bound, SEED).picked)
            later = set(select(pool, order, bound, SEED).picked)
            assert now == later, (submitted, waiting, bound)
