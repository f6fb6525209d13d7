"""The adaptive deadline policy follows how long peers took to submit in recent rounds."""

import time

from fastapi.testclient import TestClient

from coordinator.app import create_app
from coordinator.storage import open_storage
from protocol.run_config import RunConfig
from protocol.signing import PeerKey
from tests.fixtures.coordinator import FakeClock, SignedPeer

ADMIN = "a" * 32


def wall_clock() -> FakeClock:
    # Starts at the real time: the peers sign with wall-clock nanosecond nonces (no clock given).
    return FakeClock(start_s=time.time())


def test_adaptive_deadline_tracks_submission_times(tmp_path):
    clock = wall_clock()
    app = create_app(open_storage(f"sqlite:///{tmp_path / 'c.db'}"), ADMIN, clock=clock)
    config = RunConfig(
        name="a",
        model={"preset": "tiny"},
        membership={"min_peers": 2},
        deadline={
            "kind": "adaptive",
            "initial_s": 100.0,
            "quantile": 0.9,
            "margin": 1.5,
            "min_s": 5.0,
            "max_s": 1000.0,
        },
    )
    with TestClient(app) as client:
        run_id = client.post(
            "/v1/runs",
            content=config.model_dump_json(),
            headers={"authorization": f"Bearer {ADMIN}", "content-type": "application/json"},
        ).json()["run_id"]
        peers = [SignedPeer(client, key=PeerKey.from_seed(bytes([i]))) for i in range(2)]
        for peer in peers:
            assert peer.join(run_id).status_code == 200
        client.get(f"/v1/runs/{run_id}/rounds/0?wait_s=0")
        round0 = client.get(f"/v1/runs/{run_id}/rounds/0").json()
        assert round0["deadline"] - round0["opened_at"] == 100.0  # no history yet
        for i, peer in enumerate(peers):  # peers take 10 s and 20 s
            clock.now_s = round0["opened_at"] + 10.0 * (i + 1)
            response = peer.submit(run_id, 0, digest=f"{i:064x}", train_loss=1.0, packet_size_bytes=10)
            assert response.status_code == 200
        round1 = client.get(f"/v1/runs/{run_id}/rounds/1?wait_s=0").json()
        assert round1["state"] == "open"
        assert round1["deadline"] - round1["opened_at"] == 30.0  # 20 s at the 0.9 quantile x 1.5


def test_straggler_is_cut_off_at_the_deadline_and_flagged(tmp_path):
    clock = wall_clock()
    app = create_app(open_storage(f"sqlite:///{tmp_path / 'c.db'}"), ADMIN, clock=clock, tick_s=0.05)
    config = RunConfig(
        name="a",
        model={"preset": "tiny"},
        membership={"min_peers": 2},
        deadline={"kind": "fixed", "round_timeout_s": 30.0},
    )
    with TestClient(app) as client:
        run_id = client.post(
            "/v1/runs",
            content=config.model_dump_json(),
            headers={"authorization": f"Bearer {ADMIN}", "content-type": "application/json"},
        ).json()["run_id"]
        peers = [SignedPeer(client, key=PeerKey.from_seed(bytes([10 + i]))) for i in range(2)]
        for peer in peers:
            assert peer.join(run_id).status_code == 200
        response = peers[0].submit(run_id, 0, digest="ab" * 32, train_loss=1.0, packet_size_bytes=10)
        assert response.status_code == 200
        clock.advance(31.0)  # past the deadline: the tick closes round 0 without the second peer
        view = client.get(f"/v1/runs/{run_id}/rounds/0?wait_s=5").json()
        assert view["state"] == "closed" and [e["peer_id"] for e in view["manifest"]] != []
        assert len(view["manifest"]) == 1
        for peer in peers:  # both still heartbeat-live under the fake clock
            peer.heartbeat(run_id, 1)
        peers = {p["peer_id"]: p for p in client.get(f"/v1/runs/{run_id}/status").json()["peers"]}
        flags = {p["peer_index"]: p["flags"] for p in peers.values()}
        assert flags == {0: [], 1: ["straggler"]}
