"""The node's round loop, driven in-process: real `Node`s with an in-memory exchange and the
coordinator app on an ASGI transport (its real service and a real SQLite file), no network.

Each test runs a few `tiny` rounds with H=2 and asserts on typed state: the nodes' reports and
the coordinator's status (manifests, agreed digests), never on log text.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from node.config import FLAT_KEYS, load_node_config
from node.faults import FaultInjector
from node.round import resume
from node.round.coordinator_client import CoordinatorClient
from node.round.loop import Node
from protocol.http import RoundView, RunStatus, peer_id_from_public_key
from protocol.signing import PeerKey
from tests.doubles.memory_exchange import MemorySwarm

ADMIN_TOKEN = "round-loop-test-admin-token-0123456789"
BASE_URL = "http://coordinator.test"
TEST_TIMEOUT_S = 120


class Swarm:
    """A coordinator app in this process, an in-memory exchange network, and nodes on both."""

    def __init__(self, tmp_path: Path, app, transport: httpx.ASGITransport):
        self.tmp_path, self.app, self.transport = tmp_path, app, transport
        self.network = MemorySwarm()
        self.admin = httpx.AsyncClient(
            transport=transport, base_url=BASE_URL, headers={"authorization": f"Bearer {ADMIN_TOKEN}"}
        )
        self.corpus = tmp_path / "corpus.txt"
        # A small real text: this test file's own bytes, repeated (byte-level tokens for `tiny`).
        self.corpus.write_text(Path(__file__).read_text() * 8)
        self.run_id = ""

    async def create_run(self, **sections) -> str:
        config = {
            "name": "round-loop",
            "max_rounds": sections.pop("max_rounds", 3),
            "model": {"preset": "tiny", "data": str(self.corpus)},
            "inner": {"steps": 2, "batch_size": 2, "seq_len": 32, "warmup_steps": 2, "total_steps": 100},
            "membership": {"min_peers": sections.pop("min_peers", 3), "heartbeat_timeout_s": 600.0},
            "deadline": {"kind": "fixed", "round_timeout_s": sections.pop("round_timeout_s", 30.0)},
        }
        for section, values in sections.items():
            config[section] = config.get(section, {}) | values
        response = await self.admin.post("/v1/runs", json=config)
        assert response.status_code == 200, response.text
        self.run_id = response.json()["run_id"]
        return self.run_id

    def node(self, name: str, faults: FaultInjector | None = None, **settings) -> tuple[Node, str]:
        key_path = self.tmp_path / f"{name}.key"
        key = PeerKey.load_or_create(key_path)
        settings = {
            "training.device": "cpu",
            "debug.progress": False,
            "network.fetch_timeout_s": 3.0,
            "training.threads": 1,
            **{FLAT_KEYS[name]: value for name, value in settings.items()},
        }
        config = load_node_config(
            None, {"coordinator": BASE_URL, "run_id": self.run_id, "key_path": key_path, **settings}
        )
        client = CoordinatorClient(BASE_URL, key, transport=self.transport, retry_for_s=5.0)
        node = Node(config, client=client, exchange=self.network.exchange(name), faults=faults)
        return node, peer_id_from_public_key(key.public_bytes)

    async def status(self) -> RunStatus:
        response = await self.admin.get(f"/v1/runs/{self.run_id}/status")
        return RunStatus.model_validate(response.json())


def in_swarm(scenario):
    """Run `scenario(swarm)` in a fresh event loop, with a coordinator app on a SQLite file in
    tmp_path (its background tick on, so deadlines pass in real time)."""

    def test(tmp_path: Path):
        from coordinator.app import create_app
        from coordinator.storage import open_storage

        async def main():
            storage = open_storage(f"sqlite:///{tmp_path / 'coordinator.db'}")
            app = create_app(storage, ADMIN_TOKEN, tick_s=0.05, rate_per_s=1000.0, rate_burst=1000.0)
            try:
                async with app.router.lifespan_context(app):
                    swarm = Swarm(tmp_path, app, httpx.ASGITransport(app=app))
                    try:
                        await scenario(swarm)
                    finally:
                        await swarm.admin.aclose()
            finally:
                storage.close()

        asyncio.run(main())

    test.__name__, test.__doc__ = scenario.__name__, scenario.__doc__
    return pytest.mark.timeout(TEST_TIMEOUT_S)(test)


def digests_by_round(node: Node) -> dict[int, str]:
    return {r.applied_round: r.digest for r in node.reports if r.applied_round >= 0}


async def run_all(*nodes: Node) -> None:
    await asyncio.wait_for(asyncio.gather(*(n.run() for n in nodes)), TEST_TIMEOUT_S)


@in_swarm
async def test_normal_rounds_agree(swarm):
    """Three nodes, three rounds; in a swarm the coordinator sizes at 0.5 heartbeats a second, each
    node beats at the period the coordinator last told it: max(8 / 4, N / 0.5) s with N live peers
    when it was told."""
    await swarm.create_run(membership={"heartbeat_timeout_s": 8.0, "max_heartbeats_per_s": 0.5})
    nodes, peer_ids = zip(*(swarm.node(name) for name in "abc"))
    await run_all(*nodes)
    status = await swarm.status()
    told = {p.peer_id: p.heartbeat_interval_s for p in status.peers}
    assert [node.session.heartbeat_interval_s for node in nodes] == [told[p] for p in peer_ids]
    assert set(told.values()) <= {2.0, 4.0, 6.0}, told  # max(8 / 4, N / 0.5) for N = 1, 2, 3
    agreed = {h.round: h.majority_digest for h in status.history}
    assert sorted(agreed) == [0, 1, 2]
    for node in nodes:
        assert node.catch_ups == []
        assert [r.round for r in node.reports] == [0, 1, 2]
        assert all(r.submitted and r.num_packets == 3 and not r.refused for r in node.reports)
        assert digests_by_round(node) == agreed
    assert all(h.num_contributors == 3 for h in status.history)


@in_swarm
async def test_a_bounded_round_takes_m_packets_and_every_node_applies_it(swarm):
    """Four nodes, outer.max_contributors 2: each manifest holds two packets, every node applies
    every round from those two (the others' values go back to their error buffers), and all agree.
    A round may close before every node submitted, once the pick cannot change (protocol/selection.py,
    early close): those submitted and not picked are the rest."""
    await swarm.create_run(outer={"max_contributors": 2})
    nodes = [swarm.node(name)[0] for name in "abcd"]
    await run_all(*nodes)
    status = await swarm.status()
    agreed = {h.round: h.majority_digest for h in status.history}
    assert sorted(agreed) == [0, 1, 2]
    assert [h.num_picked for h in status.history] == [2, 2, 2]
    assert all(h.num_contributors - 2 == len(h.not_picked) for h in status.history), status.history
    for node in nodes:
        # A round that closed early, before a node loaded by the others submitted, is one it may
        # reach by a catch-up instead of applying it (seen in CI on 2 cores: reports [0, 2]);
        # every round is still either applied or caught up over, and the node ends on the last.
        caught_up = {r for c in node.catch_ups for r in range(c.from_round, c.to_round)}
        applied = [r.round for r in node.reports]
        assert len(node.catch_ups) <= 1 and sorted(set(applied) | caught_up) == [0, 1, 2], (applied, node.catch_ups)
        assert applied[-1] == 2
        assert all(r.num_packets == 2 for r in node.reports), [r.num_packets for r in node.reports]
        assert digests_by_round(node) == {r: agreed[r] for r in applied}


class HoldTraining(FaultInjector):
    """A straggler: its inner steps of `round` end only once the run's open round is `until`."""

    def __init__(self, swarm: Swarm, round: int, until: int):
        super().__init__()
        self.swarm, self.round, self.until = swarm, round, until

    async def pad_compute(self, round: int, compute_s: float) -> float:
        while round == self.round and (await self.swarm.status()).run.current_round < self.until:
            await asyncio.sleep(0.05)
        return compute_s


@in_swarm
async def test_late_submission_then_catch_up_by_replay(swarm):
    """c is still training round 1 when rounds 1 and 2 close without it (6 s deadlines): its
    round-1 packet is refused as late, it still applies round 1's manifest, finds round 2 closed,
    replays round 2 from the packets the others still serve, and trains round 3 with them."""
    await swarm.create_run(max_rounds=4, round_timeout_s=6.0)
    (a, _), (b, _), (c, c_id) = swarm.node("a"), swarm.node("b"), swarm.node("c", HoldTraining(swarm, 1, until=3))
    await run_all(a, b, c)
    status = await swarm.status()
    contributors = {h.round: h.num_contributors for h in status.history}
    assert contributors == {0: 3, 1: 2, 2: 2, 3: 3}
    late = next(r for r in c.reports if r.round == 1)
    assert late.submitted is False and late.num_packets == 2
    # Refused, it is in no manifest: never announced, so no copier finds it (Exchange.announce).
    assert (1, c_id) in swarm.network.unannounced and (0, c_id) not in swarm.network.unannounced
    assert [r.round for r in c.reports] == [0, 1, 3]  # round 2 replayed, not trained
    assert [(u.from_round, u.to_round, u.method) for u in c.catch_ups] == [(2, 3, "replay")]
    assert [r.caught_up for r in c.reports] == [False, False, True]
    agreed = {h.round: h.majority_digest for h in status.history}
    assert digests_by_round(a) == digests_by_round(b) == agreed
    assert digests_by_round(c) == {r: agreed[r] for r in (0, 1, 3)}
    assert c.session.state.params_round == 4


@in_swarm
async def test_a_node_five_rounds_behind_replays_from_the_authors_own_packets(swarm):
    """As above with c held until round 7 opens: by then the others forgot each other's packets of
    rounds 2-3 (two rounds after applying them), but each author keeps its own while the
    coordinator may still amend the round (KEPT_ROUNDS), so c replays rounds 2-6 from the authors
    instead of loading a whole snapshot."""
    await swarm.create_run(max_rounds=8, round_timeout_s=4.0)
    (a, _), (b, _), (c, _) = swarm.node("a"), swarm.node("b"), swarm.node("c", HoldTraining(swarm, 1, until=7))
    await run_all(a, b, c)
    status = await swarm.status()
    assert {h.round: h.num_contributors for h in status.history} == {0: 3, **{r: 2 for r in range(1, 7)}, 7: 3}
    assert [r.round for r in c.reports] == [0, 1, 7]
    assert [(u.from_round, u.to_round, u.method) for u in c.catch_ups] == [(2, 7, "replay")]
    agreed = {h.round: h.majority_digest for h in status.history}
    assert digests_by_round(c) == {r: agreed[r] for r in (0, 1, 7)}


class HoldUntil(FaultInjector):
    """Inner steps of `round` and later end only once `ready()` (a newcomer is on probation: the
    swarm does not wait for it, so the test holds the swarm until it has caught up)."""

    def __init__(self, round: int, ready):
        super().__init__()
        self.round, self.ready = round, ready

    async def pad_compute(self, round: int, compute_s: float) -> float:
        while round >= self.round and not self.ready():
            await asyncio.sleep(0.05)
        return compute_s


@in_swarm
async def test_late_joiner_catches_up_by_snapshot(swarm):
    """d joins after round 1 was applied: it loads the agreed parameters from a peer's snapshot
    (checked against the coordinator's digest) and trains the next rounds with the others."""
    await swarm.create_run(max_rounds=5, min_peers=2)
    d, _ = swarm.node("d")

    def d_trains_round_3() -> bool:
        """d caught up to round 3, or to round 2 and applied it: its next round is 3. (Released as
        soon as d loaded round 2, a and b had closed round 3 before d, still applying 2 on a
        loaded machine, could submit it, and d caught up a second time.)"""
        return bool(d.catch_ups) and (d.catch_ups[0].to_round >= 3 or bool(d.reports))

    a, _ = swarm.node("a", HoldUntil(3, d_trains_round_3))
    b, _ = swarm.node("b", HoldUntil(3, d_trains_round_3))
    first = asyncio.gather(a.run(), b.run())

    async def join_late():
        while len(a.reports) < 2:
            await asyncio.sleep(0.05)
        await d.run()

    await asyncio.wait_for(asyncio.gather(first, join_late()), TEST_TIMEOUT_S)
    agreed = {h.round: h.majority_digest for h in (await swarm.status()).history}
    joined_at = d.reports[0].round
    assert joined_at >= 2 and d.reports[-1].round == 4
    # A round that closes while the snapshot loads is replayed after it ("snapshot+replay"): timing.
    [catch_up] = d.catch_ups
    assert (catch_up.from_round, catch_up.to_round) == (None, joined_at)
    assert catch_up.method in ("snapshot", "snapshot+replay")
    assert digests_by_round(d) == {r: agreed[r] for r in range(joined_at, 5)}
    assert digests_by_round(a) == digests_by_round(b) == agreed


@in_swarm
async def test_overlap_lands_each_round_one_round_late(swarm):
    await swarm.create_run(outer={"overlap": True}, min_peers=2)
    a, b = swarm.node("a")[0], swarm.node("b")[0]
    await run_all(a, b)
    agreed = {h.round: h.majority_digest for h in (await swarm.status()).history}
    for node in (a, b):
        assert [r.round for r in node.reports] == [0, 1, 2]
        assert [r.applied_round for r in node.reports] == [-1, 0, 1]  # round 2 lands as the node leaves
        assert node.session.state.digest == agreed[2]
        assert digests_by_round(node) == {0: agreed[0], 1: agreed[1]}


@in_swarm
async def test_restart_resumes_from_the_checkpoint(swarm):
    """a and b stop after 2 rounds and start again with the same keys and checkpoint folders: each
    resumes from its own checkpoint (the swarm agrees with its digest), with its error feedback and
    Adam moments, and trains the open round at once; no catch-up, no round lost."""
    import torch

    await swarm.create_run(max_rounds=4, min_peers=2)
    ckpt = {name: swarm.tmp_path / f"ckpt-{name}" for name in "ab"}
    first = [swarm.node(name, checkpoint_dir=ckpt[name], max_rounds=2)[0] for name in "ab"]
    await run_all(*first)
    held = {
        name: {n: b.clone() for n, b in node.training.outer.error_buffers.items()} for name, node in zip("ab", first)
    }
    moments = {
        name: [s["exp_avg"].clone() for s in node.training.optimizer.state.values()] for name, node in zip("ab", first)
    }
    again = [swarm.node(name, checkpoint_dir=ckpt[name])[0] for name in "ab"]
    # The state as loaded, looked at when `restore` returns: a poll from another task raced the
    # first inner step of round 2, which moves the Adam moments at once.
    loaded: dict[int, tuple[dict, list]] = {}
    real_restore = resume.restore

    async def restore_and_look(s) -> bool:
        resumed = await real_restore(s)
        outer, optimizer = s.training.outer, s.training.optimizer
        loaded[id(s.training)] = (
            {n: b.clone() for n, b in outer.error_buffers.items()},
            [st["exp_avg"].clone() for st in optimizer.state.values()],
        )
        return resumed

    resume.restore = restore_and_look
    try:
        await asyncio.wait_for(asyncio.gather(*(n.run() for n in again)), TEST_TIMEOUT_S)
    finally:
        resume.restore = real_restore
    for node, name in zip(again, "ab"):
        buffers, exp_avg = loaded[id(node.training)]
        assert buffers.keys() == held[name].keys()
        assert all(torch.equal(buffers[n], b) for n, b in held[name].items())
        assert len(exp_avg) == len(moments[name]) > 0
        assert all(torch.equal(a, m) for a, m in zip(exp_avg, moments[name]))
    agreed = {h.round: h.majority_digest for h in (await swarm.status()).history}
    assert sorted(agreed) == [0, 1, 2, 3]
    for node in again:
        assert node.resumed_from == 2 and node.catch_ups == []
        assert [r.round for r in node.reports] == [2, 3]
        assert digests_by_round(node) == {2: agreed[2], 3: agreed[3]}


@in_swarm
async def test_withheld_packet_is_amended_out_and_every_round_applied(swarm):
    """c submits its round-1 digest and never serves the packet (its own node still holds it). a and b
    wait out their fetch (3 s), report it missing, and the coordinator drops it at once, both other
    contributors having reported it: manifest version 2, which a and b apply. c applied version 1
    with its own packet; before its round-2 outer step it sees version 2 and recomputes round 1
    from the round start it kept. No catch-up anywhere, every round applied, every digest agreed."""
    await swarm.create_run(max_rounds=4, exchange={"missing_grace_s": 2.0})
    (a, _), (b, _), (c, c_id) = swarm.node("a"), swarm.node("b"), swarm.node("c")
    swarm.network.withhold(1, c_id)
    await run_all(a, b, c)
    status = await swarm.status()
    agreed = {h.round: h.majority_digest for h in status.history}
    assert sorted(agreed) == [0, 1, 2, 3]
    round_1 = RoundView.model_validate((await swarm.admin.get(f"/v1/runs/{swarm.run_id}/rounds/1")).json())
    assert round_1.manifest_version == 2 and list(round_1.dropped) == [c_id]
    assert c_id not in {e.peer_id for e in round_1.manifest} and len(round_1.manifest) == 2
    closed_at = next(h.closed_at for h in status.history if h.round == 1)
    for node in (a, b):
        assert node.catch_ups == [] and [r.round for r in node.reports] == [0, 1, 2, 3]
        assert digests_by_round(node) == agreed
        applied_1 = next(r for r in node.reports if r.round == 1)
        assert applied_1.num_packets == 2
        assert applied_1.ended_at - closed_at < 2 * 3.0 + 4.0, "within about two fetch time-outs"
    assert c.catch_ups == [] and [r.round for r in c.reports] == [0, 1, 2, 3]
    assert [(x.round, x.from_version, x.to_version, x.digest) for x in c.session.state.amendments.recomputed] == [
        (1, 1, 2, agreed[1])
    ]
    # Its report of round 1 follows the recompute: the amended digest, at manifest version 2.
    assert digests_by_round(c) == agreed
    assert [(r.round, r.manifest_version) for r in c.reports] == [(0, 1), (1, 2), (2, 1), (3, 1)]


@in_swarm
async def test_a_publisher_dropped_twice_running_is_a_suspect_then_excluded(swarm):
    """c withholds its packets of rounds 1 and 2. Once round 1's is dropped, the coordinator flags
    c `withheld_packet`, and a and b fetch its round-2 packet as a suspect's (given up once no
    copy arrives, node/exchange/fetch.py) and do not ask for it again after the close. Round 2's
    dropped too while c is flagged, c is excluded from round 3 on for 4 rounds (protocol/scoring.py
    `withheld_again`): round 4 closes on a and b's packets. (c's round-3 packet may have been
    submitted, and then served and applied, before the drop: a submission taken stays.)"""
    await swarm.create_run(max_rounds=5, exchange={"missing_grace_s": 2.0})
    (a, _), (b, _), (c, c_id) = swarm.node("a"), swarm.node("b"), swarm.node("c")
    swarm.network.withhold(1, c_id)
    swarm.network.withhold(2, c_id)
    await run_all(a, b, c)
    for node in (a, b):
        suspected = node.session.exchange.suspected
        assert suspected[2] == {c_id} and not suspected.get(1), suspected
        packets = [r.num_packets for r in node.reports]
        assert packets[:3] == [3, 2, 2] and packets[3] in (2, 3) and packets[4] == 2, packets
    status = await swarm.status()
    c_view = next(p for p in status.peers if p.peer_id == c_id)
    assert c_view.excluded and c_view.excluded_until_round == 7, c_view
    round_4 = RoundView.model_validate((await swarm.admin.get(f"/v1/runs/{swarm.run_id}/rounds/4")).json())
    assert c_id not in {e.peer_id for e in round_4.submitted}
    agreed = {h.round: h.majority_digest for h in status.history}
    assert digests_by_round(a) == digests_by_round(b) == digests_by_round(c) == agreed


@in_swarm
async def test_withheld_packet_with_diloco_recomputes_the_outer_momentum(swarm):
    """As above with DiLoCo's Nesterov outer momentum: the recompute puts the momentum back too."""
    await swarm.create_run(
        max_rounds=3,
        exchange={"missing_grace_s": 2.0},
        outer={"strategy": "diloco", "momentum": 0.9, "nesterov": True, "lr": 0.7},
    )
    (a, _), (b, _), (c, c_id) = swarm.node("a"), swarm.node("b"), swarm.node("c")
    swarm.network.withhold(1, c_id)
    await run_all(a, b, c)
    agreed = {h.round: h.majority_digest for h in (await swarm.status()).history}
    assert digests_by_round(a) == digests_by_round(b) == agreed
    assert [(x.round, x.to_version, x.digest) for x in c.session.state.amendments.recomputed] == [(1, 2, agreed[1])]
    assert c.catch_ups == [] and digests_by_round(c)[2] == agreed[2]


@in_swarm
async def test_withheld_packet_with_overlap_catches_up_by_snapshot(swarm):
    """With overlap c has no round start to put back (its parameters run a round ahead): once an
    applied report tells it that round 1 was amended after it applied it, it loads the swarm's
    parameters from a snapshot, and ends on the agreed model. a and b apply the amended round."""
    await swarm.create_run(max_rounds=5, exchange={"missing_grace_s": 2.0}, outer={"overlap": True})
    (a, _), (b, _), (c, c_id) = swarm.node("a"), swarm.node("b"), swarm.node("c")
    swarm.network.withhold(1, c_id)
    await run_all(a, b, c)
    agreed = {h.round: h.majority_digest for h in (await swarm.status()).history}
    assert sorted(agreed) == [0, 1, 2, 3, 4]
    for node in (a, b):
        assert node.catch_ups == [] and digests_by_round(node) == {r: agreed[r] for r in range(4)}
        assert node.session.state.digest == agreed[4]
    assert c.session.state.amendments.recomputed == []
    assert c.catch_ups and "snapshot" in c.catch_ups[0].method
    assert c.session.state.digest == agreed[4]
