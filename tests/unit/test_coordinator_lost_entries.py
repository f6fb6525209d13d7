"""Entries nobody can serve leave a closed round's manifest at once (coordinator/rules/amendments.py,
"Amended manifests"): an author that restarted without its packet says so (`lost_own`), an author that is not
live cannot serve it; either is dropped unless a live peer that applied the round holds a copy. A
round whose manifest is (or becomes) empty takes its start's agreed digest. Peers say what they
are stuck on in their heartbeats and the status shows it. In-process, fake clock, real SQLite."""

from __future__ import annotations

import sqlite3
from contextlib import closing

import pytest

from coordinator import recovery
from coordinator.rules import rounds
from coordinator.storage import open_storage
from coordinator.storage.schema import CREATE_MIGRATIONS_TABLE, MIGRATIONS
from coordinator.terminal import render_status
from protocol.http import MISSING_REPORT_ROUNDS
from protocol.run_config import ExchangeSection
from tests.fixtures.coordinator import SignedPeer, create_run, error_of
from tests.unit.test_coordinator_rounds import peers_for, round_of, tick

pytestmark = pytest.mark.timeout(30)

DEADLINE_S = 60.0
HEARTBEAT_TIMEOUT_S = 300.0
D0, D1, D2 = "d0" * 16, "d1" * 16, "d2" * 16


def report_missing(peer: SignedPeer, run_id: str, round_index: int, *suspects: SignedPeer, lost_own: bool = False):
    payload: dict = {"peer_ids": [s.peer_id for s in suspects]}
    if lost_own:
        payload["lost_own"] = True
    return peer.post(f"/v1/runs/{run_id}/rounds/{round_index}/missing", payload)


def status_of(client, run_id: str) -> dict:
    return client.get(f"/v1/runs/{run_id}/status").json()


def history_of(client, run_id: str) -> dict[int, dict]:
    return {h["round"]: h for h in status_of(client, run_id)["history"]}


def storage_of(client):
    return client.app.state.service.storage


def applied_version(peer: SignedPeer, run_id: str, round_index: int, digest: str, version: int):
    return peer.post(
        f"/v1/runs/{run_id}/rounds/{round_index}/applied", {"params_digest": digest, "manifest_version": version}
    )


def everyone_gone(client, fake_clock, run_id: str, peers: list[SignedPeer]) -> None:
    """The whole swarm killed: silent past the heartbeat timeout, so the coordinator marks every
    peer gone and pauses the run (coordinator/recovery.py)."""
    fake_clock.advance(HEARTBEAT_TIMEOUT_S + 1)
    tick(client)
    status = status_of(client, run_id)
    assert {p["peer_id"]: p["status"] for p in status["peers"]} == {p.peer_id: "gone" for p in peers}
    assert status["recovery"] is not None


def round_1_closed_with_a_and_b(client, fake_clock, heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S):
    """Three peers; round 0 applied and agreed by all (D0); round 1 closed at its deadline with the
    packets of a and b only (c never submitted), before anyone's heartbeat timed out."""
    run_id = create_run(
        client,
        {
            "membership.min_peers": 3,
            "membership.heartbeat_timeout_s": heartbeat_timeout_s,
            "deadline": {"kind": "fixed", "round_timeout_s": DEADLINE_S},
        },
    )
    a, b, c = peers_for(client, fake_clock, run_id, 3)
    for peer in (a, b, c):
        assert peer.submit(run_id, 0).status_code == 200
    for peer in (a, b, c):
        assert peer.applied(run_id, 0, D0).status_code == 200
    assert round_of(client, run_id, 0)["agreed_digest"] == D0
    assert a.submit(run_id, 1).status_code == 200 and b.submit(run_id, 1).status_code == 200
    fake_clock.advance(DEADLINE_S + 1)
    tick(client)
    view = round_of(client, run_id, 1)
    assert view["state"] == "closed" and [e["peer_id"] for e in view["manifest"]] == sorted([a.peer_id, b.peer_id])
    return run_id, a, b, c


def test_authors_that_lost_their_packets_empty_the_round_and_it_keeps_its_start(coordinator_client, fake_clock):
    client = coordinator_client
    run_id, a, b, c = round_1_closed_with_a_and_b(client, fake_clock)
    # Every node restarted (same keys) and rejoined before its heartbeat timed out: a and b kept no
    # packet. Only authors are involved.
    for peer in (a, b, c):
        assert peer.join(run_id, state_round=1, state_digest=D0).status_code == 200
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
    assert recovery.agreed_start(storage_of(client), run_id, 2) == D0, "round 2's start is agreed"
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
    # b says the same of itself and of a: both are out already, so nothing changes.
    again = report_missing(b, run_id, 1, a, lost_own=True).json()
    assert again["manifest_version"] == 2 and again["dropped"] == answer["dropped"]


def test_authors_that_only_say_they_lost_their_own_are_dropped_at_once(coordinator_client, fake_clock):
    """Every live peer an author, nobody reporting anyone else: each lost_own alone drops its entry."""
    client = coordinator_client
    run_id, a, b, c = round_1_closed_with_a_and_b(client, fake_clock)
    c.post(f"/v1/runs/{run_id}/leave", {"reason": "gone for good"})
    first = report_missing(b, run_id, 1, lost_own=True).json()
    assert first["manifest_version"] == 2 and list(first["dropped"]) == [b.peer_id]
    second = report_missing(a, run_id, 1, lost_own=True).json()
    assert second["manifest_version"] == 3 and set(second["dropped"]) == {a.peer_id, b.peer_id}
    assert round_of(client, run_id, 1)["agreed_digest"] == D0


def test_a_swarm_marked_gone_comes_back_without_its_packets_and_resumes(coordinator_client, fake_clock):
    """The issue's scenario with the heartbeat timeout passed: every peer gone, the run paused at
    round 2; all rejoin holding round 1's start; the authors lost their packets. Once round 1 is
    empty its start is its result, so a peer that replays it holds round 2's start and the run
    resumes there: nothing is rewound."""
    client = coordinator_client
    run_id, a, b, c = round_1_closed_with_a_and_b(client, fake_clock)
    everyone_gone(client, fake_clock, run_id, [a, b, c])
    for peer in (a, b, c):
        assert peer.join(run_id, state_round=1, state_digest=D0).status_code == 200
    assert status_of(client, run_id)["recovery"]["needed_digest"] is None  # round 1 has no agreed digest
    first = report_missing(a, run_id, 1, lost_own=True).json()
    assert first["manifest_version"] == 2 and list(first["dropped"]) == [a.peer_id]
    assert "its author said it lost the packet" in first["dropped"][a.peer_id]
    second = report_missing(b, run_id, 1, lost_own=True).json()
    assert second["manifest_version"] == 3 and set(second["dropped"]) == {a.peer_id, b.peer_id}
    view = round_of(client, run_id, 1)
    assert view["manifest"] == [] and view["agreed_digest"] == D0 and view["majority_digest"] == D0
    assert recovery.agreed_start(storage_of(client), run_id, 2) == D0
    paused = status_of(client, run_id)["recovery"]
    assert paused["needed_digest"] == D0
    assert paused["last_holders"] == sorted(p.peer_id for p in (a, b, c)), "round 0's appliers hold round 2's start"
    assert applied_version(a, run_id, 1, D0, 3).status_code == 200  # a replays the empty round 1
    tick(client)  # the coordinator's clock resumes the run: a holds round 2's start
    status = status_of(client, run_id)
    assert status["recovery"] is None and status["rewinds"] == []
    assert status["current_round"]["round"] == 2 and status["current_round"]["state"] == "open"


def test_a_returning_author_drops_its_own_and_a_gone_authors_entry_after_the_grace(coordinator_client, fake_clock):
    """Only a comes back after the whole swarm was marked gone: it lost its packet and cannot fetch
    b's (b is gone). a's entry leaves at once; b, which may be restarting with its packet on disk,
    is waited for `missing_grace_s` from the report, then its entry leaves too."""
    client = coordinator_client
    run_id, a, b, c = round_1_closed_with_a_and_b(client, fake_clock)
    everyone_gone(client, fake_clock, run_id, [a, b, c])
    assert a.join(run_id, state_round=1, state_digest=D0).status_code == 200
    answer = report_missing(a, run_id, 1, b, lost_own=True).json()
    assert answer["manifest_version"] == 2 and answer["pending"] == [b.peer_id]
    assert list(answer["dropped"]) == [a.peer_id] and "said it lost" in answer["dropped"][a.peer_id]
    fake_clock.advance(ExchangeSection().missing_grace_s - 1)
    tick(client)
    assert round_of(client, run_id, 1)["manifest_version"] == 2
    fake_clock.advance(2)
    tick(client)
    view = round_of(client, run_id, 1)
    assert view["manifest_version"] == 3 and view["manifest"] == []
    assert history_of(client, run_id)[1]["agreed_digest"] == D0


def test_a_gone_author_back_within_the_grace_of_a_paused_run_keeps_its_entry(coordinator_client, fake_clock):
    """The whole swarm killed after round 1 closed: a comes back first and cannot fetch b's packet
    (b is gone). b comes back 4 s later with its packet on disk and serves it: its entry stays,
    a applies the round as it closed, and b is not flagged. (A chaos run, before: b's entry was
    dropped at a's report, and with the wait alone, 0.15 s after b's return, by rule 2.)"""
    client = coordinator_client
    run_id, a, b, c = round_1_closed_with_a_and_b(client, fake_clock)
    everyone_gone(client, fake_clock, run_id, [a, b, c])
    assert a.join(run_id, state_round=1, state_digest=D0).status_code == 200
    answer = report_missing(a, run_id, 1, b).json()
    assert answer["manifest_version"] == 1 and answer["pending"] == [b.peer_id] and answer["dropped"] == {}
    fake_clock.advance(4)
    tick(client)
    assert b.join(run_id, state_round=1, state_digest=D0).status_code == 200
    tick(client)  # a's report predates b's return: it is not "every other live contributor" (rule 2)
    assert round_of(client, run_id, 1)["manifest_version"] == 1
    for peer in (a, b):  # a fetched b's packet from b
        assert applied_version(peer, run_id, 1, D1, 1).status_code == 200
    fake_clock.advance(ExchangeSection().missing_grace_s)
    tick(client)  # past the grace: a's report is answered by a's own applied report
    view = round_of(client, run_id, 1)
    assert view["manifest_version"] == 1
    assert [e["peer_id"] for e in view["manifest"]] == sorted([a.peer_id, b.peer_id])
    assert view["agreed_digest"] == D1
    peers = {p["peer_id"]: p for p in status_of(client, run_id)["peers"]}
    assert peers[b.peer_id]["status"] == "live"
    assert storage_of(client).get_peer(run_id, b.peer_id).withheld_round is None


def test_an_author_gone_since_the_coordinator_restarted_is_waited_for_though_the_run_never_paused(
    coordinator_client, fake_clock
):
    """Every node and the coordinator killed after round 1 closed; a is back within the restart
    grace, so the run never pauses, and it cannot fetch b's packet (b is gone: silent past the
    grace). b comes back with its packet 1 s after a's report: its entry stays. (A chaos run,
    before: b's entry was dropped at a's report, 1 s before b's return.)"""
    client = coordinator_client
    run_id, a, b, c = round_1_closed_with_a_and_b(client, fake_clock)
    fake_clock.advance(5)
    client.app.state.service.resume()  # the coordinator's restart: its restart grace counts from now
    assert a.join(run_id, state_round=1, state_digest=D0).status_code == 200
    for _ in range(2):  # b and c silent past the grace; a heartbeats
        fake_clock.advance(HEARTBEAT_TIMEOUT_S / 2 + 1)
        assert a.heartbeat(run_id, 2).status_code == 200
    tick(client)
    status = status_of(client, run_id)
    assert {p["peer_id"]: p["status"] for p in status["peers"]}[b.peer_id] == "gone"
    assert status["recovery"] is None, "a was back in time: the run did not pause"
    answer = report_missing(a, run_id, 1, b).json()
    assert answer["manifest_version"] == 1 and answer["dropped"] == {} and answer["pending"] == [b.peer_id]
    fake_clock.advance(1)
    tick(client)
    assert b.join(run_id, state_round=1, state_digest=D0).status_code == 200
    for peer in (a, b):  # a fetched b's packet from b
        assert applied_version(peer, run_id, 1, D1, 1).status_code == 200
    fake_clock.advance(ExchangeSection().missing_grace_s)
    tick(client)
    view = round_of(client, run_id, 1)
    assert view["manifest_version"] == 1 and view["agreed_digest"] == D1
    assert storage_of(client).get_peer(run_id, b.peer_id).withheld_round is None


def test_a_report_just_after_an_authors_return_waits_out_the_grace(coordinator_client, fake_clock):
    """b is killed after round 1 closed and is back (rejoined, serving its packet from disk) 1 s
    before a reports b's packet missing, from a fetch begun at b's old address (a chaos run, before:
    rule 2 dropped b's entry at that report). The entry waits; if b serves nobody, the grace ends it."""
    client = coordinator_client
    run_id, a, b, c = round_1_closed_with_a_and_b(client, fake_clock)
    fake_clock.advance(5)
    assert b.join(run_id, state_round=1, state_digest=D0).status_code == 200
    fake_clock.advance(1)
    answer = report_missing(a, run_id, 1, b).json()
    assert answer["manifest_version"] == 1 and answer["dropped"] == {} and answer["pending"] == [b.peer_id]
    fake_clock.advance(ExchangeSection().missing_grace_s)
    tick(client)
    view = round_of(client, run_id, 1)
    assert view["manifest_version"] == 2 and [e["peer_id"] for e in view["manifest"]] == [a.peer_id]


def test_a_gone_authors_entry_is_dropped_at_once_unless_an_applier_serves_it(coordinator_client, fake_clock):
    client = coordinator_client
    run_id, a, b, c = round_1_closed_with_a_and_b(client, fake_clock)
    assert b.post(f"/v1/runs/{run_id}/leave", {"reason": "power cut"}).status_code == 200
    # a applied round 1 (it fetched b's packet and serves its copy): c's report does not drop b at once.
    assert a.applied(run_id, 1, D1).status_code == 200
    held = report_missing(c, run_id, 1, b).json()
    assert held["manifest_version"] == 1 and held["pending"] == [b.peer_id]
    # The same without the applier: a fresh round 2 where a and b submitted, b left, nobody applied.
    assert (
        a.submit(run_id, 2).status_code == 200
        and b.join(run_id).status_code == 200
        and b.submit(run_id, 2).status_code == 200
    )
    fake_clock.advance(DEADLINE_S + 1)
    tick(client)
    assert round_of(client, run_id, 2)["state"] == "closed"
    assert b.post(f"/v1/runs/{run_id}/leave", {"reason": "power cut"}).status_code == 200
    dropped = report_missing(c, run_id, 2, b).json()
    assert dropped["manifest_version"] == 2 and "its author is not live (left)" in dropped["dropped"][b.peer_id]


def test_an_author_that_lost_its_packet_keeps_its_entry_while_an_applier_serves_it(coordinator_client, fake_clock):
    client = coordinator_client
    run_id, a, b, c = round_1_closed_with_a_and_b(client, fake_clock)
    assert a.applied(run_id, 1, D1).status_code == 200  # a fetched b's packet: it serves a copy
    held = report_missing(b, run_id, 1, lost_own=True).json()
    assert held["manifest_version"] == 1 and held["pending"] == [b.peer_id]
    # The applier says it cannot serve it after all (it restarted too): nobody holds a copy now.
    dropped = report_missing(a, run_id, 1, b).json()
    assert dropped["manifest_version"] == 2 and "said it lost" in dropped["dropped"][b.peer_id]


def test_reports_that_name_nothing_or_oneself_are_refused(coordinator_client, fake_clock):
    client = coordinator_client
    run_id, a, b, c = round_1_closed_with_a_and_b(client, fake_clock)
    for nothing in ({"peer_ids": []}, {}, {"peer_ids": [], "lost_own": False}):
        empty = a.post(f"/v1/runs/{run_id}/rounds/1/missing", nothing)
        assert empty.status_code == 422 and error_of(empty) == "invalid_request" and "lost_own" in empty.text
    assert error_of(report_missing(a, run_id, 1, a)) == "invalid_request"
    assert error_of(report_missing(a, run_id, 1, a, lost_own=True)) == "invalid_request"
    assert a.post(f"/v1/runs/{run_id}/rounds/1/missing", {"lost_own": "yes"}).status_code == 422
    assert round_of(client, run_id, 1)["manifest_version"] == 1


def test_empty_rounds_take_their_starts_agreed_digest_when_it_comes(coordinator_client, fake_clock):
    client = coordinator_client
    run_id, a, b, c = round_1_closed_with_a_and_b(client, fake_clock)
    for peer in (a, b, c):  # alive, training nothing
        peer.heartbeat(run_id, 2)
    for _ in range(2):  # rounds 2 and 3: nobody submitted; each closed at its deadline (at the next tick)
        fake_clock.advance(DEADLINE_S + 1)
        tick(client)
    history = history_of(client, run_id)
    assert history[2]["num_contributors"] == 0 and history[3]["num_contributors"] == 0
    assert history[1]["agreed_digest"] is None
    assert history[2]["agreed_digest"] is None and history[3]["agreed_digest"] is None, (
        "their start (round 1's result) is not agreed yet"
    )
    for peer in (a, b):
        assert peer.applied(run_id, 1, D1).status_code == 200
    history = history_of(client, run_id)
    assert [history[r]["agreed_digest"] for r in (1, 2, 3)] == [D1, D1, D1]
    assert [history[r]["majority_digest"] for r in (2, 3)] == [D1, D1]
    assert not history[2]["provisional"] and not history[3]["provisional"]
    assert recovery.agreed_start(storage_of(client), run_id, 4) == D1


def test_an_empty_round_after_an_agreed_one_is_agreed_when_it_closes(coordinator_client, fake_clock):
    client = coordinator_client
    run_id = create_run(
        client,
        {
            "membership.min_peers": 2,
            "membership.heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S,
            "deadline": {"kind": "fixed", "round_timeout_s": DEADLINE_S},
        },
    )
    a, b = peers_for(client, fake_clock, run_id, 2)
    for peer in (a, b):
        assert peer.submit(run_id, 0).status_code == 200
    for peer in (a, b):
        assert peer.applied(run_id, 0, D0).status_code == 200
    fake_clock.advance(DEADLINE_S + 1)  # round 1 closes empty, its start already agreed
    tick(client)
    view = round_of(client, run_id, 1)
    assert view["state"] == "closed" and view["manifest"] == []
    assert view["agreed_digest"] == D0 and view["majority_digest"] == D0
    # A report on it is no vote (no packet of the reporter's in it): the agreed digest stays.
    answer = b.applied(run_id, 1, D2).json()
    assert answer["vote"] is False and answer["agreed_digest"] == D0 and not answer["agrees"]
    assert round_of(client, run_id, 1)["agreed_digest"] == D0


def test_an_empty_round_0_has_no_agreed_digest(coordinator_client, fake_clock):
    """Round 0 starts from the seeded initialisation, whose digest nobody recorded."""
    client = coordinator_client
    run_id = create_run(
        client,
        {
            "membership.min_peers": 2,
            "membership.heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S,
            "deadline": {"kind": "fixed", "round_timeout_s": DEADLINE_S},
        },
    )
    a, b = peers_for(client, fake_clock, run_id, 2)
    fake_clock.advance(DEADLINE_S + 1)
    for peer in (a, b):
        peer.heartbeat(run_id, 1)
    fake_clock.advance(DEADLINE_S + 1)
    tick(client)
    history = history_of(client, run_id)
    assert [history[r]["num_contributors"] for r in (0, 1)] == [0, 0]
    assert [history[r]["agreed_digest"] for r in (0, 1)] == [None, None]
    assert [history[r]["majority_digest"] for r in (0, 1)] == [None, None]


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
    before = status_of(client, run_id)["stuck"]
    for bad in ("x" * 201, "line\nbreak", "\x1b[31mred", "tab\there", "", "caf\u00e9", "\u202eevil", 42, ["x"]):
        refused = a.post(f"/v1/runs/{run_id}/heartbeat", {"round": 2, "state": "stuck", "detail": bad})
        assert refused.status_code == 422 and error_of(refused) == "invalid_request", bad
    status = status_of(client, run_id)
    assert status["stuck"] == before, "a refused heartbeat changes nothing"
    assert {p["peer_id"]: p["detail"] for p in status["peers"]}[a.peer_id] == line
    longest = a.post(f"/v1/runs/{run_id}/heartbeat", {"round": 2, "state": "stuck", "detail": "x" * 200})
    assert longest.status_code == 200
    a.heartbeat(run_id, 2)
    c.heartbeat(run_id, 2)
    status = status_of(client, run_id)
    assert status["stuck"] is None and all(p["detail"] is None for p in status["peers"])


def test_a_submission_or_an_applied_report_clears_the_stuck_line(coordinator_client, fake_clock):
    client = coordinator_client
    run_id, a, b, c = round_1_closed_with_a_and_b(client, fake_clock)
    for peer in (a, b):
        assert (
            peer.post(
                f"/v1/runs/{run_id}/heartbeat", {"round": 2, "state": "stuck", "detail": "round 1: waiting"}
            ).status_code
            == 200
        )
    assert a.submit(run_id, 2).status_code == 200
    assert b.applied(run_id, 1, D1).status_code == 200
    status = status_of(client, run_id)
    assert status["stuck"] is None and all(p["detail"] is None for p in status["peers"])


def test_a_database_from_before_detail_gains_the_column(tmp_path):
    """Migration 11 on a SQLite file at version 10 with a peer in it: the peer reads back, detail NULL."""
    db_path = tmp_path / "old.db"
    with closing(sqlite3.connect(db_path)) as conn, conn:  # closed after its transaction commits
        conn.execute(CREATE_MIGRATIONS_TABLE)
        for version, statements in MIGRATIONS:
            if version > 10:
                break
            for statement in statements:
                conn.execute(statement)
            conn.execute("INSERT INTO schema_migrations (version, applied_at) VALUES (?, 0)", (version,))
        conn.execute(
            "INSERT INTO runs (run_id, name, config_json, join_token_hashes, state, created_at, current_round)"
            " VALUES ('run-old', 'old', '{}', '[]', 'running', 0, 0)"
        )
        columns = [row[1] for row in conn.execute("PRAGMA table_info(peers)")]
        assert "detail" not in columns
        values = {name: 0 for name in columns} | {
            "run_id": "run-old",
            "peer_id": "p" + "0" * 16,
            "status": "live",
            "activity": "stuck",
            "listen_multiaddrs": "[]",
        }
        conn.execute(
            f"INSERT INTO peers ({', '.join(values)}) VALUES ({', '.join('?' for _ in values)})", tuple(values.values())
        )
    storage = open_storage(f"sqlite:///{db_path}")
    try:
        assert storage.db.schema_version() == MIGRATIONS[-1][0]
        (peer,) = storage.list_peers("run-old")
        assert peer.activity == "stuck" and peer.detail is None
    finally:
        storage.close()


def test_a_round_nobody_got_past_takes_reports_however_old(coordinator_client, fake_clock):
    """The swarm died after round 1 closed and stayed away for more rounds than the report window,
    but less than the heartbeat time-out: the rounds after 1 closed empty and nothing was agreed
    since round 0. Round 1's lost entries are still taken (there is no later state to catch up to),
    and amending it empty lets every round after it agree on round 0's state."""
    client = coordinator_client
    run_id, a, b, c = round_1_closed_with_a_and_b(client, fake_clock, heartbeat_timeout_s=3600.0)
    # Round 2 waits for round 1's contributors, silent yet not timed out, as long as a hold may last
    # (coordinator/rules/rounds.py, "Held for the previous round"); the empty rounds after it do not.
    held_s = 2 * DEADLINE_S + ExchangeSection().missing_grace_s + rounds.HELD_FETCH_S
    for _ in range(MISSING_REPORT_ROUNDS + 2):
        fake_clock.advance(held_s + 1)
        tick(client)  # the coordinator's clock closes the round past its deadline
    history = history_of(client, run_id)
    assert max(history) >= 1 + MISSING_REPORT_ROUNDS + 1 and all(
        h["agreed_digest"] is None for r, h in history.items() if r >= 1
    )
    for author in (a, b):
        answer = report_missing(author, run_id, 1, lost_own=True)
        assert answer.status_code == 200, answer.text
    history = history_of(client, run_id)
    assert all(h["agreed_digest"] == D0 for h in history.values()), "round 1 emptied: every later round keeps D0"


def test_a_round_the_swarm_went_on_from_keeps_its_entries(coordinator_client, fake_clock):
    """Rounds 1 and 2 were applied and agreed by a and b, whose packets they hold; then both left.
    c, behind, reports b's round-1 packet missing: nobody live serves it, but round 2 was agreed on
    round 1's state, so dropping it would rewrite the history under round 2. The report is refused
    (round_too_old: c catches up from a snapshot) and round 1 keeps its manifest and digest."""
    client = coordinator_client
    run_id, a, b, c = round_1_closed_with_a_and_b(client, fake_clock)
    for peer in (a, b):
        assert peer.applied(run_id, 1, D1).status_code == 200
    assert a.submit(run_id, 2).status_code == 200 and b.submit(run_id, 2).status_code == 200
    fake_clock.advance(DEADLINE_S + 1)
    tick(client)
    for peer in (a, b):
        assert peer.applied(run_id, 2, D2).status_code == 200
    assert round_of(client, run_id, 2)["agreed_digest"] == D2
    for peer in (a, b):
        assert peer.post(f"/v1/runs/{run_id}/leave", {"reason": "done"}).status_code == 200

    refused = report_missing(c, run_id, 1, b)
    assert error_of(refused) == "round_too_old" and "round 2 was agreed" in refused.text, refused.text
    for _ in range(3):  # past the drop grace (missing_grace_s), c alive throughout
        fake_clock.advance(DEADLINE_S)
        assert c.heartbeat(run_id, 1).status_code == 200
        tick(client)  # the tick applies the drop rules too: nothing is due
    view = round_of(client, run_id, 1)
    assert view["manifest_version"] == 1 and view["agreed_digest"] == D1
    assert [e["peer_id"] for e in view["manifest"]] == sorted([a.peer_id, b.peer_id])
    # A round the swarm has not gone on from still takes the report: round 2 (nothing after it).
    answer = report_missing(c, run_id, 2, b)
    assert answer.status_code == 200, answer.text


def test_empty_rounds_after_an_amended_round_drop_its_old_result(coordinator_client, fake_clock):
    """Round 1 was agreed (D1) by a and b, round 2 closed empty and took D1 as its own; then a and
    b left. c's report drops b's round-1 packet (nobody live serves it): round 1 votes again on its
    new version, and round 2 no longer claims D1, nor does round 3 start from it."""
    client = coordinator_client
    run_id, a, b, c = round_1_closed_with_a_and_b(client, fake_clock)
    for peer in (a, b):
        assert peer.applied(run_id, 1, D1).status_code == 200
    fake_clock.advance(DEADLINE_S + 1)  # round 2 closes with no packet
    assert c.heartbeat(run_id, 1).status_code == 200
    tick(client)
    assert round_of(client, run_id, 2)["manifest"] == [] and round_of(client, run_id, 2)["agreed_digest"] == D1
    for peer in (a, b):
        assert peer.post(f"/v1/runs/{run_id}/leave", {"reason": "done"}).status_code == 200

    dropped = report_missing(c, run_id, 1, b).json()
    assert dropped["manifest_version"] == 2 and b.peer_id in dropped["dropped"]
    assert round_of(client, run_id, 1)["agreed_digest"] is None  # a new vote on version 2
    assert round_of(client, run_id, 2)["agreed_digest"] is None, "round 2 still claims round 1's old result"
    assert recovery.agreed_start(storage_of(client), run_id, 3) is None
