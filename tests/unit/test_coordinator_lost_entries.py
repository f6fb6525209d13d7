"""Entries nobody can serve leave a closed round's manifest at once (coordinator/service.py, "Amended
manifests"): an author that restarted without its packet says so (`lost_own`), an author that is not
live cannot serve it; either is dropped unless a live peer that applied the round holds a copy. A
round whose manifest is (or becomes) empty takes its start's agreed digest. Peers say what they
are stuck on in their heartbeats and the status shows it. In-process, fake clock, real SQLite."""

from __future__ import annotations

import pytest

from coordinator.terminal import render_status
from tests.fixtures.coordinator import SignedPeer, create_run, error_of
from tests.unit.test_coordinator_rounds import peers_for, round_of

pytestmark = pytest.mark.timeout(30)

DEADLINE_S = 60.0
D0, D1 = "d0" * 16, "d1" * 16


def report_missing(peer: SignedPeer, run_id: str, round_index: int, *suspects: SignedPeer, lost_own: bool = False):
    payload: dict = {"peer_ids": [s.peer_id for s in suspects]}
    if lost_own:
        payload["lost_own"] = True
    return peer.post(f"/v1/runs/{run_id}/rounds/{round_index}/missing", payload)


def status_of(client, run_id: str) -> dict:
    return client.get(f"/v1/runs/{run_id}/status").json()


def history_of(client, run_id: str) -> dict[int, dict]:
    return {h["round"]: h for h in status_of(client, run_id)["history"]}


def round_1_closed_with_a_and_b(client, fake_clock):
    """Three peers; round 0 applied and agreed by all (D0); round 1 closed at its deadline with the
    packets of a and b only (c never submitted), before anyone's heartbeat timed out."""
    run_id = create_run(client, {"membership.min_peers": 3, "membership.heartbeat_timeout_s": 300.0,
                                 "deadline": {"kind": "fixed", "round_timeout_s": DEADLINE_S}})
    a, b, c = peers_for(client, fake_clock, run_id, 3)
    for peer in (a, b, c):
        assert peer.submit(run_id, 0).status_code == 200
    for peer in (a, b, c):
        assert peer.applied(run_id, 0, D0).status_code == 200
    assert round_of(client, run_id, 0)["agreed_digest"] == D0
    assert a.submit(run_id, 1).status_code == 200 and b.submit(run_id, 1).status_code == 200
    fake_clock.advance(DEADLINE_S + 1)
    view = round_of(client, run_id, 1)
    assert view["state"] == "closed" and [e["peer_id"] for e in view["manifest"]] == sorted([a.peer_id, b.peer_id])
    return run_id, a, b, c


def test_authors_that_lost_their_packets_empty_the_round_and_it_keeps_its_start(coordinator_client, fake_clock):
    client = coordinator_client
    run_id, a, b, c = round_1_closed_with_a_and_b(client, fake_clock)
    # Every node restarted (same keys): a and b kept no packet. Only authors are involved.
    first = report_missing(a, run_id, 1, lost_own=True)
    assert first.status_code == 200, first.text
    assert first.json()["manifest_version"] == 2 and "said it lost" in first.json()["dropped"][a.peer_id]
    view = round_of(client, run_id, 1)
    assert [e["peer_id"] for e in view["manifest"]] == [b.peer_id]
    assert view["agreed_digest"] is None  # b's packet still changes the parameters: a new vote
    second = report_missing(b, run_id, 1, lost_own=True).json()
    assert second["manifest_version"] == 3 and set(second["dropped"]) == {a.peer_id, b.peer_id}
    view = round_of(client, run_id, 1)
    assert view["manifest"] == [] and view["agreed_digest"] == D0, "no packet: the round's start is its result"
    assert history_of(client, run_id)[1]["agreed_digest"] == D0
    # A repeat changes nothing; c was never an entry and cannot claim to have lost one.
    assert report_missing(a, run_id, 1, lost_own=True).json()["manifest_version"] == 3
    assert error_of(report_missing(c, run_id, 1, lost_own=True)) == "not_in_manifest"


def test_authors_report_each_other_and_themselves_at_once(coordinator_client, fake_clock):
    client = coordinator_client
    run_id, a, b, c = round_1_closed_with_a_and_b(client, fake_clock)
    c.post(f"/v1/runs/{run_id}/leave", {"reason": "gone for good"})  # only the authors are live
    answer = report_missing(a, run_id, 1, b, lost_own=True).json()
    # a lost its own; b's entry was reported by every other live contributor (a): both go, in one version.
    assert answer["manifest_version"] == 2 and answer["pending"] == []
    assert "said it lost" in answer["dropped"][a.peer_id]
    assert "all 1 other live contributors" in answer["dropped"][b.peer_id]
    view = round_of(client, run_id, 1)
    assert view["manifest"] == [] and view["agreed_digest"] == D0


def test_a_gone_authors_entry_is_dropped_at_once_unless_an_applier_serves_it(coordinator_client, fake_clock):
    client = coordinator_client
    run_id, a, b, c = round_1_closed_with_a_and_b(client, fake_clock)
    assert b.post(f"/v1/runs/{run_id}/leave", {"reason": "power cut"}).status_code == 200
    # a applied round 1 (it fetched b's packet and serves its copy): c's report does not drop b at once.
    assert a.applied(run_id, 1, D1).status_code == 200
    held = report_missing(c, run_id, 1, b).json()
    assert held["manifest_version"] == 1 and held["pending"] == [b.peer_id]
    # The same without the applier: a fresh round 2 where a and b submitted, b left, nobody applied.
    assert a.submit(run_id, 2).status_code == 200 and b.join(run_id).status_code == 200 and b.submit(run_id, 2).status_code == 200
    fake_clock.advance(DEADLINE_S + 1)
    assert round_of(client, run_id, 2)["state"] == "closed"
    assert b.post(f"/v1/runs/{run_id}/leave", {"reason": "power cut"}).status_code == 200
    dropped = report_missing(c, run_id, 2, b).json()
    assert dropped["manifest_version"] == 2 and "its author is not live (left)" in dropped["dropped"][b.peer_id]


def test_reports_that_name_nothing_or_oneself_are_refused(coordinator_client, fake_clock):
    client = coordinator_client
    run_id, a, b, c = round_1_closed_with_a_and_b(client, fake_clock)
    empty = a.post(f"/v1/runs/{run_id}/rounds/1/missing", {"peer_ids": []})
    assert empty.status_code == 422 and "lost_own" in empty.text
    assert error_of(report_missing(a, run_id, 1, a)) == "invalid_request"
    assert a.post(f"/v1/runs/{run_id}/rounds/1/missing", {"lost_own": "yes"}).status_code == 422
    assert round_of(client, run_id, 1)["manifest_version"] == 1


def test_empty_rounds_take_their_starts_agreed_digest_when_it_comes(coordinator_client, fake_clock):
    client = coordinator_client
    run_id, a, b, c = round_1_closed_with_a_and_b(client, fake_clock)
    fake_clock.advance(DEADLINE_S + 1)  # round 2: nobody submitted; closed at its deadline
    history = history_of(client, run_id)
    assert history[2]["num_contributors"] == 0 and history[1]["agreed_digest"] is None
    assert history[2]["agreed_digest"] is None, "its start (round 1's result) is not agreed yet"
    for peer in (a, b):
        assert peer.applied(run_id, 1, D1).status_code == 200
    history = history_of(client, run_id)
    assert history[1]["agreed_digest"] == D1 and history[2]["agreed_digest"] == D1


def test_stuck_peers_say_why_and_the_status_shows_it(coordinator_client, fake_clock):
    client = coordinator_client
    run_id, a, b, c = round_1_closed_with_a_and_b(client, fake_clock)
    line = f"round 1: waiting for the packets of {b.peer_id} (live; not served yet)"
    beat = a.post(f"/v1/runs/{run_id}/heartbeat", {"round": 2, "state": "stuck", "detail": line})
    assert beat.status_code == 200, beat.text
    status = status_of(client, run_id)
    assert status["stuck"] == f"stuck: {a.peer_id}: {line}"
    assert f"stuck: {a.peer_id}: {line}" in render_status(status).splitlines()  # `locoswarm status`
    assert {p["peer_id"]: p["detail"] for p in status["peers"]}[a.peer_id] == line
    c.post(f"/v1/runs/{run_id}/heartbeat", {"round": 2, "state": "stuck", "detail": "round 1: waiting"})
    assert status_of(client, run_id)["stuck"].endswith("(2 peers)")
    for bad in ("x" * 201, "line\nbreak", "\x1b[31mred"):
        refused = a.post(f"/v1/runs/{run_id}/heartbeat", {"round": 2, "state": "stuck", "detail": bad})
        assert refused.status_code == 422, bad
    a.heartbeat(run_id, 2)
    c.heartbeat(run_id, 2)
    status = status_of(client, run_id)
    assert status["stuck"] is None and all(p["detail"] is None for p in status["peers"])
