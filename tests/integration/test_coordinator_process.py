"""A real `coordinator serve` process on 127.0.0.1 with a real SQLite file: SIGKILL and restart,
32 peers submitting at once, and the operator commands against it."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time

import httpx
import pytest

from protocol.http import sign_request
from protocol.signing import PeerKey
from tests.fixtures.coordinator import (
    ADMIN_TOKEN,
    REPO_ROOT,
    SignedPeer,
    create_run,
)

pytestmark = [pytest.mark.timeout(90), pytest.mark.slow]


def test_sigkill_and_restart_lose_nothing(start_coordinator, tmp_path):
    db_path = tmp_path / "coordinator.db"
    first = start_coordinator(db_path)
    with httpx.Client(base_url=first.url, timeout=10) as client:
        run_id = create_run(
            client,
            {
                "membership.min_peers": 2,
                "membership.heartbeat_timeout_s": 60.0,
                "deadline": {"kind": "fixed", "round_timeout_s": 120.0},
            },
        )
        a, b = SignedPeer(client), SignedPeer(client)
        assert a.join(run_id).status_code == 200 and b.join(run_id).status_code == 200
        assert a.submit(run_id, 0).status_code == 200
        assert b.submit(run_id, 0).status_code == 200
        assert a.applied(run_id, 0, "ee" * 32).status_code == 200
        assert b.applied(run_id, 0, "ee" * 32).status_code == 200  # both contributors: agreed
        assert a.submit(run_id, 1).status_code == 200
        manifest_0 = client.get(f"/v1/runs/{run_id}/rounds/0").json()["manifest"]
        open_1 = client.get(f"/v1/runs/{run_id}/rounds/1").json()
        assert len(manifest_0) == 2 and open_1["state"] == "open"
        # A request we will replay against the restarted process.
        path = f"/v1/runs/{run_id}/heartbeat"
        body = json.dumps({"round": 1, "state": "training"}).encode()
        replayed = {**sign_request(a.key, "POST", path, body), "Content-Type": "application/json"}
        assert client.post(path, content=body, headers=replayed).status_code == 200

    first.process.kill()  # SIGKILL: no shutdown code runs
    assert first.process.wait(timeout=10) == -9

    second = start_coordinator(db_path)
    with httpx.Client(base_url=second.url, timeout=10) as client:
        a.client = b.client = client
        assert [r["run_id"] for r in client.get("/v1/runs").json()["runs"]] == [run_id]
        assert client.get(f"/v1/runs/{run_id}/rounds/0").json()["manifest"] == manifest_0
        resumed = client.get(f"/v1/runs/{run_id}/rounds/1").json()
        assert (resumed["state"], resumed["deadline"], resumed["num_submitted"]) == ("open", open_1["deadline"], 1)
        status = client.get(f"/v1/runs/{run_id}/status").json()
        assert sorted((p["peer_id"], p["status"]) for p in status["peers"]) == sorted(
            [(a.peer_id, "live"), (b.peer_id, "live")]
        )
        refused = client.post(path, content=body, headers=replayed)
        assert refused.status_code == 401 and refused.json()["error"] == "replayed_nonce"
        newcomer = SignedPeer(client).join(run_id).json()
        assert newcomer["params"]["digest"] == "ee" * 32 and newcomer["peer_index"] == 2
        assert b.submit(run_id, 1).status_code == 200
        closed = client.get(f"/v1/runs/{run_id}/rounds/1?wait_s=10").json()
        assert closed["state"] == "closed" and len(closed["manifest"]) == 2


def test_deadline_that_passed_while_down_gets_the_restart_grace(start_coordinator, tmp_path):
    """The restart grace (coordinator/rules/rounds.py): the open round is not closed empty at the first
    tick; its deadline moves to the restart plus the heartbeat timeout, and the peer submits."""
    db_path = tmp_path / "coordinator.db"
    first = start_coordinator(db_path)
    with httpx.Client(base_url=first.url, timeout=10) as client:
        run_id = create_run(
            client,
            {
                "membership.min_peers": 1,
                "membership.heartbeat_timeout_s": 10.0,
                "deadline": {"kind": "fixed", "round_timeout_s": 1.0},
            },
        )
        peer = SignedPeer(client)
        peer.join(run_id)
        round_0 = client.get(f"/v1/runs/{run_id}/rounds/0").json()
    first.process.kill()
    first.process.wait(timeout=10)
    # Let the deadline pass while nothing runs: this is the situation under test.
    time.sleep(max(0.0, round_0["deadline"] - time.time() + 0.05))
    second = start_coordinator(db_path)
    with httpx.Client(base_url=second.url, timeout=15) as client:
        peer.client = client
        reopened = client.get(f"/v1/runs/{run_id}/rounds/0").json()
        assert reopened["state"] == "open" and reopened["deadline"] > round_0["deadline"] + 10.0
        assert peer.submit(run_id, 0).status_code == 200
        closed = client.get(f"/v1/runs/{run_id}/rounds/0?wait_s=10").json()
        assert closed["state"] == "closed" and [e["peer_id"] for e in closed["manifest"]] == [peer.peer_id]
        assert client.get(f"/v1/runs/{run_id}/rounds/1").json()["state"] == "open"


async def _simulated_swarm(url: str, run_id: str, num_peers: int) -> tuple[list[int], dict]:
    statuses: list[int] = []
    keys = [PeerKey.generate() for _ in range(num_peers)]

    async def signed_post(client: httpx.AsyncClient, key: PeerKey, path: str, payload: dict):
        body = json.dumps(payload).encode()
        headers = {**sign_request(key, "POST", path, body), "Content-Type": "application/json"}
        response = await client.post(path, content=body, headers=headers)
        statuses.append(response.status_code)
        return response

    limits = httpx.Limits(max_connections=num_peers + 4)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:
        await asyncio.gather(
            *[signed_post(client, key, f"/v1/runs/{run_id}/join", {"public_key": key.public_hex}) for key in keys]
        )
        waiter = asyncio.create_task(client.get(f"/v1/runs/{run_id}/rounds/0?wait_s=30"))
        await asyncio.gather(
            *[
                signed_post(
                    client,
                    key,
                    f"/v1/runs/{run_id}/rounds/0/submit",
                    {
                        "packet_digest": key.public_hex,
                        "packet_size_bytes": 4096 + i,
                        "train_loss": 3.0 + i / 100,
                        "compute_s": 2.0,
                        "encode_s": 0.2,
                    },
                )
                for i, key in enumerate(keys)
            ]
        )
        round_0 = (await waiter).json()
    return statuses, round_0


def test_32_peers_submit_concurrently(start_coordinator):
    coordinator = start_coordinator()
    with httpx.Client(base_url=coordinator.url, timeout=10) as client:
        # 32 keys from one address: the operator lifts the per-address join limit (default burst 10).
        run_id = create_run(
            client,
            {
                "membership.min_peers": 32,
                "membership.heartbeat_timeout_s": 120.0,
                "membership.join_burst_per_address": 32,
                "deadline": {"kind": "fixed", "round_timeout_s": 60.0},
            },
        )
    statuses, round_0 = asyncio.run(_simulated_swarm(coordinator.url, run_id, 32))
    assert statuses == [200] * 64
    assert round_0["state"] == "closed" and len(round_0["manifest"]) == 32
    assert round_0["closed_at"] < round_0["deadline"], "closed early, not at the deadline"
    assert [e["peer_id"] for e in round_0["manifest"]] == sorted(e["peer_id"] for e in round_0["manifest"])
    metrics = httpx.get(f"{coordinator.url}/metrics").text
    codes = re.findall(r'locoswarm_http_responses_total\{code="(\d+)"\}', metrics)
    assert codes and all(not code.startswith("5") for code in codes)


def _cli(*args: str, timeout_s: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "coordinator.cli", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def test_operator_commands_against_a_live_server(start_coordinator, tmp_path):
    coordinator = start_coordinator()
    config = tmp_path / "run.toml"
    config.write_text(
        'name = "cli-run"\n[model]\npreset = "small"\n[membership]\nmin_peers = 1\n'
        '[inner]\nbetas = [0.9, 0.99]\n[deadline]\nkind = "fixed"\nround_timeout_s = 45.0\n'
    )
    created = _cli(
        "run", "create", "--coordinator", coordinator.url, "--config", str(config), "--admin-token", ADMIN_TOKEN
    )
    assert created.returncode == 0, created.stderr
    run_id = created.stdout.strip()
    with httpx.Client(base_url=coordinator.url, timeout=10) as client:
        info = client.get(f"/v1/runs/{run_id}").json()
        assert info["config"]["inner"]["betas"] == [0.9, 0.99]
        peer = SignedPeer(client)
        peer.join(run_id, bandwidth_mbps=400.0)
        peer.submit(run_id, 0, train_loss=3.5)
    status = _cli("status", "--coordinator", coordinator.url)
    assert status.returncode == 0, status.stderr
    assert run_id in status.stdout and peer.peer_id in status.stdout
    assert "400 Mbps" in status.stdout and "3.5000" in status.stdout
    wrong = _cli(
        "run",
        "create",
        "--coordinator",
        coordinator.url,
        "--config",
        str(config),
        "--admin-token",
        "wrong-token-wrong-token",
    )
    assert wrong.returncode == 2 and "bad_admin_token" in wrong.stderr
    closed = _cli("run", "close", "--coordinator", coordinator.url, "--run", run_id, "--admin-token", ADMIN_TOKEN)
    assert closed.returncode == 0 and "closed" in closed.stdout
