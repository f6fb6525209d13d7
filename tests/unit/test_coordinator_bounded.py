"""Bounded rounds on the coordinator (outer.max_contributors, coordinator/rules/picks.py), in process
on a real SQLite file with a fake clock: manifests of at most M, submissions left out but accepted
and shown with why, an early close once the pick is settled, and a pick any peer can recompute from
the round view."""

from __future__ import annotations

import pytest

from coordinator.terminal import render_status
from protocol.http import RoundView
from protocol.selection import Candidate, round_seed, select, tie_break
from tests.fixtures.coordinator import SignedPeer, create_run, error_of

pytestmark = pytest.mark.timeout(30)


def join(client, clock, run_id, count) -> list[SignedPeer]:
    peers = [SignedPeer(client, clock=clock) for _ in range(count)]
    for peer in peers:
        assert peer.join(run_id).status_code == 200
    return peers


def view(client, run_id, round_index) -> RoundView:
    response = client.get(f"/v1/runs/{run_id}/rounds/{round_index}")
    assert response.status_code == 200, response.text
    return RoundView.model_validate(response.json())


def recomputed(client, run_id: str, closed: RoundView, max_contributors: int) -> set[str]:
    """The pick as a peer checks it: the rule over the view's submissions and their inputs, seeded
    by the agreed digest of the round the view names."""
    agreed = None if closed.seed_round is None else view(client, run_id, closed.seed_round).agreed_digest
    seed = round_seed(run_id, closed.round, agreed)
    candidates = [Candidate(p, pick.proven, pick.waited_rounds) for p, pick in closed.picks.items()]
    return set(select(candidates, list(closed.picks), max_contributors, seed).picked)


def test_a_bounded_round_closes_once_its_pick_is_settled_and_keeps_at_most_m(coordinator_client, fake_clock):
    client = coordinator_client
    run_id = create_run(client, {"membership.min_peers": 6, "outer.max_contributors": 4})
    peers = join(client, fake_clock, run_id, 6)
    seed = round_seed(run_id, 0, None)
    # Round 0: everyone a newcomer that waited 0 rounds; the seeded hash orders them.
    order = sorted(peers, key=lambda p: tie_break(seed, p.peer_id))
    for peer in order[:3]:
        assert peer.submit(run_id, 0).status_code == 200
    assert view(client, run_id, 0).state == "open"  # the 4th pick has not submitted: it could still
    assert order[3].submit(run_id, 0).status_code == 200
    closed = view(client, run_id, 0)
    assert closed.state == "closed" and closed.closed_at < closed.deadline  # closed early, before the others
    assert {e.peer_id for e in closed.manifest} == {p.peer_id for p in order[:4]}
    assert error_of(order[4].submit(run_id, 0)) == "stale_round"

    # Round 1: four proven members that waited 0 rounds, two newcomers that waited 1 (nothing is
    # agreed yet, so the seed is the run's and the round's). The last of the proven tier and both
    # newcomers submit first: the round stays open until the first three proven are in.
    proven_order = sorted(order[:4], key=lambda p: tie_break(round_seed(run_id, 1, None), p.peer_id))
    for peer in order[4:] + proven_order[3:] + proven_order[:3]:
        assert view(client, run_id, 1).state == "open"
        assert peer.submit(run_id, 1).status_code == 200, "a submission is accepted, picked or not"
    closed = view(client, run_id, 1)
    assert closed.state == "closed" and len(closed.manifest) == 4 and len(closed.picks) == 6
    left_out = {p for p, pick in closed.picks.items() if not pick.picked}
    assert len(left_out) == 2 and not left_out & {e.peer_id for e in closed.manifest}
    proven = {p: pick for p, pick in closed.picks.items() if pick.proven}
    newcomers = {p: pick for p, pick in closed.picks.items() if not pick.proven}
    assert set(proven) == {p.peer_id for p in order[:4]} and all(p.waited_rounds == 0 for p in proven.values())
    assert not proven[proven_order[3].peer_id].picked and proven[proven_order[3].peer_id].rank == 4
    assert all(p.waited_rounds == 1 for p in newcomers.values())
    # M // 4 = 1 newcomer place: three proven members and one newcomer.
    assert sum(pick.picked for pick in proven.values()) == 3 and sum(pick.picked for pick in newcomers.values()) == 1
    for pick in closed.picks.values():
        tier = "proven" if pick.proven else "newcomer"
        assert pick.reason.startswith(("picked: " if pick.picked else "not picked: ") + f"{tier} rank {pick.rank} of")
    assert {e.peer_id for e in closed.manifest} == recomputed(client, run_id, closed, 4)
    history = {h["round"]: h for h in client.get(f"/v1/runs/{run_id}/status").json()["history"]}
    assert history[1]["num_picked"] == 4 and history[1]["num_contributors"] == 6
    assert history[1]["not_picked"] == {p: pick.reason for p, pick in closed.picks.items() if not pick.picked}
    assert "picked" in client.get(f"/?run={run_id}").text
    assert "4 of 6 picked" in render_status(client.get(f"/v1/runs/{run_id}/status").json())


def test_bounded_rounds_rotate_the_members_through_the_manifest(coordinator_client, fake_clock):
    """Six peers, M = 4: after two rounds of newcomers getting in (one place a round), every
    member is in at least one of any two rounds in a row, and every manifest is the rule's."""
    client = coordinator_client
    run_id = create_run(client, {"membership.min_peers": 6, "outer.max_contributors": 4})
    peers = join(client, fake_clock, run_id, 6)
    manifests = []
    for r in range(8):
        accepted = 0
        for peer in peers:  # once the pick is settled the round closes: the rest come too late
            was_open = view(client, run_id, r).state == "open"
            response = peer.submit(run_id, r)
            assert response.status_code == 200 if was_open else error_of(response) == "stale_round"
            accepted += was_open
        closed = view(client, run_id, r)
        assert closed.state == "closed" and len(closed.picks) == accepted  # whoever came late is not in it
        manifests.append({e.peer_id for e in closed.manifest})
        assert len(manifests[-1]) == 4 and manifests[-1] == recomputed(client, run_id, closed, 4)
    assert set().union(*manifests[:3]) == {p.peer_id for p in peers}, "every newcomer got in by round 2"
    for r in range(3, 8):
        assert manifests[r - 1] | manifests[r] == {p.peer_id for p in peers}, r
    status = client.get(f"/v1/runs/{run_id}/status").json()
    assert all(p["standing"] == "contributor" for p in status["peers"])


def test_an_unbounded_run_has_no_picks(coordinator_client, fake_clock):
    client = coordinator_client
    run_id = create_run(client, {"membership.min_peers": 3})
    peers = join(client, fake_clock, run_id, 3)
    for peer in peers:
        assert peer.submit(run_id, 0).status_code == 200
    closed = view(client, run_id, 0)
    assert closed.state == "closed" and len(closed.manifest) == 3
    assert closed.picks == {} and closed.seed_round is None
    [summary] = client.get(f"/v1/runs/{run_id}/status").json()["history"]
    assert summary["num_picked"] is None and summary["not_picked"] == {}


def test_a_proven_member_whose_turn_it_is_holds_the_early_close(coordinator_client, fake_clock):
    """With max_missed_rounds 1 the round waits only for last round's picks; the proven members left
    out last round are first in line now, and the round must not close on the others' packets
    before theirs are in (their turn, not a miss). Each round the left-out ones submit last."""
    client = coordinator_client
    run_id = create_run(
        client, {"membership.min_peers": 4, "membership.max_missed_rounds": 1, "outer.max_contributors": 4}
    )
    peers = join(client, fake_clock, run_id, 6)
    manifests: list[set[str]] = []
    for r in range(8):
        last = manifests[-1] if manifests else set()
        ever = set().union(*manifests)
        # Newcomers first (a newcomer slower than the contributors is not waited for, picked or
        # not: "Newcomers in step" covers that), then last round's picks, then the proven left out.
        for peer in sorted(peers, key=lambda p: (p.peer_id in ever, p.peer_id not in last)):
            response = peer.submit(run_id, r)
            assert response.status_code == 200 or error_of(response) == "stale_round"
        manifests.append({e.peer_id for e in view(client, run_id, r).manifest})
    everyone = {p.peer_id for p in peers}
    assert set().union(*manifests[:4]) == everyone, "every newcomer got in"
    for r in range(5, 8):
        assert manifests[r - 1] | manifests[r] == everyone, (r, manifests)
