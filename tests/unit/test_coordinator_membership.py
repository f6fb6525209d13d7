"""Membership that cannot be stalled or flooded, on the service with a fake clock and over HTTP in
process (coordinator/rules/standing.py and membership.py): probation, who a round waits for, K
missed rounds, per-address and per-run join rate limits with Retry-After, and the join proof of
work; the node's client honours Retry-After and solves the proof."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from coordinator import errors
from coordinator.join_guard import salt_of
from node.round.coordinator_client import CoordinatorClient
from protocol.http import (
    LOADING_SNAPSHOT,
    MAX_DIAL_PEERS,
    HeartbeatRequest,
    JoinRequest,
    LeaveRequest,
    peer_id_from_public_key,
    sign_request,
)
from protocol.join_pow import JOIN_POW_PERIOD_S, meets, solve
from protocol.signing import PeerKey
from tests.fixtures.coordinator import ADMIN_HEADERS, ADMIN_TOKEN, run_config
from tests.unit.test_coordinator_votes import Coordinator

pytestmark = pytest.mark.timeout(30)

TIMEOUT_S = 30.0  # the rounds' fixed timeout (tests.fixtures.coordinator.run_config)


@pytest.fixture
def coordinator(tmp_path, fake_clock):
    c = Coordinator(tmp_path, fake_clock)
    yield c
    c.storage.close()


def standing(c: Coordinator, run_id: str) -> dict[str, tuple[str, bool]]:
    return {p.peer_id: (p.standing, p.waited_for) for p in c.status(run_id).peers}


def heartbeat(c: Coordinator, run_id: str, peer_id: str, round_index: int) -> None:
    c.service.heartbeat(run_id, peer_id, HeartbeatRequest(round=round_index, state="training"))


def test_a_key_that_only_heartbeats_never_holds_a_round(coordinator, fake_clock):
    c = coordinator
    run_id = c.create_run(**{"membership.min_peers": 2, "membership.heartbeat_timeout_s": 300.0})
    a, b = c.join(run_id, 2)
    c.submit(run_id, 0, a, b)
    (idler,) = c.join(run_id, source="10.0.0.66")
    for r in range(1, 7):
        heartbeat(c, run_id, idler, r)
        assert c.status(run_id).current_round.num_expected == 2
        fake_clock.advance(2.0)
        c.submit(run_id, r, a, b)
        if 2 <= r < 2 + 3:  # a member from round 2: for 3 (max_missed_rounds) rounds a newcomer in step gets a moment
            assert c.round(run_id, r).state == "open"
            fake_clock.advance(1.0)  # max(1 s, a quarter of the 2 s the round took)
            c.status(run_id)
        view = c.round(run_id, r)
        assert view.state == "closed" and view.closed_at == fake_clock() < view.deadline, "closed early"
    peers = {p.peer_id: p for p in c.status(run_id).peers}
    assert (peers[idler].standing, peers[idler].waited_for, peers[idler].status) == ("probation", False, "live")
    assert "no packet in a manifest yet" in peers[idler].standing_reason
    assert (peers[a].standing, peers[a].waited_for, peers[a].last_contributed_round) == ("contributor", True, 6)
    assert "straggler" not in peers[idler].flags


def test_a_forming_swarm_waits_for_every_live_member(coordinator, fake_clock):
    """The decision for a fresh run: while fewer live peers have contributed than min_peers (round 0
    has none), a round waits for every live member, so round 0 is not closed on its first packet;
    once min_peers contribute, only contributors are waited for."""
    c = coordinator
    run_id = c.create_run(**{"membership.min_peers": 3, "membership.heartbeat_timeout_s": 300.0})
    a, b, silent = c.join(run_id, 3)
    assert standing(c, run_id)[silent] == ("probation", True)
    c.submit(run_id, 0, a, b)
    assert c.round(run_id, 0).state == "open" and c.status(run_id).current_round.num_expected == 3
    fake_clock.advance(TIMEOUT_S)
    assert [e.peer_id for e in c.round(run_id, 0).manifest] == sorted([a, b])
    assert {p.peer_id: p.flags for p in c.status(run_id).peers}[silent] == ["straggler"]
    # Two contributors, fewer than min_peers 3: still forming, round 1 waits for the silent one too.
    assert standing(c, run_id) == {a: ("contributor", True), b: ("contributor", True), silent: ("probation", True)}
    (third,) = c.join(run_id)
    c.submit(run_id, 1, third, a, b)  # the newcomer's packet makes round 1: three contributors
    assert c.round(run_id, 1).state == "open"
    fake_clock.advance(TIMEOUT_S)
    assert len(c.round(run_id, 1).manifest) == 3
    assert standing(c, run_id)[silent] == ("probation", False)
    c.submit(run_id, 2, a, b, third)
    assert c.round(run_id, 2).state == "closed", "formed: closed early without the silent member"


def test_a_probationer_whose_packet_makes_a_manifest_is_waited_for(coordinator):
    c = coordinator
    run_id = c.create_run(**{"membership.min_peers": 2, "membership.heartbeat_timeout_s": 300.0})
    a, b = c.join(run_id, 2)
    c.submit(run_id, 0, a, b)
    (newcomer,) = c.join(run_id)
    c.submit(run_id, 1, newcomer)  # before the contributors: its packet makes round 1
    c.submit(run_id, 1, a, b)
    assert newcomer in {e.peer_id for e in c.round(run_id, 1).manifest}
    assert standing(c, run_id)[newcomer] == ("contributor", True)
    c.submit(run_id, 2, a, b)
    assert c.round(run_id, 2).state == "open", "round 2 waits for the new contributor"
    c.submit(run_id, 2, newcomer)
    assert c.round(run_id, 2).state == "closed"


def test_a_contributor_missing_k_rounds_in_a_row_is_no_longer_waited_for(coordinator, fake_clock):
    c = coordinator
    run_id = c.create_run(
        **{"membership.min_peers": 2, "membership.max_missed_rounds": 2, "membership.heartbeat_timeout_s": 300.0}
    )
    a, b = c.join(run_id, 2)
    (stalled,) = c.join(run_id)  # it joined while round 0 was open, and submits to it first
    c.submit(run_id, 0, stalled, a, b)
    assert len(c.round(run_id, 0).manifest) == 3
    for r in (1, 2):  # it is still waited for: each round runs to its deadline
        heartbeat(c, run_id, stalled, r)
        c.submit(run_id, r, a, b)
        assert c.round(run_id, r).state == "open"
        fake_clock.advance(TIMEOUT_S)
        assert c.round(run_id, r).state == "closed"
    peer = next(p for p in c.status(run_id).peers if p.peer_id == stalled)
    assert (peer.standing, peer.waited_for, peer.status) == ("not_waited", False, "live")
    assert "no packet in the last 2 rounds" in peer.standing_reason and "round 0" in peer.standing_reason
    c.submit(run_id, 3, a, b)
    assert c.round(run_id, 3).state == "closed", "closed early without it"
    c.submit(run_id, 4, stalled, a, b)  # its next packet in a manifest makes it a contributor again
    assert standing(c, run_id)[stalled] == ("contributor", True)


def test_joins_of_new_keys_are_rate_limited_per_address_and_per_run(coordinator, fake_clock):
    c = coordinator
    run_id = c.create_run(
        **{
            "membership.min_peers": 1,
            "membership.join_burst_per_address": 3,
            "membership.join_rate_per_address_per_min": 6.0,
            "membership.join_burst": 5,
            "membership.join_rate_per_min": 60.0,
        }
    )
    first = c.join(run_id, 3, source="10.0.0.1")
    with pytest.raises(errors.RateLimited, match="address 10.0.0.1") as refused:
        c.join(run_id, source="10.0.0.1")
    assert refused.value.status == 429 and refused.value.retry_after_s == 10  # 6 a minute: one per 10 s
    c.rejoin(run_id, first[0], source="10.0.0.1")  # a member rejoins freely
    c.join(run_id, 2, source="10.0.0.2")
    with pytest.raises(errors.RateLimited, match="the run") as refused:
        c.join(run_id, source="10.0.0.3")
    assert refused.value.retry_after_s == 1
    fake_clock.advance(1.0)
    c.join(run_id, source="10.0.0.3")
    fake_clock.advance(9.0)
    c.join(run_id, source="10.0.0.1")
    assert len(c.status(run_id).peers) == 7


def test_a_proof_of_work_join(coordinator, fake_clock):
    c = coordinator
    bits = 8
    run_id = c.create_run(**{"membership.min_peers": 1, "membership.join_pow_bits": bits})
    key = PeerKey.generate()
    peer_id = peer_id_from_public_key(key.public_bytes)
    with pytest.raises(errors.JoinProofRequired):
        c.service.join(run_id, peer_id, JoinRequest(public_key=key.public_hex))
    challenge = c.service.join_challenge(run_id)
    assert challenge.bits == bits and len(challenge.salt) == 32 and challenge.expires_at > fake_clock()
    nonce = solve(run_id, key.public_hex, challenge.salt, bits)
    wrong = next(n for n in range(10_000) if not meets(run_id, key.public_hex, challenge.salt, n, bits))
    with pytest.raises(errors.BadJoinProof):
        c.service.join(run_id, peer_id, _join_request(key, challenge.salt, wrong))
    # A proof is bound to its key. (With 8 bits, one key in 256 meets the same nonce by chance: not that one.)
    other = next(
        k for k in iter(PeerKey.generate, None) if not meets(run_id, k.public_hex, challenge.salt, nonce, bits)
    )
    with pytest.raises(errors.BadJoinProof):
        c.service.join(run_id, peer_id_from_public_key(other.public_bytes), _join_request(other, challenge.salt, nonce))
    fake_clock.advance(JOIN_POW_PERIOD_S)  # still good in the next period
    joined = c.service.join(run_id, peer_id, _join_request(key, challenge.salt, nonce))
    assert joined.peer_id == peer_id
    assert c.service.join(run_id, peer_id, JoinRequest(public_key=key.public_hex)).peer_id == peer_id, (
        "a member rejoins without a proof"
    )
    fake_clock.advance(JOIN_POW_PERIOD_S)  # two periods on: expired
    with pytest.raises(errors.JoinProofRequired, match="expired"):
        c.service.join(
            run_id,
            peer_id_from_public_key(other.public_bytes),
            _join_request(other, challenge.salt, solve(run_id, other.public_hex, challenge.salt, bits)),
        )
    stored = c.storage.get_run(run_id).join_secret
    assert c.service.join_challenge(run_id).salt == salt_of(stored, run_id, int(fake_clock() // JOIN_POW_PERIOD_S))
    open_run = c.create_run(**{"membership.min_peers": 1})
    assert (c.service.join_challenge(open_run).bits, c.service.join_challenge(open_run).salt) == (0, "")


def _join_request(key: PeerKey, salt: str, nonce: int) -> JoinRequest:
    return JoinRequest(public_key=key.public_hex, pow_salt=salt, pow_nonce=nonce)


# -- over HTTP, in process, with the node's client -------------------------------------------------


def in_app(tmp_path, scenario):
    """Run `scenario(transport)` against the coordinator app on an ASGI transport (real clock)."""
    from coordinator.app import create_app
    from coordinator.storage import open_storage

    async def main():
        storage = open_storage(f"sqlite:///{tmp_path / 'coordinator.db'}")
        app = create_app(storage, ADMIN_TOKEN, tick_s=None)
        try:
            async with app.router.lifespan_context(app):
                await scenario(httpx.ASGITransport(app=app))
        finally:
            storage.close()

    asyncio.run(main())


async def _create(transport, overrides: dict) -> str:
    async with httpx.AsyncClient(transport=transport, base_url="http://c.test") as admin:
        response = await admin.post("/v1/runs", json=run_config(overrides), headers=ADMIN_HEADERS)
        assert response.status_code == 200, response.text
        return response.json()["run_id"]


async def _raw_join(transport, run_id: str, key: PeerKey) -> httpx.Response:
    path = f"/v1/runs/{run_id}/join"
    body = json.dumps({"public_key": key.public_hex}).encode()
    headers = sign_request(key, "POST", path, body) | {"content-type": "application/json"}
    async with httpx.AsyncClient(transport=transport, base_url="http://c.test") as http:
        return await http.post(path, content=body, headers=headers)


def test_a_rate_limited_join_is_a_429_with_retry_after_that_the_client_waits_out(tmp_path):
    async def scenario(transport):
        run_id = await _create(
            transport,
            {
                "membership.min_peers": 1,
                "membership.join_burst_per_address": 1,
                "membership.join_rate_per_address_per_min": 60.0,
            },
        )
        assert (await _raw_join(transport, run_id, PeerKey.generate())).status_code == 200
        refused = await _raw_join(transport, run_id, PeerKey.generate())
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"] == "rate_limited"
        client = CoordinatorClient("http://c.test", PeerKey.generate(), transport=transport, retry_for_s=10.0)
        started = time.monotonic()
        joined = await client.join(run_id, join_token=None, device="cpu", multiaddrs=[])
        assert joined.run_id == run_id and time.monotonic() - started >= 0.5  # it waited for its token
        await client.close()

    in_app(tmp_path, scenario)


def test_the_client_solves_the_proof_of_work_before_joining(tmp_path):
    async def scenario(transport):
        run_id = await _create(transport, {"membership.min_peers": 1, "membership.join_pow_bits": 12})
        refused = await _raw_join(transport, run_id, PeerKey.generate())
        assert refused.status_code == 403 and refused.json()["error"] == "join_proof_required"
        key = PeerKey.generate()
        client = CoordinatorClient("http://c.test", key, transport=transport, retry_for_s=10.0)
        joined = await client.join(run_id, join_token=None, device="cpu", multiaddrs=[])
        assert joined.peer_id == peer_id_from_public_key(key.public_bytes)
        assert (await client.join(run_id, join_token=None, device="cpu", multiaddrs=[])).peer_id == joined.peer_id
        await client.close()

    in_app(tmp_path, scenario)


def test_reachability_is_what_the_dial_back_found_unless_the_node_says_nobody_can_dial_it(coordinator):
    """coordinator/reachability.py: the route's dial-back answer is stored with the member and
    sent back; a node that says it is behind NAT is unreachable whatever the dial-back found; a
    rejoin takes the new answer."""
    c = coordinator
    run_id = c.create_run(**{"membership.min_peers": 3})
    keys = [PeerKey.generate() for _ in range(3)]
    ids = [peer_id_from_public_key(k.public_bytes) for k in keys]
    answers = [
        c.service.join(run_id, ids[0], JoinRequest(public_key=keys[0].public_hex), reachable=True),
        c.service.join(run_id, ids[1], JoinRequest(public_key=keys[1].public_hex, reachable=False), reachable=True),
        c.service.join(run_id, ids[2], JoinRequest(public_key=keys[2].public_hex)),
    ]
    assert [a.reachable for a in answers] == [True, False, None]
    assert {p.peer_id: p.reachable for p in c.status(run_id).peers} == dict(zip(ids, [True, False, None]))
    again = c.service.join(run_id, ids[0], JoinRequest(public_key=keys[0].public_hex), reachable=False)
    assert again.reachable is False and c.storage.get_peer(run_id, ids[0]).reachable == 0
    with pytest.raises(ValueError):
        JoinRequest(public_key=keys[0].public_hex, reachable=True)  # a node can only say "not reachable"


def test_the_heartbeat_period_stretches_with_the_swarm_and_silence_is_judged_by_the_period_told(
    coordinator, fake_clock
):
    """N / max_heartbeats_per_s past a quarter of the timeout: 12 peers at 2 beats/s beat every 6 s,
    and a peer told 6 s is gone after 24 s of silence, not the 8 s timeout, even once the swarm
    shrank and newer answers tell 2 s."""
    c = coordinator
    run_id = c.create_run(
        **{
            "membership.min_peers": 1,
            "membership.heartbeat_timeout_s": 8.0,
            "membership.max_heartbeats_per_s": 2.0,
            "membership.join_burst_per_address": 100,
        }
    )
    (first,) = c.join(run_id)
    assert c.rejoin(run_id, first).heartbeat_interval_s == 2.0  # a quarter of the timeout
    others = c.join(run_id, 11)
    answer = c.service.heartbeat(run_id, first, HeartbeatRequest(round=0, state="training"))
    assert answer.heartbeat_interval_s == 12 / 2.0
    assert {p.peer_id: p.heartbeat_interval_s for p in c.status(run_id).peers}[first] == 6.0

    for peer_id in others:  # the swarm shrinks to one beating peer
        c.service.leave(run_id, peer_id, LeaveRequest(reason="done"))
    (beater,) = c.join(run_id)
    for _ in range(11):
        fake_clock.advance(2.0)
        answer = c.service.heartbeat(run_id, beater, HeartbeatRequest(round=0, state="training"))
        assert answer.heartbeat_interval_s == 2.0  # 2 live peers: a quarter of the timeout again
        peers = {p.peer_id: p for p in c.status(run_id).peers}
        assert peers[first].status == "live", f"gone after {fake_clock() - peers[first].last_seen_at:.0f} s"
    fake_clock.advance(2.5)  # past 24 s of silence: four periods of 6 s
    c.service.heartbeat(run_id, beater, HeartbeatRequest(round=0, state="training"))
    peers = {p.peer_id: p for p in c.status(run_id).peers}
    assert peers[first].status == "gone" and "(4 heartbeat periods: 24 s)" in peers[first].reason
    assert peers[beater].status == "live"


def test_a_member_nobody_can_dial_is_told_the_dialable_peers_loading_a_snapshot(coordinator, fake_clock):
    """Connection reversal (membership.py): the answer to the heartbeat of a member nobody can dial
    lists the listen addresses of at most MAX_DIAL_PEERS live members whose latest heartbeat, within
    two of their periods, said loading_snapshot, newest first; never members nobody can dial, never
    one that moved on, nor one silent that long; and nothing to members others can dial."""
    c = coordinator
    run_id = c.create_run(**{"membership.min_peers": 20, "membership.heartbeat_timeout_s": 8.0})

    def member(reachable: bool | None, says_nat: bool = False) -> tuple[str, list[str]]:
        key = PeerKey.generate()
        peer_id = peer_id_from_public_key(key.public_bytes)
        addrs = [f"/ip4/10.0.0.{len(c.keys) + 1}/tcp/4001/p2p/Qm{peer_id[:10]}"]
        request = JoinRequest(public_key=key.public_hex, listen_multiaddrs=addrs, reachable=False if says_nat else None)
        c.service.join(run_id, peer_id, request, reachable=reachable)
        c.keys[peer_id] = key
        return peer_id, addrs

    def beat(peer_id: str, state: str = LOADING_SNAPSHOT):
        return c.service.heartbeat(run_id, peer_id, HeartbeatRequest(round=0, state=state))

    nat, _ = member(True, says_nat=True)
    other_nat, _ = member(False)
    dialable, unknown, idle = member(True), member(None), member(True)
    loaders = [member(True) for _ in range(MAX_DIAL_PEERS)]
    assert beat(nat, "training").dial_peers is None  # nobody loads a snapshot yet

    beat(other_nat)  # nobody can dial it: no use listing it
    beat(idle[0], "training")
    beat(dialable[0])
    fake_clock.advance(0.5)
    beat(unknown[0])  # no dial-back answer (a relayed node): dialable as far as anyone knows
    assert beat(nat, "training").dial_peers == [unknown[1], dialable[1]]
    assert beat(dialable[0]).dial_peers is None and beat(idle[0], "training").dial_peers is None

    for loader, _ in loaders:  # more loaders than a list holds: the most recently seen
        fake_clock.advance(0.1)
        beat(loader)
    assert beat(nat, "training").dial_peers == [addrs for _, addrs in reversed(loaders)]

    for loader, _ in loaders:
        beat(loader, "training")  # loaded: moved on
    beat(dialable[0], "training")
    assert beat(nat, "training").dial_peers == [unknown[1]]
    fake_clock.advance(2 * 2.0 + 0.1)  # past two of its 2 s periods without a heartbeat
    assert beat(nat, "training").dial_peers is None
