"""Round lifecycle in-process with a fake clock: opening, early and deadline closes, refusals,
manifests, applied digests and majority flags, liveness, leaving and long-polls. A restarted
coordinator: tests/unit/test_coordinator_restart.py."""

from __future__ import annotations

import threading
import time

import pytest

from coordinator.storage import open_storage
from protocol.http import RoundView
from tests.fixtures.coordinator import (
    SignedPeer,
    create_run,
    error_of,
    packet_digest,
)

pytestmark = pytest.mark.timeout(30)


def peers_for(client, clock, run_id, count):
    peers = [SignedPeer(client, clock=clock) for _ in range(count)]
    for peer in peers:
        assert peer.join(run_id).status_code == 200
    return peers


def round_of(client, run_id, round_index, wait_s=0.0):
    response = client.get(f"/v1/runs/{run_id}/rounds/{round_index}?wait_s={wait_s}")
    assert response.status_code == 200, response.text
    return response.json()


def tick(client) -> None:
    """The coordinator's own clock, once: deadlines and time-outs at the fake clock's time (these
    apps run no background tick, and reads never apply the rules)."""
    client.app.state.service.tick()


def start_parked(client, long_poll) -> threading.Thread:
    """Run `long_poll` in a thread and return once its request is parked on the run's event."""
    waiter = threading.Thread(target=long_poll)
    waiter.start()
    events = client.app.state.events
    deadline = time.monotonic() + 10
    while events.num_waiting == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert events.num_waiting == 1, "the long-poll should be parked on the run's event"
    return waiter


def test_round_zero_waits_for_min_peers_then_closes_early(coordinator_client, fake_clock):
    client = coordinator_client
    run_id = create_run(client, {"membership.min_peers": 3})
    peers = peers_for(client, fake_clock, run_id, 2)
    assert round_of(client, run_id, 0)["state"] == "pending"
    assert error_of(peers[0].submit(run_id, 0)) == "round_not_open"
    peers += peers_for(client, fake_clock, run_id, 1)
    opened = round_of(client, run_id, 0)
    assert opened["state"] == "open" and opened["deadline"] == fake_clock() + 30.0
    fake_clock.advance(2.0)
    for peer in reversed(peers):
        response = peer.submit(run_id, 0, train_loss=2.0 + peer.peer_id.count("a"))
        assert response.status_code == 200, response.text
    closed = round_of(client, run_id, 0)
    assert closed["state"] == "closed" and closed["closed_at"] == fake_clock()
    assert len(RoundView.model_validate(closed).manifest) == 3
    assert [e["peer_id"] for e in closed["manifest"]] == sorted(p.peer_id for p in peers)
    assert {(e["peer_id"], e["packet_digest"]) for e in closed["manifest"]} == {
        (p.peer_id, packet_digest(p.peer_id, 0)) for p in peers
    }
    nxt = round_of(client, run_id, 1)
    assert nxt["state"] == "open" and nxt["deadline"] == fake_clock() + 30.0


def test_deadline_close_and_refusal_codes(coordinator_client, fake_clock):
    client = coordinator_client
    run_id = create_run(
        client, {"membership.min_peers": 3, "exchange.max_packet_bytes": 4096, "membership.heartbeat_timeout_s": 300.0}
    )
    a, b, c = peers_for(client, fake_clock, run_id, 3)
    assert a.submit(run_id, 0).status_code == 200
    assert a.submit(run_id, 0).status_code == 200, "a retry of the same submission is accepted"
    assert error_of(a.submit(run_id, 0, digest="0" * 64)) == "conflicting_submission"
    assert error_of(b.submit(run_id, 0, packet_size_bytes=5000)) == "packet_too_large"
    assert error_of(b.submit(run_id, 1)) == "future_round"
    assert b.submit(run_id, 0).status_code == 200
    fake_clock.advance(30.0)  # c never submits: the deadline closes the round without it
    tick(client)
    closed = round_of(client, run_id, 0)
    assert closed["state"] == "closed"
    assert [e["peer_id"] for e in closed["manifest"]] == sorted([a.peer_id, b.peer_id])
    assert error_of(c.submit(run_id, 0)) == "late"
    for peer in (c, a, b):  # c is no contributor: round 1 closes once a and b submitted
        assert peer.submit(run_id, 1).status_code == 200
    assert error_of(c.submit(run_id, 0)) == "stale_round"
    assert round_of(client, run_id, 1)["state"] == "closed"


def test_late_joiner_does_not_block_but_may_submit(coordinator_client, fake_clock):
    client = coordinator_client
    run_id = create_run(client, {"membership.min_peers": 2})
    a, b = peers_for(client, fake_clock, run_id, 2)
    late = SignedPeer(client, clock=fake_clock)
    joined = late.join(run_id).json()
    assert joined["current_round"] == 0 and joined["run_state"] == "running"
    assert late.submit(run_id, 0).status_code == 200
    a.submit(run_id, 0)
    assert round_of(client, run_id, 0)["state"] == "open"
    b.submit(run_id, 0)
    assert len(round_of(client, run_id, 0)["manifest"]) == 3
    # From round 1 on the late joiner is expected like everyone else.
    a.submit(run_id, 1)
    b.submit(run_id, 1)
    assert round_of(client, run_id, 1)["state"] == "open"
    late.submit(run_id, 1)
    assert round_of(client, run_id, 1)["state"] == "closed"


def test_empty_rounds_close_at_deadline_and_max_rounds_finishes(coordinator_client, fake_clock):
    client = coordinator_client
    run_id = create_run(client, {"membership.min_peers": 1, "max_rounds": 2, "membership.heartbeat_timeout_s": 300.0})
    (peer,) = peers_for(client, fake_clock, run_id, 1)
    fake_clock.advance(31.0)
    tick(client)
    empty = round_of(client, run_id, 0)
    assert empty["state"] == "closed" and empty["manifest"] == []
    assert round_of(client, run_id, 1)["state"] == "open"
    peer.submit(run_id, 1)
    info = client.get(f"/v1/runs/{run_id}").json()
    assert info["state"] == "finished" and info["current_round"] == 2
    assert error_of(client.get(f"/v1/runs/{run_id}/rounds/2")) == "round_not_found"
    assert error_of(peer.submit(run_id, 2)) == "run_closed"
    status = client.get(f"/v1/runs/{run_id}/status").json()
    assert status["current_round"] is None
    assert [h["num_contributors"] for h in status["history"]] == [0, 1]


def test_applied_digests_majority_and_flags(coordinator_client, fake_clock, tmp_path):
    client = coordinator_client
    run_id = create_run(client, {"membership.min_peers": 3})
    a, b, c = peers_for(client, fake_clock, run_id, 3)
    assert error_of(a.applied(run_id, 0, "ab" * 16)) == "round_not_closed"
    assert error_of(a.applied(run_id, 7, "ab" * 16)) == "round_not_found"
    for peer in (a, b, c):
        peer.submit(run_id, 0)
    good, bad = "11" * 32, "22" * 32
    assert a.applied(run_id, 0, good).json() == {
        "round": 0,
        "majority_digest": good,
        "agrees": True,
        "num_reports": 1,
        "manifest_version": 1,
        "amended": {},
        "agreed_digest": None,
        "provisional": True,
        "num_votes": 1,
        "vote": True,
        "snapshot_put_url": None,
    }
    assert c.applied(run_id, 0, bad).json()["agrees"] is False, "a tie keeps the majority"
    last = b.applied(run_id, 0, good).json()
    # Nobody has earned credit yet (no scores): a dispute waits for credit to decide it.
    assert (last["num_reports"], last["agreed_digest"], last["provisional"]) == (3, None, True)
    assert round_of(client, run_id, 0)["majority_digest"] == good
    status = client.get(f"/v1/runs/{run_id}/status").json()
    dispute = status["history"][0]["dispute"]
    assert dispute["decided"] is False and [side["digest"] for side in dispute["sides"]] == [good, bad], dispute
    assert dispute["verdict"].startswith("undecided: no vote of credit yet"), dispute
    # Credit as scoring gives it (protocol/scoring.py, rule 5): a and b earned it, c did not.
    storage = open_storage(f"sqlite:///{tmp_path / 'coordinator.db'}")  # the service's database, beside it
    for peer in (a, b):
        storage.update_peer(run_id, peer.peer_id, credit=2)
    storage.close()
    for peer in (a, b, c):
        peer.submit(run_id, 1)  # round 1 closes: round 0 is settled, and weighed with the credit
    assert round_of(client, run_id, 0)["agreed_digest"] == good
    status = client.get(f"/v1/runs/{run_id}/status").json()
    flags = {p["peer_id"]: (p["flags"], p["mismatch_round"]) for p in status["peers"]}
    assert flags == {a.peer_id: ([], None), b.peer_id: ([], None), c.peer_id: (["params_mismatch"], 0)}
    excluded = next(p for p in status["peers"] if p["peer_id"] == c.peer_id)
    assert excluded["excluded"] and excluded["excluded_reason"].startswith("wrong_digest: round 0:"), excluded
    dispute = status["history"][0]["dispute"]
    assert dispute["decided"] and dispute["excluded"] == [c.peer_id], dispute
    assert status["history"][0]["majority_digest"] == good
    assert status["history"][0]["num_applied"] == 3
    params = SignedPeer(client, clock=fake_clock).join(run_id).json()["params"]
    assert params["round"] == 1 and params["digest"] == good
    assert sorted(h["peer_id"] for h in params["holders"]) == sorted([a.peer_id, b.peer_id])


def test_silent_peers_become_gone_and_do_not_block(coordinator_client, fake_clock):
    client = coordinator_client
    run_id = create_run(client, {"membership.min_peers": 2, "membership.heartbeat_timeout_s": 20.0})
    a, b = peers_for(client, fake_clock, run_id, 2)
    fake_clock.advance(15.0)
    assert a.heartbeat(run_id, 0).json()["current_round"] == 0
    fake_clock.advance(10.0)  # b silent for 25 s
    tick(client)
    peers = {p["peer_id"]: p for p in client.get(f"/v1/runs/{run_id}/status").json()["peers"]}
    assert peers[a.peer_id]["status"] == "live"
    assert peers[b.peer_id]["status"] == "gone"
    assert "no heartbeat for 25 s" in peers[b.peer_id]["reason"]
    assert error_of(b.submit(run_id, 0)) == "peer_gone"
    assert a.submit(run_id, 0).status_code == 200
    assert round_of(client, run_id, 0)["state"] == "closed", "gone peers do not block"
    rejoined = b.join(run_id).json()
    assert rejoined["peer_index"] == 1 and rejoined["current_round"] == 1
    a.submit(run_id, 1)
    assert round_of(client, run_id, 1)["state"] == "closed", "b is expected from round 2"


def test_leave_can_close_the_round(coordinator_client, fake_clock):
    client = coordinator_client
    run_id = create_run(client, {"membership.min_peers": 2})
    a, b = peers_for(client, fake_clock, run_id, 2)
    a.submit(run_id, 0)
    left = b.post(f"/v1/runs/{run_id}/leave", {"reason": "shutting down"})
    assert left.json() == {"peer_id": b.peer_id, "status": "left"}
    assert round_of(client, run_id, 0)["state"] == "closed"
    status = client.get(f"/v1/runs/{run_id}/status").json()
    gone = next(p for p in status["peers"] if p["peer_id"] == b.peer_id)
    assert gone["status"] == "left" and gone["reason"] == "left: shutting down"
    assert error_of(b.heartbeat(run_id, 1)) == "peer_gone"


def test_long_poll_wakes_when_the_round_closes(coordinator_client, fake_clock):
    client = coordinator_client
    run_id = create_run(client, {"membership.min_peers": 2})
    a, b = peers_for(client, fake_clock, run_id, 2)
    a.submit(run_id, 0)
    started = time.monotonic()
    assert round_of(client, run_id, 0, wait_s=0.2)["state"] == "open"
    assert time.monotonic() - started >= 0.2
    result: dict = {}

    def long_poll() -> None:
        result["view"] = round_of(client, run_id, 0, wait_s=20)
        result["at"] = time.monotonic()

    waiter = start_parked(client, long_poll)
    closed_at = time.monotonic()
    b.submit(run_id, 0)
    waiter.join(timeout=20)
    assert result["view"]["state"] == "closed" and len(result["view"]["manifest"]) == 2
    assert result["at"] - closed_at < 5.0


def test_long_poll_answers_each_submission_with_the_packets_so_far(coordinator_client, fake_clock):
    """Peers fetch packets before the round closes: `submitted_gt=n` answers once more than n packets
    came, listing them (not yet a manifest); the list empties into the manifest at the close."""
    client = coordinator_client
    run_id = create_run(client, {"membership.min_peers": 3})
    a, b, c = peers_for(client, fake_clock, run_id, 3)
    started = time.monotonic()
    view = round_of(client, run_id, 0, wait_s=0.2)
    assert time.monotonic() - started >= 0.2  # nothing submitted: the poll waits its full time
    assert view["state"] == "open" and view["submitted"] == [] and view["manifest"] == []
    a.submit(run_id, 0)
    result: dict = {}

    def long_poll() -> None:
        result["view"] = client.get(f"/v1/runs/{run_id}/rounds/0?wait_s=20&submitted_gt=1").json()

    waiter = start_parked(client, long_poll)  # one packet is not more than submitted_gt=1: it parks
    b.submit(run_id, 0)
    waiter.join(timeout=20)
    view = result["view"]
    assert view["state"] == "open" and view["num_submitted"] == 2 and view["manifest"] == []
    assert [e["peer_id"] for e in view["submitted"]] == sorted([a.peer_id, b.peer_id])
    assert {e["packet_digest"] for e in view["submitted"]} == {packet_digest(p.peer_id, 0) for p in (a, b)}
    assert all(e["public_key"] and e["packet_size_bytes"] > 0 for e in view["submitted"])
    c.submit(run_id, 0)
    closed = round_of(client, run_id, 0)
    assert closed["state"] == "closed" and closed["submitted"] == [] and len(closed["manifest"]) == 3
    bad = client.get(f"/v1/runs/{run_id}/rounds/0?submitted_gt=-1")
    assert bad.status_code == 422
