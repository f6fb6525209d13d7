"""Whole-swarm restart (coordinator/recovery.py), with a fake clock: a run that lost every peer is
paused instead of closing empty rounds; it resumes at once when a returning peer holds the open
round's agreed start, goes back to the newest agreed state held after `state_wait_s`, and never
to an older one or to nothing while an agreed state could still come back."""

from __future__ import annotations

import pytest

from tests.fixtures.coordinator import SignedPeer, coordinator_on, create_run, error_of
from tests.unit.test_coordinator_rounds import tick

pytestmark = pytest.mark.timeout(30)

TIMEOUT_S = 10.0  # heartbeat timeout; rounds time out after 30 s
WAIT_S = 60.0  # membership.state_wait_s


def digest(n: int) -> str:
    return f"{n:064x}"


def status(client, run_id) -> dict:
    response = client.get(f"/v1/runs/{run_id}/status")
    assert response.status_code == 200, response.text
    return response.json()


def play_rounds(client, run_id, peers, rounds) -> None:
    """Every peer submits and reports the same digest (the start of round r + 1 is digest(r + 1))."""
    for r in rounds:
        for peer in peers:
            assert peer.submit(run_id, r).status_code == 200
        for peer in peers:
            assert peer.applied(run_id, r, digest(r + 1)).status_code == 200


def beat_to_the_deadline(client, fake_clock, run_id, peers, round_index) -> None:
    """`peers` heartbeat every 5 s, the coordinator ticking, for as long as a reopened round's
    deadline gives (its 30 s and a heartbeat time-out)."""
    for _ in range(int((30.0 + TIMEOUT_S) / 5)):
        fake_clock.advance(5)
        for peer in peers:
            assert peer.heartbeat(run_id, round_index).status_code == 200
        tick(client)


def three_peers(client, fake_clock) -> tuple[str, list[SignedPeer]]:
    """A run of at most 8 rounds and the three peers that joined it (round 0 open)."""
    run_id = create_run(
        client,
        {
            "membership.min_peers": 3,
            "membership.heartbeat_timeout_s": TIMEOUT_S,
            "membership.state_wait_s": WAIT_S,
            "max_rounds": 8,
        },
    )
    peers = [SignedPeer(client, clock=fake_clock) for _ in range(3)]
    for peer in peers:
        assert peer.join(run_id).status_code == 200
    return run_id, peers


@pytest.fixture
def swarm(tmp_path, fake_clock):
    """A run with three peers that agreed rounds 0-3 (round 4 open), then all went silent."""
    with coordinator_on(tmp_path / "coordinator.db", fake_clock) as (client, storage):
        run_id, peers = three_peers(client, fake_clock)
        play_rounds(client, run_id, peers, range(4))
        assert status(client, run_id)["current_round"]["round"] == 4
        yield client, storage, run_id, peers


def test_a_run_without_peers_pauses_instead_of_closing_empty_rounds(swarm, fake_clock):
    client, _, run_id, peers = swarm
    fake_clock.advance(TIMEOUT_S + 1)
    tick(client)
    paused_at = fake_clock()
    body = status(client, run_id)
    assert {p["status"] for p in body["peers"]} == {"gone"}
    assert body["recovery"]["paused_since"] == paused_at and body["recovery"]["round"] == 4
    assert body["recovery"]["needed_digest"] == digest(4)
    assert sorted(body["recovery"]["last_holders"]) == sorted(p.peer_id for p in peers)
    fake_clock.advance(3600)  # far past the round's 30 s deadline
    tick(client)
    body = status(client, run_id)
    assert body["run"]["state"] == "running" and body["current_round"]["round"] == 4
    assert [h["round"] for h in body["history"]] == [0, 1, 2, 3], "no empty round was closed"
    assert "every peer has stopped" in body["recovery"]["message"]


def test_a_peer_holding_the_open_rounds_start_resumes_the_run_at_once(swarm, fake_clock):
    client, _, run_id, peers = swarm
    fake_clock.advance(TIMEOUT_S + 3600)
    tick(client)  # paused
    status(client, run_id)
    assert peers[0].join(run_id, state_round=4, state_digest=digest(4)).status_code == 200
    body = status(client, run_id)
    assert body["recovery"] is None and body["rewinds"] == []
    current = body["current_round"]
    assert current["round"] == 4 and current["opened_at"] == fake_clock()
    # A fresh deadline: the round's 30 s and a heartbeat time-out for the returning peer to load its state.
    assert current["deadline"] == fake_clock() + 30.0 + TIMEOUT_S and current["num_expected"] == 1
    # A second returner without the state is expected from round 5 and catches up first.
    assert peers[1].join(run_id).status_code == 200
    assert status(client, run_id)["current_round"]["num_expected"] == 1
    assert peers[0].submit(run_id, 4).status_code == 200
    # Its only expected peer is in, but a peer of round 3 has not come back: it regroups.
    assert status(client, run_id)["current_round"]["round"] == 4
    beat_to_the_deadline(client, fake_clock, run_id, peers[:2], 4)
    assert status(client, run_id)["current_round"]["round"] == 5, "closed at its deadline"


def test_a_resumed_round_waits_for_the_last_rounds_peers_to_come_back(swarm, fake_clock):
    """The peers of a stopped swarm come back one by one: the first one back does not close the
    reopened round alone while the others load (coordinator/recovery.py, "Regrouping")."""
    client, _, run_id, peers = swarm
    fake_clock.advance(TIMEOUT_S + 3600)
    tick(client)
    for i, peer in enumerate(peers):
        assert peer.join(run_id, state_round=4, state_digest=digest(4)).status_code == 200
        assert peer.submit(run_id, 4).status_code == 200
        fake_clock.advance(5)
        for returned in peers[: i + 1]:
            assert returned.heartbeat(run_id, 4).status_code == 200
        tick(client)
        expected_round = 5 if i == len(peers) - 1 else 4
        assert status(client, run_id)["current_round"]["round"] == expected_round, f"after {i + 1} submitted"
    # Rounds a close opened close on their expected peers as ever.
    for peer in peers:
        response = peer.submit(run_id, 5)
        assert response.status_code == 200, response.text
    assert status(client, run_id)["current_round"]["round"] == 6


def test_the_run_waits_for_the_newest_state_then_goes_back_to_the_newest_held(swarm, fake_clock):
    client, storage, run_id, peers = swarm
    fake_clock.advance(TIMEOUT_S + 100)
    tick(client)
    status(client, run_id)
    # Two return: one holds round 2's start, one round 3's (agreed); none holds round 4's.
    assert peers[0].join(run_id, state_round=2, state_digest=digest(2)).status_code == 200
    returned_at = fake_clock()
    assert peers[1].join(run_id, state_round=3, state_digest=digest(3)).status_code == 200
    body = status(client, run_id)
    recovery = body["recovery"]
    assert recovery["waiting_since"] == returned_at and recovery["newest_held_round"] == 3
    assert recovery["rewind_at"] == returned_at + WAIT_S
    assert {h["peer_id"]: (h["state_round"], h["agreed"]) for h in recovery["held"]} == {
        peers[0].peer_id: (2, True),
        peers[1].peer_id: (3, True),
    }
    for _ in range(int(WAIT_S / 5) - 1):  # they keep beating while they wait
        fake_clock.advance(5)
        for peer in peers[:2]:
            assert peer.heartbeat(run_id, 4, state="catching_up").status_code == 200
    fake_clock.advance(4)
    tick(client)
    assert status(client, run_id)["current_round"]["round"] == 4, "still waiting for round 4's start"

    fake_clock.advance(1)
    tick(client)
    body = status(client, run_id)
    assert body["recovery"] is None
    # Expected: the holder, and the peer with round 2's agreed start (it replays round 2 first).
    assert body["current_round"]["round"] == 3 and body["current_round"]["num_expected"] == 2
    assert [h["round"] for h in body["history"]] == [0, 1, 2], "round 3's result is gone with its holders"
    [rewind] = body["rewinds"]
    assert (rewind["from_round"], rewind["to_round"], rewind["at"]) == (4, 3, fake_clock())
    assert peers[1].peer_id in rewind["reason"]
    # The run goes on from there: the holder trains round 3; the other replays round 2 and trains it too.
    assert peers[1].submit(run_id, 3).status_code == 200
    assert status(client, run_id)["current_round"]["round"] == 3, "waits for the peer replaying"
    assert peers[0].submit(run_id, 3).status_code == 200
    assert status(client, run_id)["current_round"]["round"] == 3, "regroups: round 2's third peer may come back"
    beat_to_the_deadline(client, fake_clock, run_id, peers[:2], 3)
    assert status(client, run_id)["current_round"]["round"] == 4
    # A peer coming back later with the old round 4 start holds nothing agreed any more.
    assert storage.get_round(run_id, 3).majority_digest is None


def test_a_state_nobody_agreed_is_not_trusted_and_nothing_agreed_is_dropped(swarm, fake_clock):
    client, _, run_id, peers = swarm
    fake_clock.advance(TIMEOUT_S + 100)
    tick(client)
    status(client, run_id)
    assert peers[0].join(run_id, state_round=4, state_digest=digest(99)).status_code == 200  # not agreed
    assert peers[1].join(run_id).status_code == 200  # a fresh disk
    for _ in range(int(3 * WAIT_S / 5)):
        fake_clock.advance(5)
        for peer in peers[:2]:
            assert peer.heartbeat(run_id, 4, state="catching_up").status_code == 200
    body = status(client, run_id)
    assert body["current_round"]["round"] == 4 and [h["round"] for h in body["history"]] == [0, 1, 2, 3]
    assert body["recovery"]["newest_held_round"] is None and body["recovery"]["rewind_at"] is None
    assert "no live peer holds an agreed round start" in body["recovery"]["message"]
    assert body["rewinds"] == []
    # The holder of round 4's start comes back: the run resumes, nothing lost.
    assert peers[2].join(run_id, state_round=4, state_digest=digest(4)).status_code == 200
    body = status(client, run_id)
    assert body["recovery"] is None and body["current_round"]["round"] == 4 and body["rewinds"] == []


def test_a_paused_run_survives_a_coordinator_restart(tmp_path, fake_clock):
    db_path = tmp_path / "coordinator.db"
    with coordinator_on(db_path, fake_clock) as (client, _):
        run_id = create_run(client, {"membership.min_peers": 2, "membership.heartbeat_timeout_s": TIMEOUT_S})
        peers = [SignedPeer(client, clock=fake_clock) for _ in range(2)]
        for peer in peers:
            assert peer.join(run_id).status_code == 200
        play_rounds(client, run_id, peers, range(2))
        fake_clock.advance(TIMEOUT_S + 1)
        tick(client)
        paused_since = status(client, run_id)["recovery"]["paused_since"]
    fake_clock.advance(7200)
    with coordinator_on(db_path, fake_clock) as (client, _):
        for peer in peers:
            peer.client = client
        body = status(client, run_id)
        assert body["recovery"]["paused_since"] == paused_since and body["current_round"]["round"] == 2
        assert error_of(peers[0].submit(run_id, 2)) == "peer_gone"
        assert peers[0].join(run_id, state_round=2, state_digest=digest(2)).status_code == 200
        assert status(client, run_id)["recovery"] is None
        assert peers[0].submit(run_id, 2).status_code == 200


def test_peers_back_with_an_older_checkpoint_resume_by_replaying_the_closed_round(swarm, fake_clock):
    """Every peer died while writing its checkpoint after applying round 3 (reported, agreed): each
    comes back holding round 3's start. Replaying round 3 (its packets kept on their authors' disks)
    and reporting the same digest again is what brings back round 4's start: the run resumes at
    round 4 at once, and never rewinds past the agreed round 3."""
    client, _, run_id, peers = swarm
    fake_clock.advance(TIMEOUT_S + 1)
    tick(client)
    assert status(client, run_id)["recovery"] is not None
    for peer in peers:
        assert peer.join(run_id, state_round=3, state_digest=digest(3)).status_code == 200
    body = status(client, run_id)
    assert body["recovery"]["newest_held_round"] == 3, "held: round 3's start, not the open round 4's"
    assert peers[0].applied(run_id, 3, digest(4)).status_code == 200  # the same report again: a retry
    tick(client)  # the coordinator's clock resumes the run: peers[0] holds round 4's start
    body = status(client, run_id)
    assert body["recovery"] is None and body["current_round"]["round"] == 4 and body["rewinds"] == []
    assert [h["agreed_digest"] for h in body["history"]] == [digest(r + 1) for r in range(4)]
    # The first to replay resumed the run; the others, a moment behind, are waited for all the same.
    assert body["current_round"]["num_expected"] == 3
    assert peers[0].submit(run_id, 4).status_code == 200
    assert status(client, run_id)["current_round"]["round"] == 4, "not closed on the first replayer's packet"
    for peer in peers[1:]:
        assert peer.applied(run_id, 3, digest(4)).status_code == 200
        assert peer.submit(run_id, 4).status_code == 200
    assert status(client, run_id)["history"][4]["num_contributors"] == 3
    fake_clock.advance(WAIT_S + 1)
    tick(client)
    assert status(client, run_id)["rewinds"] == []


def test_a_swarm_stopped_after_an_empty_first_round_resumes_at_once_from_the_seeded_start(tmp_path, fake_clock):
    """Every peer stopped in round 0 before any submitted (so it closed empty at its deadline, seen
    in chaos runs), came back, and stopped again in round 1. Round 1 starts from the seeded
    initialisation every peer makes, which no vote ever agrees on: the first peer back resumes round
    1 at once, instead of the run waiting `state_wait_s` and rewinding to round 0."""
    with coordinator_on(tmp_path / "coordinator.db", fake_clock) as (client, _):
        run_id = create_run(
            client,
            {
                "membership.min_peers": 2,
                "membership.heartbeat_timeout_s": 60.0,
                "membership.state_wait_s": WAIT_S,
                "max_rounds": 8,
            },
        )
        peers = [SignedPeer(client, clock=fake_clock) for _ in range(2)]
        for peer in peers:
            assert peer.join(run_id).status_code == 200
        fake_clock.advance(31)  # round 0's 30 s, nothing submitted: it closes empty
        tick(client)
        body = status(client, run_id)
        assert body["current_round"]["round"] == 1 and body["history"][0]["num_contributors"] == 0
        fake_clock.advance(61)
        tick(client)
        assert status(client, run_id)["recovery"] is not None, "every peer gone: paused"

        assert peers[0].join(run_id).status_code == 200
        body = status(client, run_id)
        assert body["recovery"] is None and body["rewinds"] == []
        assert body["current_round"]["round"] == 1 and body["current_round"]["opened_at"] == fake_clock()
        assert peers[0].submit(run_id, 1).status_code == 200


def test_votes_that_come_while_the_run_is_paused_are_final(tmp_path, fake_clock):
    """Every peer went silent right after round 3 closed, before any applied it: the pause settles
    round 3 with no vote. A peer that comes back, applies round 3 and reports it casts the round's
    only vote; counted as final (the run is paused), it is agreed, and that peer, holding round
    4's start, resumes the run at once. Counted unsettled it was never agreed, and the run waited
    for ever (a chaos run)."""
    with coordinator_on(tmp_path / "coordinator.db", fake_clock) as (client, _):
        run_id, peers = three_peers(client, fake_clock)
        play_rounds(client, run_id, peers, range(3))
        for peer in peers:
            assert peer.submit(run_id, 3).status_code == 200  # round 3 closes; nobody applies it
        fake_clock.advance(TIMEOUT_S + 1)
        tick(client)
        body = status(client, run_id)
        assert body["recovery"] is not None and body["history"][3]["agreed_digest"] is None

        assert peers[0].join(run_id).status_code == 200
        assert peers[0].applied(run_id, 3, digest(4)).status_code == 200
        body = status(client, run_id)
        assert body["history"][3]["agreed_digest"] == digest(4)
        assert peers[0].join(run_id, state_round=4, state_digest=digest(4)).status_code == 200
        body = status(client, run_id)
        assert body["recovery"] is None and body["current_round"]["round"] == 4 and body["rewinds"] == []
