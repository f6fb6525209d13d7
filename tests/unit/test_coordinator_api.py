"""Coordinator HTTP API in-process: runs, joins, authentication refusals, error shapes, limits,
status, metrics, the page and the OpenAPI schema. Rounds have their own file."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from protocol.http import NONCE_WINDOW_S, JoinResponse, RunStatus, sign_request
from protocol.signing import PeerKey
from tests.fixtures.coordinator import (
    ADMIN_HEADERS,
    REPO_ROOT,
    SignedPeer,
    create_run,
    error_of,
    run_config,
)

pytestmark = pytest.mark.timeout(30)


def test_create_list_get_close_run(coordinator_client, fake_clock):
    client = coordinator_client
    run_id = create_run(client, {"membership.join_policy": "token", "membership.join_tokens": ["secret-token-1"]})
    runs = client.get("/v1/runs").json()["runs"]
    assert [r["run_id"] for r in runs] == [run_id]
    info = client.get(f"/v1/runs/{run_id}").json()
    assert info["state"] == "waiting" and info["current_round"] == 0
    assert info["config"]["inner"]["steps"] == 15 and info["config"]["outer"]["top_k"] == 64
    assert info["config"]["membership"]["join_tokens"] == [], "join tokens must never be shown"
    closed = client.post(f"/v1/runs/{run_id}/close", headers=ADMIN_HEADERS).json()
    assert closed["state"] == "closed" and closed["closed_at"] is not None
    latecomer = SignedPeer(client, clock=fake_clock)
    assert error_of(latecomer.join(run_id, join_token="secret-token-1")) == "run_closed"
    assert error_of(client.get("/v1/runs/run-nope")) == "run_not_found"


def test_admin_calls_need_the_admin_token(coordinator_client):
    client = coordinator_client
    assert error_of(client.post("/v1/runs", json=run_config())) == "admin_required"
    wrong = {"Authorization": "Bearer not-the-token-at-all"}
    assert error_of(client.post("/v1/runs", json=run_config(), headers=wrong)) == "bad_admin_token"
    run_id = create_run(client)
    assert error_of(client.post(f"/v1/runs/{run_id}/close", headers=wrong)) == "bad_admin_token"


def test_bad_run_configs_are_refused_naming_the_key(coordinator_client):
    client = coordinator_client
    for bad, key in [
        ({"inner.lr": -1.0}, "inner.lr"),
        ({"inner.steps": "15"}, "inner.steps"),  # strict: no string-to-int coercion
        ({"model.preset": "huge"}, "model.preset"),
        ({"surprise": 1}, "surprise"),
        ({"inner_lr": 1e-3}, "inner_lr"),  # the flat layout from before the sections
        ({"deadline": {"kind": "psychic"}}, "deadline"),
        ({"deadline": {"kind": "adaptive", "quantile": 2.0}}, "deadline"),
    ]:
        response = client.post("/v1/runs", json=run_config(bad), headers=ADMIN_HEADERS)
        assert error_of(response) == "invalid_request" and key in response.json()["detail"]
    response = client.post("/v1/runs", json=run_config({"membership.join_policy": "token"}), headers=ADMIN_HEADERS)
    assert error_of(response) == "invalid_config"


def test_join_open_run_gives_identity_shard_and_params(coordinator_client, fake_clock):
    client = coordinator_client
    run_id = create_run(client, {"membership.min_peers": 2, "model.num_data_shards": 3})
    first, second = SignedPeer(client, clock=fake_clock), SignedPeer(client, clock=fake_clock)
    joined = first.join(run_id, listen_multiaddrs=["/ip4/127.0.0.1/tcp/5000"], bandwidth_mbps=900.0)
    assert joined.status_code == 200, joined.text
    body = joined.json()
    assert body["peer_id"] == first.peer_id and body["peer_id"].startswith("p")
    assert (body["peer_index"], body["data_shard"], body["num_shards"]) == (0, 0, 3)
    assert body["run_state"] == "waiting" and body["current_round"] == 0
    assert body["params"] == {"round": 0, "digest": None, "holders": [], "mirror": None}
    assert body["dht_bootstrap"] == ["/ip4/127.0.0.1/tcp/4001/p2p/QmBootstrap"]
    assert body["config"]["name"] == "test-run" and body["heartbeat_interval_s"] == 5.0
    # The node parses answers with the shared models; the strict RunConfig must accept them.
    assert JoinResponse.model_validate(body).config.membership.min_peers == 2
    assert JoinResponse.model_validate_json(joined.content).peer_id == first.peer_id
    second_body = second.join(run_id).json()
    assert second_body["peer_index"] == 1 and second_body["run_state"] == "running"
    # Rejoining with the same key keeps the id, index and shard.
    again = first.join(run_id).json()
    assert (again["peer_id"], again["peer_index"]) == (first.peer_id, 0)


def test_join_token_policy(coordinator_client, fake_clock):
    client = coordinator_client
    hashed = "sha256:" + __import__("hashlib").sha256(b"hashed-token-2").hexdigest()
    run_id = create_run(
        client, {"membership.join_policy": "token", "membership.join_tokens": ["plain-token-1", hashed]}
    )
    peer = SignedPeer(client, clock=fake_clock)
    assert error_of(peer.join(run_id)) == "join_refused"
    assert error_of(peer.join(run_id, join_token="wrong-token")) == "join_refused"
    assert peer.join(run_id, join_token="plain-token-1").status_code == 200
    assert SignedPeer(client, clock=fake_clock).join(run_id, join_token="hashed-token-2").status_code == 200


def test_peer_auth_refusals(coordinator_client, fake_clock):
    client = coordinator_client
    run_id = create_run(client, {"membership.min_peers": 2})
    alice, bob = SignedPeer(client, clock=fake_clock), SignedPeer(client, clock=fake_clock)
    assert alice.join(run_id).status_code == 200 and bob.join(run_id).status_code == 200
    path = f"/v1/runs/{run_id}/heartbeat"
    body = json.dumps({"round": 0, "state": "training"}).encode()
    json_type = {"Content-Type": "application/json"}

    assert error_of(client.post(path, content=body, headers=json_type)) == "unsigned"
    signed = sign_request(alice.key, "POST", path, body, nonce=alice.nonce())
    tampered = body.replace(b"training", b"idle_now")
    assert error_of(client.post(path, content=tampered, headers={**signed, **json_type})) == ("bad_signature")
    # Alice's signature presented as Bob's: a peer cannot act for another.
    as_bob = {**sign_request(alice.key, "POST", path, body, nonce=alice.nonce()), "X-Locoswarm-Peer": bob.peer_id}
    assert error_of(client.post(path, content=body, headers={**as_bob, **json_type})) == ("bad_signature")
    stranger = SignedPeer(client, clock=fake_clock)
    assert error_of(stranger.heartbeat(run_id, 0)) == "unknown_peer"
    # Replay: the same signed request twice.
    fresh = {**sign_request(alice.key, "POST", path, body, nonce=alice.nonce()), **json_type}
    assert client.post(path, content=body, headers=fresh).status_code == 200
    assert error_of(client.post(path, content=body, headers=fresh)) == "replayed_nonce"
    old_nonce = int((fake_clock() - NONCE_WINDOW_S - 5) * 1e9)
    assert error_of(alice.post(path, {"round": 0, "state": "training"}, nonce=old_nonce)) == ("stale_nonce")
    # Submitting for another peer, and joining with a key you do not hold.
    submit = alice.submit(run_id, 0, peer_id=bob.peer_id)
    assert error_of(submit) == "peer_mismatch"
    join_path = f"/v1/runs/{run_id}/join"
    join_body = json.dumps({"public_key": bob.key.public_hex}).encode()
    forged = sign_request(alice.key, "POST", join_path, join_body, nonce=alice.nonce())
    assert error_of(client.post(join_path, content=join_body, headers={**forged, **json_type})) == ("peer_mismatch")
    # A peer of another run is not a member of this one.
    other_run = create_run(client, {"name": "other"})
    assert error_of(alice.heartbeat(other_run, 0)) == "not_member"


def test_malformed_oversized_and_mistyped_requests_are_4xx(coordinator_client, fake_clock):
    client = coordinator_client
    run_id = create_run(client)
    peer = SignedPeer(client, clock=fake_clock)
    peer.join(run_id)
    path = f"/v1/runs/{run_id}/heartbeat"
    for raw in [b"{not json", b"[]", b'{"round": "1", "state": "x"}', b'{"round": -1}', b"null"]:
        headers = {**sign_request(peer.key, "POST", path, raw, nonce=peer.nonce()), "Content-Type": "application/json"}
        assert error_of(client.post(path, content=raw, headers=headers)) in ("malformed_json", "invalid_request")
    huge = b'{"pad": "' + b"x" * (70 * 1024) + b'"}'
    response = client.post(path, content=huge, headers={"Content-Type": "application/json"})
    assert response.status_code == 413 and response.json()["error"] == "body_too_large"
    assert error_of(client.get(f"/v1/runs/{run_id}/rounds/-3")) == "invalid_request"
    assert error_of(client.get(f"/v1/runs/{run_id}/rounds/0?wait_s=999")) == "invalid_request"
    assert error_of(client.get("/v1/runs/BAD%20ID")) == "invalid_request"
    assert error_of(client.delete("/v1/runs")) == "method_not_allowed"
    assert error_of(client.get("/nowhere")) == "not_found"
    assert error_of(peer.submit(run_id, 0, packet_size_bytes=2**41)) == "invalid_request"
    for uplink in (0.0, -5.0, 1e9, "fast"):
        assert error_of(peer.join(run_id, uplink_mbps=uplink)) == "invalid_request"


def test_rate_limit_per_peer(tmp_path, fake_clock):
    from fastapi.testclient import TestClient

    from coordinator.app import create_app
    from coordinator.storage import open_storage
    from tests.fixtures.coordinator import ADMIN_TOKEN

    storage = open_storage(f"sqlite:///{tmp_path / 'c.db'}")
    app = create_app(storage, ADMIN_TOKEN, clock=fake_clock, tick_s=None, rate_per_s=0.001, rate_burst=3)
    with TestClient(app) as client:
        run_id = create_run(client)
        peer, other = SignedPeer(client, clock=fake_clock), SignedPeer(client, clock=fake_clock)
        assert peer.join(run_id).status_code == 200
        codes = [peer.heartbeat(run_id, 0).status_code for _ in range(4)]
        assert codes[:2] == [200, 200] and codes[-1] == 429
        assert other.join(run_id).status_code == 200, "limits are per peer"
    storage.close()


def test_status_metrics_health_and_page(coordinator_client, fake_clock):
    client = coordinator_client
    run_id = create_run(client, {"membership.min_peers": 1})
    peer = SignedPeer(client, clock=fake_clock)
    peer.join(run_id, bandwidth_mbps=250.0, uplink_mbps=40.0)
    peer.submit(run_id, 0, train_loss=4.25)
    status = client.get(f"/v1/runs/{run_id}/status").json()
    assert status["run"]["run_id"] == run_id and status["current_round"]["round"] == 1
    assert RunStatus.model_validate(status).peers[0].peer_id == peer.peer_id
    [row] = status["peers"]
    assert (row["peer_id"], row["status"], row["last_loss"], row["bandwidth_mbps"], row["uplink_mbps"]) == (
        peer.peer_id,
        "live",
        4.25,
        250.0,
        40.0,
    )
    [first] = status["history"]
    assert first["num_contributors"] == 1 and first["mean_loss"] == 4.25
    members_only = client.get(f"/v1/runs/{run_id}/status", params={"history": 0}).json()
    assert members_only["history"] == [] and members_only["peers"] == status["peers"]
    for bad in (-1, 1001, "all"):
        assert error_of(client.get(f"/v1/runs/{run_id}/status", params={"history": bad})) == "invalid_request"
    assert client.get("/healthz").json() == {"status": "ok", "server_time": fake_clock()}
    assert client.get("/readyz").json() == {"status": "ready"}
    metrics = client.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    assert f'locoswarm_run_current_round{{run="{run_id}"}} 1.0' in metrics.text
    assert f'locoswarm_last_round_mean_loss{{run="{run_id}"}} 4.25' in metrics.text
    assert "# TYPE locoswarm_http_responses_total counter" in metrics.text
    # One process on SQLite leads its cluster of one; nobody is parked on a round.
    assert "\nlocoswarm_coordinator_leader 1.0\n" in metrics.text
    assert "\nlocoswarm_long_polls_waiting 0.0\n" in metrics.text
    page = client.get("/")
    assert page.headers["content-type"].startswith("text/html")
    assert json.dumps(run_id) in page.text and 'id="plot-loss"' in page.text and 'id="run-picker"' in page.text
    assert "http://" not in page.text.replace("http://www.w3.org/2000/svg", ""), "no externals"
    assert '"run-other"' in client.get("/?run=run-other").text


def test_openapi_lists_every_route_with_models(coordinator_client):
    schema = coordinator_client.get("/openapi.json").json()
    expected = {
        ("post", "/v1/runs"): ("RunConfig", "RunCreated"),
        ("get", "/v1/runs"): (None, "RunList"),
        ("get", "/v1/runs/{run_id}"): (None, "RunInfo"),
        ("post", "/v1/runs/{run_id}/close"): (None, "RunInfo"),
        ("post", "/v1/runs/{run_id}/join"): ("JoinRequest", "JoinResponse"),
        ("post", "/v1/runs/{run_id}/heartbeat"): ("HeartbeatRequest", "HeartbeatResponse"),
        ("post", "/v1/runs/{run_id}/leave"): ("LeaveRequest", "LeaveResponse"),
        ("post", "/v1/runs/{run_id}/rounds/{round_index}/submit"): ("SubmitRequest", "SubmitResponse"),
        ("get", "/v1/runs/{run_id}/rounds/{round_index}"): (None, "RoundView"),
        ("post", "/v1/runs/{run_id}/rounds/{round_index}/applied"): ("AppliedRequest", "AppliedResponse"),
        ("get", "/v1/runs/{run_id}/status"): (None, "RunStatus"),
        ("get", "/healthz"): (None, "Health"),
        ("get", "/readyz"): (None, "Ready"),
    }
    for (method, path), (request_model, response_model) in expected.items():
        operation = schema["paths"][path][method]
        ok = json.dumps(operation["responses"]["200"])
        assert f"#/components/schemas/{response_model}" in ok, (path, ok)
        if request_model:
            assert f"#/components/schemas/{request_model}" in json.dumps(operation["requestBody"])
            assert "#/components/schemas/ErrorBody" in json.dumps(operation["responses"]["409"])
            assert "#/components/schemas/ErrorBody" in json.dumps(operation["responses"]["503"])
    assert "#/components/schemas/ErrorBody" in json.dumps(schema["paths"]["/readyz"]["get"]["responses"]["503"])
    assert {"/metrics", "/"} <= set(schema["paths"])
    schemas = schema["components"]["schemas"]
    config_fields = schemas["RunConfig"]["properties"]
    assert all(field.get("description") for field in config_fields.values())
    for section in ("ModelSection", "InnerSection", "OuterSection", "ExchangeSection", "MembershipSection"):
        assert all(field.get("description") for field in schemas[section]["properties"].values()), section


def test_coordinator_never_imports_torch():
    code = (
        "import sys; import coordinator.app, coordinator.cli, coordinator.service;"
        " assert 'torch' not in sys.modules, 'torch imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_peer_id_is_stable_per_key():
    from protocol.http import peer_id_from_public_key

    key = PeerKey.from_seed(b"seed")
    assert peer_id_from_public_key(key.public_bytes) == peer_id_from_public_key(PeerKey.from_seed(b"seed").public_bytes)
    assert len(peer_id_from_public_key(key.public_bytes)) == 17


def test_heartbeat_inner_step_shows_in_the_status(coordinator_client, fake_clock):
    client = coordinator_client
    run_id = create_run(
        client, {"membership.min_peers": 2, "inner.steps": 10, "inner.batch_size": 4, "inner.seq_len": 64}
    )
    first, second = SignedPeer(client, clock=fake_clock), SignedPeer(client, clock=fake_clock)
    first.join(run_id), second.join(run_id)

    def beat(peer, **fields):
        return peer.post(f"/v1/runs/{run_id}/heartbeat", {"round": 0, "state": "training", **fields})

    assert beat(first, inner_step=7).status_code == 200
    assert beat(second).status_code == 200  # an older node: no inner_step
    steps = {p["peer_id"]: p["inner_step"] for p in client.get(f"/v1/runs/{run_id}/status").json()["peers"]}
    assert steps == {first.peer_id: 7, second.peer_id: None}
    for bad in (-1, 100_001, 2.5, "7"):
        assert error_of(beat(first, inner_step=bad)) == "invalid_request"
    assert beat(first).status_code == 200, "a beat without a step clears the last one"
    assert client.get(f"/v1/runs/{run_id}/status").json()["peers"][0]["inner_step"] is None


def test_round_summaries_count_tokens_and_packet_bytes(coordinator_client, fake_clock):
    client = coordinator_client
    run_id = create_run(
        client,
        {
            "membership.min_peers": 2,
            "inner.steps": 10,
            "inner.batch_size": 4,
            "inner.seq_len": 64,
            "membership.heartbeat_timeout_s": 60.0,
        },
    )
    first, second = SignedPeer(client, clock=fake_clock), SignedPeer(client, clock=fake_clock)
    first.join(run_id), second.join(run_id)
    first.submit(run_id, 0, packet_size_bytes=1000)
    second.submit(run_id, 0, packet_size_bytes=3000)  # the last expected packet closes round 0
    first.submit(run_id, 1, packet_size_bytes=500)
    fake_clock.advance(31.0)  # round 1 closes at its deadline with one packet
    client.app.state.service.tick()  # the coordinator's own clock (these apps run no background tick)
    history = client.get(f"/v1/runs/{run_id}/status").json()["history"]
    assert [(h["round"], h["tokens"], h["packet_bytes"]) for h in history][:2] == [
        (0, 2 * 10 * 4 * 64, 4000),
        (1, 1 * 10 * 4 * 64, 500),
    ]


def test_page_and_status_default_to_the_live_run(coordinator_client, fake_clock):
    client = coordinator_client
    live = create_run(client, {"name": "long"})
    fake_clock.advance(1.0)  # runs are ordered by creation time
    closed = create_run(client, {"name": "quick"})
    client.post(f"/v1/runs/{closed}/close", headers=ADMIN_HEADERS)
    page = client.get("/").text
    assert json.dumps(live) in page and json.dumps(closed) not in page
    client.post(f"/v1/runs/{live}/close", headers=ADMIN_HEADERS)
    assert json.dumps(closed) in client.get("/").text, "with none live: the newest"
