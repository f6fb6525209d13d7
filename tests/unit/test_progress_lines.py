"""The demo's progress line (node/cli/demo.py `progress_line`) says what is true at each moment.

Each status is the real coordinator's status JSON (the app in-process with a fake clock, peers
simulated by `SignedPeer`), taken where the line used to mislead: once the run finished (the open
round is null: it read `round ?/4 submitted 0/0`), and right after a round closed on its last
packet (the next round's `submitted 0/3` beside three peers saying "submitted").
"""

from __future__ import annotations

import pytest

from node.cli.demo import progress_line
from tests.fixtures.coordinator import ADMIN_HEADERS, SignedPeer, create_run

pytestmark = pytest.mark.timeout(60)

NUM_PEERS = 3
NUM_ROUNDS = 2
PARAMS_DIGEST = "ab" * 32


@pytest.fixture
def swarm(coordinator_client, fake_clock):
    """(client, run_id, peers): a run of NUM_ROUNDS rounds that starts once NUM_PEERS peers joined;
    none has joined yet."""
    run_id = create_run(coordinator_client, {"membership.min_peers": NUM_PEERS, "max_rounds": NUM_ROUNDS})
    peers = [SignedPeer(coordinator_client, clock=fake_clock) for _ in range(NUM_PEERS)]
    return coordinator_client, run_id, peers


def status_of(client, run_id: str) -> dict:
    return client.get(f"/v1/runs/{run_id}/status").json()


def join_all(client, run_id: str, peers: list[SignedPeer]) -> None:
    for peer in peers:
        assert peer.join(run_id).status_code == 200


def submit_all(run_id: str, peers: list[SignedPeer], round_index: int, fake_clock) -> None:
    for peer in peers:
        fake_clock.advance(1.0)
        assert peer.submit(run_id, round_index).status_code == 200


def apply(run_id: str, peers: list[SignedPeer], round_index: int, fake_clock) -> None:
    for peer in peers:
        fake_clock.advance(1.0)
        assert peer.applied(run_id, round_index, PARAMS_DIGEST).status_code == 200


def activities(line: str) -> dict[str, str]:
    """The peers part of a progress line: peer id prefix -> what it says of itself."""
    return dict(part.split(":", 1) for part in line.split(" | ", 1)[1].split(", "))


def assert_counts_match_peers(line: str, status: dict) -> None:
    """A peer that says "submitted" of the open round (no " rN" after it) is one the count holds."""
    unmarked = sum(activity == "submitted" for activity in activities(line).values())
    current = status["current_round"]
    assert unmarked == (current["num_submitted"] if current is not None else 0), line


def test_waiting_for_peers(swarm):
    client, run_id, peers = swarm
    assert peers[0].join(run_id).status_code == 200
    line = progress_line(status_of(client, run_id), NUM_ROUNDS)
    assert line == (
        f"waiting for peers: 1 live of the {NUM_PEERS} the run needs to start | {peers[0].peer_id[:7]}:joining"
    )


def test_mid_round_counts_the_open_rounds_packets(swarm, fake_clock):
    client, run_id, peers = swarm
    join_all(client, run_id, peers)
    peers[1].post(f"/v1/runs/{run_id}/heartbeat", {"round": 0, "state": "training", "inner_step": 7})
    submit_all(run_id, peers[:1], 0, fake_clock)
    status = status_of(client, run_id)
    line = progress_line(status, NUM_ROUNDS)
    assert line.startswith("round 0 of 0-1 open: 1/3 submitted | "), line
    assert activities(line) == {
        peers[0].peer_id[:7]: "submitted",
        peers[1].peer_id[:7]: "training 7/15",
        peers[2].peer_id[:7]: "joining",
    }
    assert_counts_match_peers(line, status)


def test_a_round_whose_peers_all_submitted_is_named_beside_the_next_ones_count(swarm, fake_clock):
    client, run_id, peers = swarm
    join_all(client, run_id, peers)
    submit_all(run_id, peers, 0, fake_clock)  # round 0 closes on its last expected packet; round 1 opens
    status = status_of(client, run_id)
    line = progress_line(status, NUM_ROUNDS)
    assert status["current_round"]["num_submitted"] == 0
    assert line.startswith(
        "round 1 of 0-1 open: 0/3 submitted; round 0: 3 contributors, 0 applied, mean loss 3.000 | "
    ), line
    assert set(activities(line).values()) == {"submitted r0"}
    assert_counts_match_peers(line, status)

    apply(run_id, peers, 0, fake_clock)
    line = progress_line(status_of(client, run_id), NUM_ROUNDS)
    assert "round 0: 3 contributors, 3 applied" in line
    assert set(activities(line).values()) == {"applied r0"}  # applied round 0, not (yet) working on 1


def test_a_finished_run_says_so_with_its_last_rounds_figures(swarm, fake_clock):
    client, run_id, peers = swarm
    join_all(client, run_id, peers)
    submit_all(run_id, peers, 0, fake_clock)
    apply(run_id, peers, 0, fake_clock)
    submit_all(run_id, peers, 1, fake_clock)
    apply(run_id, peers[:2], 1, fake_clock)
    peers[2].post(f"/v1/runs/{run_id}/heartbeat", {"round": 1, "state": "serving"})
    status = status_of(client, run_id)
    assert status["run"]["state"] == "finished" and status["current_round"] is None
    line = progress_line(status, NUM_ROUNDS)
    assert line.startswith("run finished after 2 rounds; round 1: 3 contributors, 2 applied, mean loss 3.000 | "), line
    assert activities(line) == {
        peers[0].peer_id[:7]: "applied r1",
        peers[1].peer_id[:7]: "applied r1",
        peers[2].peer_id[:7]: "serving r1",
    }
    assert "?" not in line and "0/0" not in line
    assert_counts_match_peers(line, status)


def test_a_run_whose_peers_all_stopped_says_it_is_paused(swarm, fake_clock):
    client, run_id, peers = swarm
    join_all(client, run_id, peers)
    submit_all(run_id, peers, 0, fake_clock)
    fake_clock.advance(100.0)  # past the heartbeat timeout: every peer is gone
    client.app.state.service.tick()  # the coordinator's own clock (this app runs no background tick)
    status = status_of(client, run_id)
    line = progress_line(status, NUM_ROUNDS)
    assert line == f"run paused: {status['recovery']['message']}; round 0: 3 contributors, 0 applied, mean loss 3.000"
    assert "round 1" in status["recovery"]["message"]


def test_a_run_closed_by_its_operator_mid_round(swarm, fake_clock):
    client, run_id, peers = swarm
    join_all(client, run_id, peers)
    submit_all(run_id, peers, 0, fake_clock)
    submit_all(run_id, peers[:1], 1, fake_clock)
    assert client.post(f"/v1/runs/{run_id}/close", headers=ADMIN_HEADERS).status_code == 200
    line = progress_line(status_of(client, run_id), NUM_ROUNDS)
    # Round 1 closed with the one packet it had: the run's last round.
    assert line.startswith("run closed after 2 rounds; round 1: 1 contributor, 0 applied"), line


def test_a_run_closed_before_any_peer_came(swarm):
    client, run_id, _ = swarm
    assert client.post(f"/v1/runs/{run_id}/close", headers=ADMIN_HEADERS).status_code == 200
    assert progress_line(status_of(client, run_id), NUM_ROUNDS) == "run closed before any round closed"
