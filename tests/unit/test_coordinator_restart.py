"""A coordinator restarted on its database after an outage, with a fake clock: the restart grace
(coordinator/rules/rounds.py, "Restart grace"). Nobody is marked gone for silence, and no open round closes,
until the heartbeat timeout has passed again since the restart; then only the silent are gone."""

from __future__ import annotations

import pytest

from tests.fixtures.coordinator import SignedPeer, coordinator_on, create_run
from tests.unit.test_coordinator_rounds import tick

pytestmark = pytest.mark.timeout(30)

TIMEOUT_S = 20.0  # membership.heartbeat_timeout_s; the rounds' fixed timeout is 30 s


def peers_for(client, clock, run_id, count):
    peers = [SignedPeer(client, clock=clock) for _ in range(count)]
    for peer in peers:
        assert peer.join(run_id).status_code == 200
    return peers


def round_of(client, run_id, round_index):
    response = client.get(f"/v1/runs/{run_id}/rounds/{round_index}")
    assert response.status_code == 200, response.text
    return response.json()


def statuses(client, run_id) -> dict[str, str]:
    peers = client.get(f"/v1/runs/{run_id}/status").json()["peers"]
    return {p["peer_id"]: p["status"] for p in peers}


def test_restart_after_ten_timeouts_keeps_peers_live_until_the_timeout_passes_again(tmp_path, fake_clock):
    db_path = tmp_path / "coordinator.db"
    with coordinator_on(db_path, fake_clock) as (client, _):
        run_id = create_run(client, {"membership.min_peers": 3, "membership.heartbeat_timeout_s": TIMEOUT_S})
        a, b, c = peers_for(client, fake_clock, run_id, 3)
        for peer in (a, b, c):
            assert peer.submit(run_id, 0).status_code == 200
        assert a.submit(run_id, 1).status_code == 200
        before = round_of(client, run_id, 1)
        manifest_0 = round_of(client, run_id, 0)["manifest"]
    fake_clock.advance(10 * TIMEOUT_S)  # round 1's deadline passes while no coordinator runs
    restarted_at = fake_clock()
    with coordinator_on(db_path, fake_clock) as (client, storage):
        for peer in (a, b, c):
            peer.client = client
        # Applied at start, before any request: the stored deadline is already the extended one.
        assert storage.get_round(run_id, 1).deadline == restarted_at + TIMEOUT_S
        assert statuses(client, run_id) == {a.peer_id: "live", b.peer_id: "live", c.peer_id: "live"}
        after = round_of(client, run_id, 1)
        assert (after["state"], after["opened_at"], after["num_submitted"]) == ("open", before["opened_at"], 1)
        assert after["deadline"] == restarted_at + TIMEOUT_S > before["deadline"]
        assert round_of(client, run_id, 0)["manifest"] == manifest_0

        fake_clock.advance(TIMEOUT_S - 1.0)  # just inside the grace
        tick(client)
        assert statuses(client, run_id) == {a.peer_id: "live", b.peer_id: "live", c.peer_id: "live"}
        assert a.heartbeat(run_id, 1).status_code == 200
        assert b.submit(run_id, 1).status_code == 200, "not late: the round got the grace"
        assert round_of(client, run_id, 1)["state"] == "open", "c is still expected"

        fake_clock.advance(1.5)  # past the grace: the timeout has passed since the restart
        tick(client)
        peers = {p["peer_id"]: p for p in client.get(f"/v1/runs/{run_id}/status").json()["peers"]}
        assert {p: v["status"] for p, v in peers.items()} == {a.peer_id: "live", b.peer_id: "live", c.peer_id: "gone"}
        assert peers[c.peer_id]["reason"] == "no heartbeat for 20 s since the coordinator resumed (timeout 20 s)"
        closed = round_of(client, run_id, 1)
        assert closed["state"] == "closed" and closed["closed_at"] == fake_clock()
        assert [e["peer_id"] for e in closed["manifest"]] == sorted([a.peer_id, b.peer_id])
        # A round opened after the restart has its own full timeout.
        assert round_of(client, run_id, 2)["deadline"] == fake_clock() + 30.0
        assert c.submit(run_id, 2).json()["error"] == "peer_gone"


def test_a_quick_restart_keeps_deadlines_that_leave_the_grace(tmp_path, fake_clock):
    """A round with more than the heartbeat timeout left keeps its deadline; the grace only ever
    moves a deadline later."""
    db_path = tmp_path / "coordinator.db"
    with coordinator_on(db_path, fake_clock) as (client, _):
        run_id = create_run(client, {"membership.min_peers": 2, "membership.heartbeat_timeout_s": TIMEOUT_S})
        a, b = peers_for(client, fake_clock, run_id, 2)
        before = round_of(client, run_id, 0)
    fake_clock.advance(5.0)  # 25 s of round 0 left, more than the 20 s grace
    with coordinator_on(db_path, fake_clock) as (client, _):
        a.client = b.client = client
        assert round_of(client, run_id, 0)["deadline"] == before["deadline"]
        assert a.submit(run_id, 0).status_code == 200 and b.submit(run_id, 0).status_code == 200
        assert round_of(client, run_id, 0)["state"] == "closed"
        assert round_of(client, run_id, 1)["deadline"] == fake_clock() + 30.0


def test_a_run_waiting_for_peers_keeps_them_through_a_long_outage(tmp_path, fake_clock):
    db_path = tmp_path / "coordinator.db"
    with coordinator_on(db_path, fake_clock) as (client, _):
        run_id = create_run(client, {"membership.min_peers": 3, "membership.heartbeat_timeout_s": TIMEOUT_S})
        a, b = peers_for(client, fake_clock, run_id, 2)
    fake_clock.advance(10 * TIMEOUT_S)
    with coordinator_on(db_path, fake_clock) as (client, _):
        assert round_of(client, run_id, 0)["state"] == "pending"
        (c,) = peers_for(client, fake_clock, run_id, 1)
        assert statuses(client, run_id) == {a.peer_id: "live", b.peer_id: "live", c.peer_id: "live"}
        assert round_of(client, run_id, 0)["state"] == "open", "the two from before the outage count"


def test_a_returning_peer_holding_the_open_rounds_start_is_expected_at_once(tmp_path, fake_clock):
    """Peers gone past the heartbeat timeout rejoin while round 1 is open. One states the agreed
    start of round 1 (its checkpoint): it is expected in round 1, so the round closes as soon as it
    and the others submit. One states a digest the swarm does not agree with: expected from round 2
    on, as a newcomer."""
    with coordinator_on(tmp_path / "coordinator.db", fake_clock) as (client, _):
        run_id = create_run(client, {"membership.min_peers": 2, "membership.heartbeat_timeout_s": TIMEOUT_S})
        a, b = peers_for(client, fake_clock, run_id, 2)
        for peer in (a, b):
            assert peer.submit(run_id, 0).status_code == 200
        agreed = "ab" * 32
        for peer in (a, b):
            assert peer.applied(run_id, 0, agreed).status_code == 200
        fake_clock.advance(TIMEOUT_S + 1.0)
        tick(client)
        assert statuses(client, run_id) == {a.peer_id: "gone", b.peer_id: "gone"}
        assert a.join(run_id, state_round=1, state_digest=agreed).status_code == 200
        assert b.join(run_id, state_round=1, state_digest="cd" * 32).status_code == 200
        assert round_of(client, run_id, 1)["state"] == "open"
        assert a.submit(run_id, 1).status_code == 200
        assert round_of(client, run_id, 1)["state"] == "closed", "a was expected, b not yet"
        status = client.get(f"/v1/runs/{run_id}/status").json()
        assert status["current_round"]["round"] == 2 and status["current_round"]["num_expected"] == 2
