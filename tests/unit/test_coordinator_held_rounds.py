"""Held for the previous round (coordinator/rules/rounds.py), in process with a fake clock: a round
at its deadline waits while most of the previous round's live contributors still work on an
earlier round, gives them a round's time once they are back, and never waits past its bound, for
a minority, or for peers gone silent. The attack it stops, with real processes:
tests/integration/test_held_rounds.py."""

from __future__ import annotations

import pytest

from coordinator.rules import rounds
from tests.fixtures.coordinator import create_run
from tests.unit.test_coordinator_rounds import peers_for, round_of, tick

pytestmark = pytest.mark.timeout(30)

TIMEOUT_S = 10.0  # the rounds' fixed timeout
HEARTBEAT_TIMEOUT_S = 40.0  # heartbeats every 10 s (a quarter of it)
GRACE_S = 5.0  # exchange.missing_grace_s
HOLD_LIMIT_S = 2 * TIMEOUT_S + GRACE_S + rounds.HELD_FETCH_S  # from the round's opening


@pytest.fixture
def round_1_open(coordinator_client, fake_clock):
    """Three peers that all made round 0; round 1 open, its deadline TIMEOUT_S away."""
    client = coordinator_client
    run_id = create_run(
        client,
        {
            "membership.min_peers": 3,
            "membership.heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S,
            "exchange.missing_grace_s": GRACE_S,
            "deadline": {"kind": "fixed", "round_timeout_s": TIMEOUT_S},
        },
    )
    peers = peers_for(client, fake_clock, run_id, 3)
    for peer in peers:
        assert peer.submit(run_id, 0).status_code == 200
    assert round_of(client, run_id, 1)["closed_at"] is None
    return client, run_id, peers


def beat(client, fake_clock, run_id, peers, round_index, state, seconds):
    """`peers` heartbeat `round_index`/`state` every 2 s for `seconds`, the coordinator ticking."""
    for _ in range(int(seconds / 2)):
        fake_clock.advance(2)
        for peer in peers:
            assert peer.heartbeat(run_id, round_index, state).status_code == 200
        tick(client)


def test_a_round_waits_while_most_of_the_last_rounds_peers_still_fetch_it(round_1_open, fake_clock):
    client, run_id, (a, b, c) = round_1_open
    opened = round_of(client, run_id, 1)["opened_at"]
    assert a.submit(run_id, 1).status_code == 200  # a applied round 0 at once; b and c still fetch it
    beat(client, fake_clock, run_id, (a, b, c), 0, "transferring", 2 * TIMEOUT_S)
    held = round_of(client, run_id, 1)
    assert held["closed_at"] is None, "closed on a's packet alone while b and c fetched round 0"
    assert held["deadline"] >= fake_clock() + TIMEOUT_S - rounds.HELD_DEADLINE_STEP_S - 2
    # b and c applied round 0: from the last tick that held the round they have its time to train.
    beat(client, fake_clock, run_id, (b, c), 1, "training", TIMEOUT_S - 4)
    assert round_of(client, run_id, 1)["closed_at"] is None
    assert b.submit(run_id, 1).status_code == 200 and c.submit(run_id, 1).status_code == 200
    closed = round_of(client, run_id, 1)
    assert closed["closed_at"] is not None and len(closed["manifest"]) == 3
    assert closed["closed_at"] - opened > 2 * TIMEOUT_S


def test_a_round_does_not_wait_for_a_minority(round_1_open, fake_clock):
    client, run_id, (a, b, c) = round_1_open
    assert a.submit(run_id, 1).status_code == 200 and b.submit(run_id, 1).status_code == 200
    beat(client, fake_clock, run_id, (c,), 0, "transferring", TIMEOUT_S + 2)
    closed = round_of(client, run_id, 1)
    assert closed["closed_at"] is not None and {e["peer_id"] for e in closed["manifest"]} == {a.peer_id, b.peer_id}


def test_a_hold_ends_at_its_bound(round_1_open, fake_clock):
    client, run_id, (a, b, c) = round_1_open
    opened = round_of(client, run_id, 1)["opened_at"]
    assert a.submit(run_id, 1).status_code == 200
    beat(client, fake_clock, run_id, (a, b, c), 0, "awaiting_amendment", HOLD_LIMIT_S - 2)
    assert round_of(client, run_id, 1)["closed_at"] is None
    beat(client, fake_clock, run_id, (a, b, c), 0, "awaiting_amendment", 4)
    closed = round_of(client, run_id, 1)
    assert closed["closed_at"] is not None and closed["closed_at"] - opened <= HOLD_LIMIT_S + 2
    assert [e["peer_id"] for e in closed["manifest"]] == [a.peer_id]


def test_peers_gone_silent_hold_no_round(round_1_open, fake_clock):
    """b and c said they fetch round 0, then were killed: 2.5 heartbeat periods (25 s) later they
    hold nothing, and the round closes a round timeout after the last tick they held it (35 s),
    before they are marked gone (40 s)."""
    client, run_id, (a, b, c) = round_1_open
    assert a.submit(run_id, 1).status_code == 200
    for peer in (b, c):
        assert peer.heartbeat(run_id, 0, "transferring").status_code == 200
    beat(client, fake_clock, run_id, (a,), 1, "waiting", 24)
    assert round_of(client, run_id, 1)["closed_at"] is None
    beat(client, fake_clock, run_id, (a,), 1, "waiting", 12)
    closed = round_of(client, run_id, 1)
    assert closed["closed_at"] is not None and [e["peer_id"] for e in closed["manifest"]] == [a.peer_id]
    assert {p["status"] for p in client.get(f"/v1/runs/{run_id}/status").json()["peers"]} == {"live"}


def test_peers_back_late_in_the_round_get_a_rounds_time_to_train_it(round_1_open, fake_clock):
    """b and c fetched round 0 for 8 s of round 1's 10 (a withheld packet, a trickling holder):
    back before its deadline, they are owed a round's time from then, not the 2 s left."""
    client, run_id, (a, b, c) = round_1_open
    assert a.submit(run_id, 1).status_code == 200
    beat(client, fake_clock, run_id, (a, b, c), 0, "transferring", 8)
    back = fake_clock()
    for peer in (a, b, c):
        assert peer.applied(run_id, 0, "ab" * 32).status_code == 200
    beat(client, fake_clock, run_id, (b, c), 1, "training", TIMEOUT_S - 2)
    held = round_of(client, run_id, 1)
    assert held["closed_at"] is None and held["deadline"] == pytest.approx(back + TIMEOUT_S, abs=0.5)
    assert b.submit(run_id, 1).status_code == 200 and c.submit(run_id, 1).status_code == 200
    assert len(round_of(client, run_id, 1)["manifest"]) == 3
