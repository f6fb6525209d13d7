"""Amended manifests in-process with a fake clock: missing-packet reports, when an entry is dropped
(every other contributor reported it, or the grace passed), versions and reasons, the
withholder's flag and the next rounds' expected set, the majority over the latest version, the
version long-poll, idempotence and hostile reports (protocol.http, "Amended manifests")."""

from __future__ import annotations

import time

import pytest

from tests.fixtures.coordinator import SignedPeer, create_run, error_of
from tests.unit.test_coordinator_rounds import peers_for, round_of, start_parked, tick

pytestmark = pytest.mark.timeout(30)

GRACE_S = 10.0


def missing(peer: SignedPeer, run_id: str, round_index: int, *suspects) -> object:
    ids = [s if isinstance(s, str) else s.peer_id for s in suspects]
    return peer.post(f"/v1/runs/{run_id}/rounds/{round_index}/missing", {"peer_ids": ids})


def applied(peer: SignedPeer, run_id: str, round_index: int, digest: str, version: int | None = None):
    payload: dict = {"params_digest": digest}
    if version is not None:
        payload["manifest_version"] = version
    return peer.post(f"/v1/runs/{run_id}/rounds/{round_index}/applied", payload)


def closed_round(client, fake_clock, num_peers: int = 4):
    """A run with `num_peers` peers whose round 0 closed with every packet; round 1 open."""
    run_id = create_run(
        client,
        {
            "membership.min_peers": num_peers,
            "exchange.missing_grace_s": GRACE_S,
            "membership.heartbeat_timeout_s": 300.0,
        },
    )
    peers = peers_for(client, fake_clock, run_id, num_peers)
    for peer in peers:
        assert peer.submit(run_id, 0).status_code == 200
    assert round_of(client, run_id, 0)["state"] == "closed"
    return run_id, peers


def status_of(client, run_id: str) -> dict:
    return client.get(f"/v1/runs/{run_id}/status").json()


def test_reports_from_every_other_contributor_drop_the_entry_at_once(coordinator_client, fake_clock):
    client = coordinator_client
    run_id, (a, b, c, w) = closed_round(client, fake_clock)
    first = missing(a, run_id, 0, w)
    assert first.status_code == 200, first.text
    assert first.json() == {"round": 0, "manifest_version": 1, "dropped": {}, "pending": [w.peer_id]}
    assert missing(a, run_id, 0, w).json()["pending"] == [w.peer_id], "a repeat changes nothing"
    assert missing(b, run_id, 0, w).json()["manifest_version"] == 1, "c has not reported yet"
    last = missing(c, run_id, 0, w).json()
    assert last["manifest_version"] == 2 and last["pending"] == []
    assert "all 3 other live contributors" in last["dropped"][w.peer_id]
    view = round_of(client, run_id, 0)
    assert view["manifest_version"] == 2 and list(view["dropped"]) == [w.peer_id]
    assert [e["peer_id"] for e in view["manifest"]] == sorted(p.peer_id for p in (a, b, c))
    assert view["num_submitted"] == 4
    # Idempotent after the drop too: a late report of the dropped entry is answered, not counted.
    again = missing(a, run_id, 0, w).json()
    assert again["manifest_version"] == 2 and again["pending"] == []
    peers = {p["peer_id"]: p["flags"] for p in status_of(client, run_id)["peers"]}
    assert peers[w.peer_id] == ["withheld_packet"] and peers[a.peer_id] == []
    # The withholder is not expected in round 1: it closes when the other three submitted.
    assert status_of(client, run_id)["current_round"]["num_expected"] == 3
    for peer in (a, b, c):
        peer.submit(run_id, 1)
    assert round_of(client, run_id, 1)["state"] == "closed"


def test_a_single_report_drops_the_entry_after_the_grace(coordinator_client, fake_clock):
    client = coordinator_client
    run_id, (a, b, c, w) = closed_round(client, fake_clock)
    assert missing(a, run_id, 0, w).json()["pending"] == [w.peer_id]
    fake_clock.advance(GRACE_S - 1)
    tick(client)
    assert round_of(client, run_id, 0)["manifest_version"] == 1
    for peer in (a, b, c, w):  # a round goes on while an earlier one waits for its amendment
        peer.submit(run_id, 1)
    assert round_of(client, run_id, 1)["state"] == "closed"
    fake_clock.advance(1)
    tick(client)  # the coordinator's clock applies the due amendment
    view = round_of(client, run_id, 0)
    assert view["manifest_version"] == 2 and w.peer_id not in {e["peer_id"] for e in view["manifest"]}
    assert "reported missing by 1 peer(s)" in view["dropped"][w.peer_id]
    # Another entry reported later makes a third version; a round never moves back.
    assert missing(b, run_id, 0, c).json()["manifest_version"] == 2
    fake_clock.advance(GRACE_S)
    tick(client)
    view = round_of(client, run_id, 0)
    assert view["manifest_version"] == 3 and sorted(view["dropped"]) == sorted([w.peer_id, c.peer_id])
    assert [e["peer_id"] for e in view["manifest"]] == sorted([a.peer_id, b.peer_id])


def test_majority_counts_only_the_latest_version(coordinator_client, fake_clock):
    client = coordinator_client
    run_id, (a, b, c, w) = closed_round(client, fake_clock)
    full, amended = "11" * 32, "22" * 32
    for peer in (w, a):  # they had every packet and applied version 1
        assert applied(peer, run_id, 0, full).json()["majority_digest"] == full
    for peer in (a, b, c):
        missing(peer, run_id, 0, w)  # a's report after applying: it lost its copy, say
    view = round_of(client, run_id, 0)
    assert view["manifest_version"] == 2 and view["majority_digest"] is None
    assert error_of(applied(b, run_id, 0, amended, version=3)) == "unknown_manifest_version"
    first = applied(b, run_id, 0, amended, version=2).json()
    assert first == {
        "round": 0,
        "majority_digest": amended,
        "agrees": True,
        "num_reports": 1,
        "manifest_version": 2,
        "amended": {"0": 2},
        "agreed_digest": None,
        "provisional": True,
        "num_votes": 1,
        "vote": True,
        "snapshot_put_url": None,
    }
    stale = applied(w, run_id, 0, full).json()  # a version-1 report again: kept, not counted
    assert stale["agrees"] is False and stale["manifest_version"] == 2 and stale["num_reports"] == 1
    assert applied(c, run_id, 0, amended, version=2).json()["num_reports"] == 2
    recomputed = applied(w, run_id, 0, amended, version=2).json()  # its packet is not in version 2: no vote
    assert recomputed["agrees"] is True and recomputed["vote"] is False and recomputed["num_votes"] == 2
    # Nobody has earned credit yet: agreed once every contributor of version 2 voted the same.
    assert round_of(client, run_id, 0)["agreed_digest"] is None
    assert applied(a, run_id, 0, amended, version=2).json()["agreed_digest"] == amended
    assert round_of(client, run_id, 0)["majority_digest"] == amended
    joined = SignedPeer(client, clock=fake_clock).join(run_id).json()["params"]
    assert joined["digest"] == amended and len(joined["holders"]) == 4, "w recomputed it too"


def test_the_flag_clears_once_a_later_packet_is_applied(coordinator_client, fake_clock):
    client = coordinator_client
    run_id, (a, b, c, w) = closed_round(client, fake_clock)
    for peer in (a, b, c):
        missing(peer, run_id, 0, w)
    for peer in (w, a, b, c):  # not waited for, it still submits in time
        assert peer.submit(run_id, 1).status_code == 200
    assert round_of(client, run_id, 1)["state"] == "closed"
    applied(w, run_id, 1, "33" * 32)  # its own report does not clear its flag
    assert "withheld_packet" in {f for p in status_of(client, run_id)["peers"] for f in p["flags"]}
    applied(a, run_id, 1, "33" * 32)
    peers = {p["peer_id"]: p["flags"] for p in status_of(client, run_id)["peers"]}
    assert peers[w.peer_id] == []
    assert status_of(client, run_id)["current_round"]["num_expected"] == 4


def test_hostile_and_early_reports_are_refused(coordinator_client, fake_clock):
    client = coordinator_client
    run_id, (a, b, c, w) = closed_round(client, fake_clock)
    assert error_of(missing(a, run_id, 1, w)) == "round_not_closed"
    assert error_of(missing(a, run_id, 9, w)) == "round_not_found"
    assert error_of(missing(a, run_id, 0, "p" + "0" * 16)) == "not_in_manifest"
    assert error_of(missing(a, run_id, 0, a)) == "invalid_request"
    assert error_of(missing(SignedPeer(client, clock=fake_clock), run_id, 0, w)) == "unknown_peer"
    other_run = create_run(client, {"membership.min_peers": 1})
    outsider = SignedPeer(client, clock=fake_clock)
    assert outsider.join(other_run).status_code == 200
    assert error_of(missing(outsider, run_id, 0, w)) == "not_member"
    assert error_of(a.post(f"/v1/runs/{run_id}/rounds/0/missing", {"peer_ids": []})) == "invalid_request"
    too_many = {"peer_ids": [f"p{i:016x}" for i in range(65)]}
    assert error_of(a.post(f"/v1/runs/{run_id}/rounds/0/missing", too_many)) == "invalid_request"
    assert error_of(a.post(f"/v1/runs/{run_id}/rounds/0/missing", {"peer_ids": ["not-a-peer"]})) == "invalid_request"
    # Rounds too far back: their packets are forgotten by design.
    for r in range(1, 6):
        for peer in (a, b, c, w):
            peer.submit(run_id, r)
    assert round_of(client, run_id, 5)["state"] == "closed"
    for peer in (a, b, c):  # the swarm went on: a later state is agreed, a snapshot of it is the way past
        assert applied(peer, run_id, 3, "cd" * 32).status_code == 200
    assert round_of(client, run_id, 3)["agreed_digest"] == "cd" * 32
    assert error_of(missing(a, run_id, 0, w)) == "round_too_old"
    # Round 2 is in the window, but round 3 was agreed on its state: it stays as it is.
    assert error_of(missing(a, run_id, 2, w)) == "round_too_old"
    assert missing(a, run_id, 4, w).status_code == 200  # nothing agreed after round 4
    assert round_of(client, run_id, 0)["manifest_version"] == 1


def test_version_long_poll_wakes_on_the_amendment(coordinator_client, fake_clock):
    client = coordinator_client
    run_id, (a, b, c, w) = closed_round(client, fake_clock)
    started = time.monotonic()
    view = client.get(f"/v1/runs/{run_id}/rounds/0?wait_s=0.2&version_gt=1").json()
    assert view["manifest_version"] == 1 and time.monotonic() - started >= 0.2
    missing(a, run_id, 0, w)
    missing(b, run_id, 0, w)
    result: dict = {}

    def long_poll() -> None:
        result["view"] = client.get(f"/v1/runs/{run_id}/rounds/0?wait_s=20&version_gt=1").json()

    waiter = start_parked(client, long_poll)
    missing(c, run_id, 0, w)
    waiter.join(timeout=20)
    assert result["view"]["manifest_version"] == 2
    assert error_of(client.get(f"/v1/runs/{run_id}/rounds/0?version_gt=-1")) == "invalid_request"


def test_the_last_round_of_a_finished_run_is_amended_too(coordinator_client, fake_clock):
    client = coordinator_client
    run_id = create_run(
        client,
        {
            "membership.min_peers": 2,
            "max_rounds": 1,
            "exchange.missing_grace_s": GRACE_S,
            "membership.heartbeat_timeout_s": 300.0,
        },
    )
    a, w = peers_for(client, fake_clock, run_id, 2)
    a.submit(run_id, 0)
    w.submit(run_id, 0)
    assert client.get(f"/v1/runs/{run_id}").json()["state"] == "finished"
    assert missing(a, run_id, 0, w).json()["manifest_version"] == 2  # a is the only other contributor
    assert [e["peer_id"] for e in round_of(client, run_id, 0)["manifest"]] == [a.peer_id]


def test_no_drop_after_the_grace_when_another_peer_applied_the_round(coordinator_client, fake_clock):
    """One peer that can fetch nothing must not empty the manifests: when a peer other than the
    publisher and the reporters applied the round, the packet is served, and the grace drops nothing."""
    client = coordinator_client
    run_id, (a, b, c, w) = closed_round(client, fake_clock)
    assert applied(b, run_id, 0, "11" * 32).status_code == 200
    missing(a, run_id, 0, w)
    missing(a, run_id, 0, c)
    fake_clock.advance(GRACE_S * 3)
    tick(client)
    view = round_of(client, run_id, 0)
    assert view["manifest_version"] == 1 and view["dropped"] == {}
    assert missing(a, run_id, 0, w).json()["pending"] == sorted([w.peer_id, c.peer_id])
    # The publisher's own report of applying the round is no evidence that others can fetch it.
    run_id, (a, b, c, w) = closed_round(client, fake_clock)
    applied(w, run_id, 0, "11" * 32)
    missing(a, run_id, 0, w)
    fake_clock.advance(GRACE_S)
    tick(client)
    assert list(round_of(client, run_id, 0)["dropped"]) == [w.peer_id]


def dropped_in(run_id: str, round_index: int, w: SignedPeer, others) -> None:
    """Every peer submits to the open round `round_index`; the others report w's packet missing."""
    for peer in (w, *others):
        assert peer.submit(run_id, round_index).status_code == 200
    for peer in others:
        missing(peer, run_id, round_index, w)


def peer_view(client, run_id: str, peer: SignedPeer) -> dict:
    return {p["peer_id"]: p for p in status_of(client, run_id)["peers"]}[peer.peer_id]


def test_a_publisher_dropped_again_while_flagged_is_excluded_for_a_while(coordinator_client, fake_clock):
    """Flagged, a withholder is not waited for, but its packets still join the manifests: one that
    submits every round and serves nobody cost every other peer a stall time-out a round. Dropped
    again while flagged, it is excluded for 4 rounds; the next time for 8."""
    client = coordinator_client
    run_id, (a, b, c, w) = closed_round(client, fake_clock)
    for peer in (a, b, c):
        missing(peer, run_id, 0, w)
    dropped_in(run_id, 1, w, (a, b, c))
    view = peer_view(client, run_id, w)
    assert view["excluded"] and view["excluded_until_round"] == 6
    assert "rounds 0 and 1 were dropped as unfetchable" in view["excluded_reason"]
    for r in range(2, 6):
        refused = w.submit(run_id, r)
        assert error_of(refused) == "excluded", refused.text
        for peer in (a, b, c):
            assert peer.submit(run_id, r).status_code == 200
        assert round_of(client, run_id, r)["state"] == "closed"
    # Back at round 6, still flagged (none of its packets was applied): dropped again, 8 rounds.
    dropped_in(run_id, 6, w, (a, b, c))
    assert peer_view(client, run_id, w)["excluded_until_round"] == 15


def test_a_drop_after_the_flag_cleared_only_flags(coordinator_client, fake_clock):
    """A packet of its applied in between (the flag cleared): a later drop flags it again, nothing more."""
    client = coordinator_client
    run_id, (a, b, c, w) = closed_round(client, fake_clock)
    for peer in (a, b, c):
        missing(peer, run_id, 0, w)
    for peer in (w, a, b, c):
        assert peer.submit(run_id, 1).status_code == 200
    applied(a, run_id, 1, "33" * 32)  # w's round-1 packet reached a: the flag clears
    dropped_in(run_id, 2, w, (a, b, c))
    view = peer_view(client, run_id, w)
    assert view["flags"] == ["withheld_packet"] and not view["excluded"]
