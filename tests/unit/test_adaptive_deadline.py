"""The adaptive deadline policy follows how long peers took to submit in recent rounds."""

import time

from fastapi.testclient import TestClient

from coordinator.app import create_app
from coordinator.storage import open_storage
from protocol.api import RunConfig, sign_request
from protocol.signing import PeerKey

ADMIN = "a" * 32


class Clock:
    def __init__(self):
        self.now = time.time()  # request nonces are wall-clock nanoseconds

    def __call__(self):
        return self.now


def signed_post(client, key, path, body):
    import json

    raw = json.dumps(body).encode()
    return client.post(path, content=raw, headers={"content-type": "application/json",
                                                   **sign_request(key, "POST", path, raw)})


def test_adaptive_deadline_tracks_submission_times(tmp_path):
    clock = Clock()
    app = create_app(open_storage(f"sqlite:///{tmp_path / 'c.db'}"), ADMIN, clock=clock)
    config = RunConfig(name="a", preset="tiny", min_peers=2, deadline_policy={
        "kind": "adaptive", "initial_s": 100.0, "quantile": 0.9, "margin": 1.5, "min_s": 5.0, "max_s": 1000.0})
    with TestClient(app) as client:
        run_id = client.post("/v1/runs", content=config.model_dump_json(),
                             headers={"authorization": f"Bearer {ADMIN}", "content-type": "application/json"}
                             ).json()["run_id"]
        keys = [PeerKey.from_seed(bytes([i])) for i in range(2)]
        for key in keys:
            assert signed_post(client, key, f"/v1/runs/{run_id}/join", {"public_key": key.public_hex}).status_code == 200
        client.get(f"/v1/runs/{run_id}/rounds/0?wait_s=0")
        round0 = client.get(f"/v1/runs/{run_id}/rounds/0").json()
        assert round0["deadline"] - round0["opened_at"] == 100.0  # no history yet
        for i, key in enumerate(keys):  # peers take 10 s and 20 s
            clock.now = round0["opened_at"] + 10.0 * (i + 1)
            body = {"packet_digest": f"{i:064x}", "packet_size_bytes": 10, "train_loss": 1.0}
            assert signed_post(client, key, f"/v1/runs/{run_id}/rounds/0/submit", body).status_code == 200
        round1 = client.get(f"/v1/runs/{run_id}/rounds/1?wait_s=0").json()
        assert round1["state"] == "open"
        assert round1["deadline"] - round1["opened_at"] == 30.0  # 20 s at the 0.9 quantile x 1.5


def test_straggler_is_cut_off_at_the_deadline_and_flagged(tmp_path):
    clock = Clock()
    app = create_app(open_storage(f"sqlite:///{tmp_path / 'c.db'}"), ADMIN, clock=clock, tick_s=0.05)
    config = RunConfig(name="a", preset="tiny", min_peers=2, deadline_policy={"kind": "fixed", "round_timeout_s": 30.0})
    with TestClient(app) as client:
        run_id = client.post("/v1/runs", content=config.model_dump_json(),
                             headers={"authorization": f"Bearer {ADMIN}", "content-type": "application/json"}
                             ).json()["run_id"]
        keys = [PeerKey.from_seed(bytes([10 + i])) for i in range(2)]
        for key in keys:
            assert signed_post(client, key, f"/v1/runs/{run_id}/join", {"public_key": key.public_hex}).status_code == 200
        body = {"packet_digest": "ab" * 32, "packet_size_bytes": 10, "train_loss": 1.0}
        assert signed_post(client, keys[0], f"/v1/runs/{run_id}/rounds/0/submit", body).status_code == 200
        clock.now += 31.0  # past the deadline: the tick closes round 0 without the second peer
        view = client.get(f"/v1/runs/{run_id}/rounds/0?wait_s=5").json()
        assert view["state"] == "closed" and [e["peer_id"] for e in view["manifest"]] != []
        assert len(view["manifest"]) == 1
        for key in keys:  # both still heartbeat-live under the fake clock
            signed_post(client, key, f"/v1/runs/{run_id}/heartbeat", {"round": 1, "state": "training"})
        peers = {p["peer_id"]: p for p in client.get(f"/v1/runs/{run_id}/status").json()["peers"]}
        flags = {p["peer_index"]: p["flags"] for p in peers.values()}
        assert flags == {0: [], 1: ["straggler"]}
