"""Catch-up waits instead of spinning when the round after the snapshot it loaded cannot be replayed.

A real `Session` with `tiny` training and the in-memory exchange; the coordinator's answers are
scripted (the state under test, a closed round whose packets nobody holds and whose successor has
no agreed digest yet, takes a whole swarm to reach otherwise). The node loads the newest agreed
snapshot once, finds the next round's packets gone, and then polls at growing intervals: it must
not load the same snapshot again (before the fix: about ten loads a second). Once a newer agreed
snapshot appears it loads that one and is caught up.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from node.round import catchup, resume
from node.round.catchup import IDLE_MAX_S, RunEnded, catch_up
from node.round.session import Session
from node.round.state import RoundState
from node.training.data import load_corpus
from node.training.params import flat_named_params, param_digest
from node.training.peer import PeerTraining
from node.training.snapshot import Snapshot
from protocol.http import ManifestEntry, RoundView
from protocol.run_config import RunConfig
from tests.doubles.memory_exchange import MemorySwarm
from tests.doubles.session import node_session

pytestmark = pytest.mark.timeout(60)

RUN_ID = "run-backoff"
GONE_PEER = "p" + "c" * 16
NODE_PEER = "p" + "a" * 16
STUCK_S = 3.0  # how long the node sits with nothing to do before the swarm moves on


class ScriptedCoordinator:
    """Status and round views as a coordinator would answer them; counts status polls."""

    def __init__(self, current: int, agreed: dict[int, str]):
        self.current, self.agreed = current, agreed  # agreed: round start -> digest
        self.state = "running"  # the run's: running, finished or closed
        self.peers: list[SimpleNamespace] = []  # peer_id, status
        self.num_status = 0
        self.missing_reports: list[tuple[int, list[str], bool]] = []
        self.rounds_read: list[int] = []  # the round views asked for: a replay's first step

    async def status(self, *_, **__):
        self.num_status += 1
        history = [
            SimpleNamespace(round=r, num_contributors=1, agreed_digest=self.agreed.get(r + 1))
            for r in range(self.current)
        ]
        running = self.state == "running"
        return SimpleNamespace(
            current_round=SimpleNamespace(round=self.current) if running else None,
            run=SimpleNamespace(current_round=self.current, state=self.state),
            history=history,
            peers=list(self.peers),
            snapshot_mirror=None,
        )

    async def missing(self, round: int, peer_ids: list[str], lost_own: bool = False):
        # Recorded, and not amended (the state under test: nothing the node does unsticks the round).
        self.missing_reports.append((round, peer_ids, lost_own))
        return SimpleNamespace(manifest_version=1, dropped={}, pending=peer_ids)

    async def round(self, round: int, **_) -> RoundView:
        self.rounds_read.append(round)
        # Closed, with one packet that nobody announces (its publisher left, the others forgot it).
        entry = ManifestEntry(peer_id=GONE_PEER, packet_digest="0" * 64, packet_size_bytes=100, multiaddrs=[])
        return RoundView(
            run_id=RUN_ID,
            round=round,
            state="closed",
            opened_at=0.0,
            deadline=1.0,
            closed_at=1.0,
            num_submitted=1,
            majority_digest=None,
            manifest=[entry],
        )


def _tiny_run(name: str) -> RunConfig:
    return RunConfig.model_validate(
        {
            "name": name,
            "model": {"preset": "tiny"},
            "inner": {"steps": 2, "batch_size": 2, "seq_len": 32, "warmup_steps": 2, "total_steps": 100},
        }
    )


def _training(run: RunConfig) -> PeerTraining:
    return PeerTraining.build(run, "cpu", load_corpus(None).train)


def _publish(holder, training: PeerTraining, round: int, shift: float) -> str:
    """Serve the holder's parameters moved by `shift` as the snapshot that starts `round`; its digest."""
    with torch.no_grad():
        for p in training.model.parameters():
            p.add_(shift)
    params = dict(flat_named_params(training.model))
    asyncio.get_running_loop().create_task(
        holder.publish_params(round, Snapshot.from_tensors(params, training.outer.snapshot_state()))
    )
    return param_digest(params)


def _session(
    tmp_path: Path, run: RunConfig, coordinator: ScriptedCoordinator, exchange, params_round=None, checkpoint_dir=None
) -> Session:
    return node_session(
        tmp_path,
        run,
        client=coordinator,
        exchange=exchange,
        training=_training(run),
        run_id=RUN_ID,
        peer_id=NODE_PEER,
        network={"fetch_timeout_s": 3.0},
        checkpoints={"checkpoint_dir": checkpoint_dir},
        state=RoundState(params_round=params_round),
    )


def test_catch_up_loads_a_snapshot_once_and_waits_while_the_next_round_cannot_be_replayed(tmp_path: Path):
    async def main():
        run = _tiny_run("backoff")
        network = MemorySwarm()
        holder, exchange = network.exchange("holder"), network.exchange("node")
        source = _training(run)
        start_2 = _publish(holder, source, 2, 0.01)
        coordinator = ScriptedCoordinator(current=3, agreed={2: start_2})
        s = _session(tmp_path, run, coordinator, exchange)
        await asyncio.sleep(0)  # the holder's snapshot is published

        catching_up = asyncio.create_task(catch_up(s))
        await asyncio.sleep(STUCK_S)
        assert not catching_up.done()
        loads_while_stuck, polls_while_stuck = exchange.traffic(2).num_fetched, coordinator.num_status
        assert s.state.params_round == 2 and s.state.digest == start_2
        assert loads_while_stuck == 1, f"the snapshot of round 2 was loaded {loads_while_stuck} times in {STUCK_S} s"
        # Polls at 1, 2, 4 s intervals: the first pass, then about log2(STUCK_S) more.
        assert polls_while_stuck <= 4, f"{polls_while_stuck} status polls in {STUCK_S} s"
        # It is not silent: the gone author's entry was reported missing once, and its heartbeats say why it waits.
        assert coordinator.missing_reports == [(2, [GONE_PEER], False)]
        assert s.state.activity.state == "stuck" and s.state.activity.detail.startswith(
            f"round 2: waiting for the packets of {GONE_PEER} (gone; reported missing"
        )

        # The swarm moves on: round 2's successor is agreed and a peer serves the start of round 3.
        start_3 = _publish(holder, source, 3, 0.02)
        await asyncio.sleep(0)
        moved_at = time.monotonic()
        coordinator.current, coordinator.agreed = 3, {2: start_2, 3: start_3}
        report = await asyncio.wait_for(catching_up, IDLE_MAX_S + 10.0)
        assert time.monotonic() - moved_at < IDLE_MAX_S + 5.0
        assert (report.to_round, report.method) == (3, "snapshot")
        assert s.state.activity.detail is None
        params = flat_named_params(s.training.model)
        assert s.state.params_round == 3 and s.state.digest == start_3 == param_digest(params)
        assert exchange.traffic(2).num_fetched == 1 and exchange.traffic(3).num_fetched == 1
        for task in list(s.background):
            await task

    asyncio.run(main())


def test_a_node_behind_a_finished_run_stops_once_no_peer_is_left_to_serve_it(tmp_path: Path):
    """The run finished at round 6 while the node's parameters are at round 2, and round 2's packets
    are gone: while another peer is live and not behind itself (it may still serve a snapshot) the
    node waits; once that peer left, it stops with `RunEnded` naming both rounds instead of polling
    for ever, although a peer that is loading a snapshot too is still live."""

    async def main():
        run = _tiny_run("ended")
        coordinator = ScriptedCoordinator(current=6, agreed={})
        coordinator.state = "finished"
        lingering = SimpleNamespace(peer_id="p" + "b" * 16, status="live", activity="serving")
        behind_too = SimpleNamespace(peer_id="p" + "d" * 16, status="live", activity="loading_snapshot")
        coordinator.peers = [
            SimpleNamespace(peer_id=NODE_PEER, status="live", activity="catching_up"),
            lingering,
            behind_too,
        ]
        s = _session(tmp_path, run, coordinator, MemorySwarm().exchange("node"), params_round=2)

        catching_up = asyncio.create_task(catch_up(s))
        await asyncio.sleep(STUCK_S)
        assert not catching_up.done(), "stopped while a live peer might still serve a snapshot"
        assert coordinator.missing_reports == [(2, [GONE_PEER], False)]

        lingering.status = "left"
        left_at = time.monotonic()
        with pytest.raises(
            RunEnded, match="the run is finished at round 6 while this node's parameters are at round 2"
        ):
            await asyncio.wait_for(catching_up, IDLE_MAX_S + 10.0)
        assert time.monotonic() - left_at < IDLE_MAX_S + 2.0
        assert s.state.params_round == 2

    asyncio.run(main())


def test_a_node_behind_a_finished_run_nobody_serves_stops_before_it_tries_anything(tmp_path: Path):
    """A node paused while the others finished the run and left: with no peer left and no packet
    mirror, every replay or snapshot it tried would wait out its fetch time-out on peers that are
    gone (a chaos run: 8 minutes). It stops at its first look at the run, having fetched nothing."""

    async def main():
        run = _tiny_run("ended-at-once")
        coordinator = ScriptedCoordinator(current=6, agreed={3: "ab" * 16})
        coordinator.state = "finished"
        coordinator.peers = [
            SimpleNamespace(peer_id=NODE_PEER, status="live", activity="catching_up"),
            SimpleNamespace(peer_id="p" + "b" * 16, status="left", activity="left"),
        ]
        s = _session(tmp_path, run, coordinator, MemorySwarm().exchange("node"), params_round=2)
        with pytest.raises(RunEnded, match="finished at round 6 while this node's parameters are at round 2"):
            await asyncio.wait_for(catch_up(s), 10.0)
        assert coordinator.num_status == 1 and coordinator.rounds_read == [] and coordinator.missing_reports == []

    asyncio.run(main())


class WithheldRound(ScriptedCoordinator):
    """Closed rounds whose one packet is announced and served by nobody: a replay's fetch of it
    waits out the fetch time-out."""

    def __init__(self, current: int, entry: ManifestEntry):
        super().__init__(current, agreed={})
        self.entry = entry

    async def round(self, round: int, **_) -> RoundView:
        view = await super().round(round)
        return view.model_copy(update={"manifest": [self.entry]})


def test_a_replay_under_way_when_the_last_peer_leaves_stops_within_a_look(tmp_path: Path, monkeypatch):
    """A pass that began while the run still ran used to run its tries to the end, each a fetch
    time-out on a peer that was gone: two nodes left a chaos run 3 and 4 minutes after the others.
    The run's end is now looked for every ENDED_CHECK_S while a replay or a snapshot load runs."""
    monkeypatch.setattr(catchup, "ENDED_CHECK_S", 0.2)

    async def main():
        run = _tiny_run("ended-midway")
        swarm = MemorySwarm()
        published = await swarm.exchange("publisher").publish(2, GONE_PEER, b"a packet nobody serves")
        swarm.withhold(2, GONE_PEER)
        entry = ManifestEntry(
            peer_id=GONE_PEER, packet_digest=published.digest, packet_size_bytes=published.size_bytes, multiaddrs=[]
        )
        coordinator = WithheldRound(current=3, entry=entry)
        coordinator.peers = [
            SimpleNamespace(peer_id=NODE_PEER, status="live", activity="catching_up"),
            SimpleNamespace(peer_id=GONE_PEER, status="live", activity="submitted"),
        ]
        s = node_session(
            tmp_path,
            run,
            client=coordinator,
            exchange=swarm.exchange("node"),
            training=_training(run),
            run_id=RUN_ID,
            peer_id=NODE_PEER,
            network={"fetch_timeout_s": 120.0},
            state=RoundState(params_round=2),
        )
        catching_up = asyncio.create_task(catch_up(s))
        await asyncio.sleep(1.0)
        assert coordinator.rounds_read == [2] and not catching_up.done(), "the replay's fetch waits"
        coordinator.state = "finished"
        coordinator.peers[1] = SimpleNamespace(peer_id=GONE_PEER, status="left", activity="left")
        started = time.monotonic()
        with pytest.raises(RunEnded, match="finished at round 3 while this node's parameters are at round 2"):
            await asyncio.wait_for(catching_up, 30.0)
        assert time.monotonic() - started < 5.0, "not the fetch time-out"
        assert coordinator.missing_reports == []

    asyncio.run(main())


def test_a_checkpoint_the_swarm_agrees_on_after_the_start_is_loaded_by_the_catch_up(tmp_path: Path):
    """A whole swarm restarted while its last closed round, a lone contributor's, had no agreed
    digest yet (it is agreed when the next round closes): every node set its checkpoint aside at
    start and caught up, and nobody served the state they all held on disk, for ever (a chaos run,
    seed 9). Once the swarm agrees on the checkpoint's digest, the catch-up loads it from disk."""

    async def main():
        run = _tiny_run("agreed-since")
        coordinator = ScriptedCoordinator(current=3, agreed={})
        exchange = MemorySwarm().exchange("node")
        s = _session(tmp_path, run, coordinator, exchange, checkpoint_dir=tmp_path / "ckpt")
        with torch.no_grad():
            for p in s.training.model.parameters():
                p.add_(0.01)
        s.outer.reset_to_params()
        resume.save(s, applied_round=2)  # the start of round 3, as the node wrote it before the restart
        round, digest = resume.held_state(s.config, RUN_ID)
        assert round == 3 and digest == param_digest(flat_named_params(s.training.model))
        with torch.no_grad():
            for p in s.training.model.parameters():
                p.zero_()  # what a restarted node builds: not the checkpoint's parameters

        assert not await resume.restore(s), "not agreed yet: set aside"
        s.state.params_unknown()
        catching_up = asyncio.create_task(catch_up(s))
        await asyncio.sleep(STUCK_S)
        assert not catching_up.done() and s.state.params_round is None

        coordinator.agreed = {3: digest}  # round 3's close settled round 2's lone vote
        report = await asyncio.wait_for(catching_up, IDLE_MAX_S + 10.0)
        assert report.to_round == 3
        assert s.state.params_round == 3 and s.state.digest == digest
        assert param_digest(flat_named_params(s.training.model)) == digest
        assert exchange.traffic(3).num_fetched == 0, "loaded from its own disk, not fetched"
        for task in list(s.background):
            await task

    asyncio.run(main())
