"""Attacks on membership and agreement against real processes on 127.0.0.1 (a `coordinator serve`
process with its SQLite file, node processes with their p2pd daemons, port 0): the attackers are
signed HTTP requests from the test, made with protocol.signing keys, that never train.

- Four fresh keys join (solving the run's proof of work), report a made-up digest for each round
  as soon as it closes, and leave: the agreed digest of every round is the honest nodes', no honest
  node is flagged, and a node that joins later catches up from the honest state and contributes.
  Beside them one more key joins and only heartbeats: no round waits for it (rounds close in
  seconds against a 60 s deadline).
- A burst of joins from one address is answered 429 with Retry-After past the run's burst, and
  the node's client waits it out.

Assertions read typed state: the coordinator's status, round views and applied answers, the
nodes' exit codes and `--report` JSON.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from node.cli.demo import LocalSwarm
from node.round.coordinator_client import CoordinatorClient
from protocol.http import peer_id_from_public_key, sign_request
from protocol.join_pow import solve
from protocol.signing import PeerKey
from tests.fixtures.coordinator import SignedPeer, create_run
from tests.unit.test_coordinator_votes import HONEST, OTHER, Coordinator

pytestmark = [pytest.mark.slow]

H = 5
ROUNDS = 7
SLOW_S = 3.0  # the honest nodes' rounds take this long at least, so the late joiner's packets keep up
ATTACKED_ROUNDS = 4  # rounds 0..3 get the strangers' made-up reports
DEADLINE_S = 60.0
POW_BITS = 12
FAKE = "fa" * 32


def status_of(swarm: LocalSwarm) -> dict:
    return swarm.status()


def wait_until(swarm: LocalSwarm, predicate, what: str, timeout_s: float = 120.0) -> dict:
    """Poll the coordinator's status until `predicate(status)`; fail early if a node died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for i, node in enumerate(swarm.nodes):
            if node.poll() not in (None, 0):
                pytest.fail(f"node {i} exited with {node.returncode} while waiting for {what}:\n" + tail(swarm, i))
        status = swarm.status()
        if predicate(status):
            return status
        time.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}")


def tail(swarm: LocalSwarm, i: int, lines: int = 40) -> str:
    path = swarm.workdir / f"node{i}.log"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def report_of(swarm: LocalSwarm, i: int) -> dict:
    return json.loads((swarm.workdir / f"node{i}.report.json").read_text())


def join_with_proof(http: httpx.Client, run_id: str) -> SignedPeer:
    """A fresh key that pays the run's proof of work and joins, as any client may."""
    peer = SignedPeer(http)
    challenge = http.get(f"/v1/runs/{run_id}/join-challenge").json()
    nonce = solve(run_id, peer.key.public_hex, challenge["salt"], challenge["bits"])
    response = peer.join(run_id, pow_salt=challenge["salt"], pow_nonce=nonce)
    assert response.status_code == 200, response.text
    return peer


class Heartbeater(threading.Thread):
    """A member that only heartbeats, every `interval_s`, until stopped."""

    def __init__(self, url: str, run_id: str, peer_key: PeerKey, interval_s: float = 2.0):
        super().__init__(daemon=True)
        self.url, self.run_id, self.key, self.interval_s = url, run_id, peer_key, interval_s
        self.stop = threading.Event()
        self.codes: list[int] = []

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=10, trust_env=False) as http:
            peer = SignedPeer(http, key=self.key)
            while not self.stop.wait(self.interval_s):
                self.codes.append(peer.heartbeat(self.run_id, 0, state="training").status_code)


@pytest.mark.timeout(300)
def test_strangers_cannot_set_the_agreed_digest_nor_stall_rounds(tmp_path: Path):
    extra = {i: ("--inject", f"slow-compute@min_s={SLOW_S:g}") for i in (0, 1)}
    with LocalSwarm(
        tmp_path, num_peers=2, preset="tiny", rounds=ROUNDS, inner_steps=H, top_k=64, quiet=True, extra_node_args=extra
    ) as swarm:
        swarm.start_coordinator()
        swarm.create_run(
            {
                "membership.min_peers": 2,
                "membership.heartbeat_timeout_s": 20.0,
                "membership.join_pow_bits": POW_BITS,
                "deadline": {"kind": "fixed", "round_timeout_s": DEADLINE_S},
            }
        )
        swarm.start_node(0)
        swarm.wait_for_peers(1)
        swarm.start_node(1)
        wait_until(swarm, lambda s: s["run"]["state"] == "running", "round 0 open")
        run_id = swarm.run_id
        with httpx.Client(base_url=swarm.url, timeout=40, trust_env=False) as http:
            strangers = [join_with_proof(http, run_id) for _ in range(4)]
            idler = join_with_proof(http, run_id)
            heartbeats = Heartbeater(swarm.url, run_id, idler.key)
            heartbeats.start()
            answers: list[dict] = []
            try:
                for r in range(ATTACKED_ROUNDS):  # each round as soon as it closes, racing the honest reports
                    while http.get(f"/v1/runs/{run_id}/rounds/{r}?wait_s=30").json()["state"] != "closed":
                        pass
                    for stranger in strangers:
                        response = stranger.applied(run_id, r, FAKE)
                        assert response.status_code == 200, response.text
                        answers.append(response.json())
                    if r == 0:  # the late joiner, up in seconds: it finds agreed rounds, so it loads a snapshot
                        wait_until(swarm, lambda s: s["history"] and s["history"][0]["agreed_digest"], "round 0 agreed")
                        swarm.start_node(2)
                for stranger in strangers:
                    assert stranger.post(f"/v1/runs/{run_id}/leave", {"reason": "done"}).status_code == 200
                during = wait_until(swarm, lambda s: len(s["history"]) > ATTACKED_ROUNDS, "the attacked rounds closed")
                codes = [node.wait(timeout=240) for node in swarm.nodes]
            finally:
                heartbeats.stop.set()
                heartbeats.join(timeout=10)
            status = swarm.status()
            views = {r: http.get(f"/v1/runs/{run_id}/rounds/{r}").json() for r in range(ROUNDS)}
    assert codes == [0, 0, 0], [tail(swarm, i) for i in range(3)]

    # The strangers never voted; nothing they said became a majority, let alone agreed.
    assert len(answers) == 4 * ATTACKED_ROUNDS and all(a["vote"] is False for a in answers), answers
    assert all(a["agreed_digest"] != FAKE and a["majority_digest"] != FAKE for a in answers)
    history = {h["round"]: h for h in status["history"]}
    assert sorted(history) == list(range(ROUNDS))
    honest = [{r["round"]: r["digest"] for r in report_of(swarm, i)["rounds"]} for i in range(3)]
    for r, h in history.items():
        assert h["agreed_digest"] == honest[0][r] == honest[1][r] and not h["provisional"], (r, h)
        assert views[r]["agreed_digest"] == h["agreed_digest"] and views[r]["manifest_version"] == 1
    for r in range(ATTACKED_ROUNDS):  # every contributor voted; the 4 strangers' reports are kept, not counted
        assert history[r]["num_votes"] == len(views[r]["manifest"]) >= 2, (history[r], views[r])
        assert history[r]["num_applied"] >= history[r]["num_votes"] + 4, history[r]
    peers = {p["peer_id"]: p for p in status["peers"]}
    for i in range(3):
        node_id = report_of(swarm, i)["peer_id"]
        assert "params_mismatch" not in peers[node_id]["flags"], peers[node_id]
    for stranger in strangers:
        assert peers[stranger.peer_id]["flags"] == ["params_mismatch"], peers[stranger.peer_id]
        assert (peers[stranger.peer_id]["status"], peers[stranger.peer_id]["standing"]) == ("left", "probation")

    # The late joiner caught up from the honest state, then trained with the swarm: its digests
    # are the agreed ones, and its packets made manifests.
    late = report_of(swarm, 2)
    assert late["rounds"] and late["rounds"][0]["round"] > 0 and late["catch_ups"], late
    assert late["catch_ups"][0]["method"] in ("snapshot", "snapshot+replay"), late["catch_ups"]
    assert all(history[r]["agreed_digest"] == d for r, d in honest[2].items())
    late_id = late["peer_id"]
    assert any(late_id in [e["peer_id"] for e in views[r]["manifest"]] for r in honest[2]), "it never contributed"

    # The key that only heartbeats: live, on probation, never waited for; no round ran to its deadline.
    assert heartbeats.codes and set(heartbeats.codes) == {200}
    idle = next(p for p in during["peers"] if p["peer_id"] == idler.peer_id)
    assert during["current_round"]["num_expected"] == sum(p["waited_for"] for p in during["peers"])
    assert (idle["status"], idle["standing"], idle["waited_for"]) == ("live", "probation", False), idle
    slowest = max(h["round_time_s"] for h in history.values())
    assert slowest < DEADLINE_S / 3, f"a round took {slowest:.1f} s of its {DEADLINE_S:g} s"
    print(
        f"strangers: {len(answers)} reports, 0 votes; rounds took at most {slowest:.1f} s; late joiner "
        f"caught up at round {late['catch_ups'][0]['to_round']} by {late['catch_ups'][0]['method']}"
    )


@pytest.mark.timeout(60)
def test_a_burst_of_joins_from_one_address_is_rate_limited(start_coordinator):
    coordinator = start_coordinator()
    with httpx.Client(base_url=coordinator.url, timeout=10, trust_env=False) as http:
        run_id = create_run(
            http,
            {
                "membership.min_peers": 1,
                "membership.join_burst_per_address": 5,
                "membership.join_rate_per_address_per_min": 20.0,
            },
        )  # one per 3 s

    async def burst(count: int) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=coordinator.url, timeout=10, trust_env=False) as client:

            async def join(key: PeerKey) -> httpx.Response:
                path = f"/v1/runs/{run_id}/join"
                body = json.dumps({"public_key": key.public_hex}).encode()
                headers = sign_request(key, "POST", path, body) | {"content-type": "application/json"}
                return await client.post(path, content=body, headers=headers)

            return await asyncio.gather(*(join(PeerKey.generate()) for _ in range(count)))

    responses = asyncio.run(burst(12))
    assert sorted(r.status_code for r in responses) == [200] * 5 + [429] * 7
    for refused in (r for r in responses if r.status_code == 429):
        assert refused.json()["error"] == "rate_limited" and int(refused.headers["retry-after"]) >= 1
    status = httpx.get(f"{coordinator.url}/v1/runs/{run_id}/status", trust_env=False).json()
    assert len(status["peers"]) == 5

    async def client_join() -> float:
        key = PeerKey.generate()
        client = CoordinatorClient(coordinator.url, key, retry_for_s=20.0)
        started = time.monotonic()
        try:
            joined = await client.join(run_id, join_token=None, device="cpu", multiaddrs=[])
            assert joined.peer_id == peer_id_from_public_key(key.public_bytes)
        finally:
            await client.close()
        return time.monotonic() - started

    waited_s = asyncio.run(client_join())  # its first try is refused: it waits for Retry-After, then joins
    assert 1.0 <= waited_s < 15.0, waited_s
    status = httpx.get(f"{coordinator.url}/v1/runs/{run_id}/status", trust_env=False).json()
    assert len(status["peers"]) == 6


@pytest.mark.timeout(60)
def test_votes_and_standing_on_both_backends(storage_url, tmp_path, fake_clock):
    """The queries behind votes and standing (Storage.waited_for, mark_contributors,
    refresh_last_contributed, contributed_rounds_before, immutable reports) on SQLite and PostgreSQL."""
    from protocol.http import MissingRequest

    c = Coordinator(tmp_path, fake_clock, url=storage_url)
    try:
        run_id = c.create_run(
            **{
                "membership.min_peers": 2,
                "membership.heartbeat_timeout_s": 600.0,
                "membership.max_missed_rounds": 1,
                "membership.vote_after_rounds": 1,
            }
        )
        a, b = c.join(run_id, 2)
        (w,) = c.join(run_id)
        c.credit(run_id, {a: 1, b: 1, w: 1})  # as scoring gives it: votes weigh credit (a peer column)
        c.submit(run_id, 0, w, a, b)
        (idler,) = c.join(run_id, source="10.0.0.7")
        c.submit(run_id, 1, a, b, w)  # the idler is on probation: round 1 closes without it
        assert c.round(run_id, 1).state == "closed"
        assert [c.applied(run_id, 1, p, HONEST).vote for p in (a, b, idler)] == [True, True, False]
        assert c.round(run_id, 1).agreed_digest == HONEST
        for peer in (a, b):
            c.service.report_missing(run_id, 1, peer, MissingRequest(peer_ids=[w]))
        assert (c.round(run_id, 1).manifest_version, c.round(run_id, 1).agreed_digest) == (2, None)
        assert next(p for p in c.status(run_id).peers if p.peer_id == w).last_contributed_round == 0
        assert c.applied(run_id, 1, a, OTHER, version=2).agreed_digest is None
        assert c.applied(run_id, 1, b, OTHER, version=2).agreed_digest == OTHER
        c.submit(run_id, 2, a, b)  # w: withheld, and no packet in round 1's manifest any more
        assert c.round(run_id, 2).state == "closed"
        standings = {p.peer_id: (p.standing, p.waited_for) for p in c.status(run_id).peers}
        assert standings == {
            a: ("contributor", True),
            b: ("contributor", True),
            w: ("not_waited", False),
            idler: ("probation", False),
        }
    finally:
        c.storage.close()
