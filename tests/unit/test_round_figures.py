"""The figures of a run beside its loss: the validation loss nodes report every few rounds, the
compression against sending updates dense, tokens and packet bytes per round, in the status JSON
and /metrics; and a peer's activity, which follows what it does rather than its last report.

Coordinator tests use the in-process app with a fake clock (tests/fixtures/coordinator.py); node
tests run real `Node`s on the in-memory exchange against the app (tests/unit/test_round_loop.py).
"""

from __future__ import annotations

import asyncio
import typing

import pytest

from node.faults import FaultInjector, Phase
from protocol.model_sizes import PRESET_SIZES, dense_bytes
from tests.fixtures.coordinator import SignedPeer, create_run, error_of
from tests.unit.test_round_loop import in_swarm, run_all

pytestmark = pytest.mark.timeout(120)

INNER = {"inner.steps": 10, "inner.batch_size": 4, "inner.seq_len": 64}


def test_preset_sizes_are_the_models():
    import dataclasses

    from node.training.model import PRESETS, num_parameters
    from protocol import model_sizes
    from protocol.run_config import ModelSection

    presets = typing.get_args(ModelSection.model_fields["preset"].annotation)
    assert set(PRESET_SIZES) == set(presets)
    for preset in presets:
        config = PRESETS[preset]
        assert PRESET_SIZES[preset] == model_sizes.PresetSize(
            num_parameters(preset), config.vocab_size, config.hidden, config.tie_embeddings
        )
        for vocab_size in (2, 50_257):  # a run's own tokenizer
            resized = dataclasses.replace(config, vocab_size=vocab_size)
            assert model_sizes.num_parameters(preset, vocab_size) == num_parameters(resized), (preset, vocab_size)
    tiny = ModelSection(preset="tiny")
    assert dense_bytes(tiny, 3) == 3 * 4 * num_parameters("tiny")
    assert dense_bytes(ModelSection.model_construct(preset="huge"), 1) is None


def applied(peer: SignedPeer, run_id: str, round_index: int, digest: str, **fields):
    return peer.post(f"/v1/runs/{run_id}/rounds/{round_index}/applied", {"params_digest": digest, **fields})


def three_peers_two_rounds(client, fake_clock) -> tuple[str, list[SignedPeer]]:
    """Rounds 0 and 1 closed; round 0's applied reports carry validation losses, one off the majority."""
    run_id = create_run(client, {"membership.min_peers": 3, **INNER})
    peers = [SignedPeer(client, clock=fake_clock) for _ in range(3)]
    for peer in peers:
        assert peer.join(run_id).status_code == 200
    for round_index in range(2):
        for i, peer in enumerate(peers):
            assert peer.submit(run_id, round_index, packet_size_bytes=1000 * (i + 1)).status_code == 200
    agreed, forked = "ab" * 32, "cd" * 32
    assert applied(peers[0], run_id, 0, agreed, val_loss=3.5).status_code == 200
    assert applied(peers[1], run_id, 0, agreed, val_loss=3.7).status_code == 200
    assert applied(peers[2], run_id, 0, forked, val_loss=9.0).status_code == 200  # another model's loss
    assert peers[0].applied(run_id, 1, agreed).status_code == 200  # an older node: no val_loss at all
    return run_id, peers


def test_status_json_has_val_loss_compression_tokens_and_bytes(coordinator_client, fake_clock):
    client = coordinator_client
    run_id, peers = three_peers_two_rounds(client, fake_clock)
    history = client.get(f"/v1/runs/{run_id}/status").json()["history"]
    first, second = history[0], history[1]
    assert first["val_loss"] == pytest.approx(3.6), "the majority's reports only"
    assert second["val_loss"] is None
    dense = 3 * 4 * PRESET_SIZES["tiny"].num_parameters
    for h in (first, second):
        assert (h["tokens"], h["packet_bytes"]) == (3 * 10 * 4 * 64, 6000)
        assert h["compression_ratio"] == pytest.approx(dense / 6000)
    for bad in (-1.0, 2e9, "3.5"):
        assert error_of(applied(peers[1], run_id, 1, "ab" * 32, val_loss=bad)) == "invalid_request"


def test_metrics_expose_the_round_figures(coordinator_client, fake_clock):
    client = coordinator_client
    run_id, _ = three_peers_two_rounds(client, fake_clock)
    text = client.get("/metrics").text
    labels = f'{{run="{run_id}"}}'
    samples = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.splitlines()
        if line.endswith(tuple("0123456789.")) and labels in line
    }
    assert samples[f"locoswarm_last_round_tokens{labels}"] == 3 * 10 * 4 * 64
    assert samples[f"locoswarm_last_round_packet_bytes{labels}"] == 6000
    assert samples[f"locoswarm_last_round_compression_ratio{labels}"] == pytest.approx(
        3 * 4 * PRESET_SIZES["tiny"].num_parameters / 6000
    )
    # The last round (1) was not evaluated: the latest evaluated one is, with its round.
    assert samples[f"locoswarm_val_loss{labels}"] == pytest.approx(3.6)
    assert samples[f"locoswarm_val_loss_round{labels}"] == 0
    for name in ("locoswarm_val_loss", "locoswarm_last_round_compression_ratio", "locoswarm_last_round_tokens"):
        assert f"# TYPE {name} gauge" in text


def peer_row(client, run_id: str, peer: SignedPeer) -> dict:
    return next(p for p in client.get(f"/v1/runs/{run_id}/status").json()["peers"] if p["peer_id"] == peer.peer_id)


def test_activity_is_what_the_peer_does_now(coordinator_client, fake_clock):
    client = coordinator_client
    run_id = create_run(client, {"membership.min_peers": 2, **INNER})
    peer, other = SignedPeer(client, clock=fake_clock), SignedPeer(client, clock=fake_clock)
    peer.join(run_id), other.join(run_id)

    def beat(who, round_index, state, inner_step):
        body = {"round": round_index, "state": state, "inner_step": inner_step}
        assert who.post(f"/v1/runs/{run_id}/heartbeat", body).status_code == 200

    beat(peer, 0, "training", 10)
    peer.submit(run_id, 0)
    assert (peer_row(client, run_id, peer)["activity"], peer_row(client, run_id, peer)["inner_step"]) == (
        "submitted",
        10,
    )
    other.submit(run_id, 0)  # round 0 closes
    peer.applied(run_id, 0, "ab" * 32)
    row = peer_row(client, run_id, peer)
    # Applied, now on round 1 with none of its steps done: a step count of round 0 would read as progress in 1.
    assert (row["activity"], row["inner_step"], row["lag_rounds"]) == ("applied", None, 0)
    beat(peer, 1, "training", 0)  # the beat a node sends as its training starts
    assert peer_row(client, run_id, peer)["activity"] == "training"

    # With overlap a peer submits round r, and applies r - 1, while it already trains r + 1: its word stands.
    beat(other, 2, "training", 4)
    other.submit(run_id, 1)
    other.applied(run_id, 0, "ab" * 32)
    row = peer_row(client, run_id, other)
    assert (row["activity"], row["inner_step"]) == ("training", 4)


class WatchStatusAtTraining(FaultInjector):
    """Records what the coordinator shows of this node as its round `round` starts training."""

    def __init__(self, swarm, round: int):
        super().__init__()
        self.swarm, self.round, self.peer_id, self.seen = swarm, round, "", None

    async def at_phase(self, phase: Phase, round: int, **kwargs) -> None:
        if phase is not Phase.TRAINING or round != self.round:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5.0
        while True:
            peer = next(p for p in (await self.swarm.status()).peers if p.peer_id == self.peer_id)
            if peer.activity == "training" or loop.time() > deadline:
                self.seen = (peer.activity, peer.inner_step, peer.lag_rounds)
                return
            await asyncio.sleep(0.02)


@in_swarm
async def test_nodes_report_validation_loss_and_say_at_once_that_they_train(swarm):
    await swarm.create_run(max_rounds=3, min_peers=2)  # heartbeats every 150 s: none in this test
    watch = WatchStatusAtTraining(swarm, round=1)
    a, watch.peer_id = swarm.node("a", faults=watch, eval_every_rounds=2)
    b, _ = swarm.node("b", eval_every_rounds=2)
    await run_all(a, b)
    assert watch.seen == ("training", 0, 0), "after applying round 0 the status shows it training round 1"
    history = {h.round: h for h in (await swarm.status()).history}
    assert history[1].val_loss is None and history[0].val_loss is not None
    # Round 2's is the model both nodes hold now, on the same held-out batch.
    assert history[2].val_loss == pytest.approx(a.training.evaluate_global(), rel=1e-6)
    assert history[2].compression_ratio > 20 and history[2].tokens == 2 * 2 * 2 * 32


def test_evaluating_with_overlap_leaves_the_local_parameters_as_they_were(single_thread):
    import torch

    from node.training.data import TokenDataset, evaluate
    from node.training.model import build_model
    from node.training.params import flat_named_params
    from node.training.peer import PeerTraining
    from protocol.run_config import RunConfig

    run = RunConfig.model_validate(
        {
            "name": "eval",
            "model": {"preset": "tiny"},
            "outer": {"overlap": True},
            "inner": {"steps": 2, "batch_size": 2, "seq_len": 32, "warmup_steps": 0},
        }
    )
    tokens = torch.randint(0, 256, (20_000,), generator=torch.Generator().manual_seed(0)).numpy().astype("uint16")
    data = TokenDataset([tokens], vocab_size=256, name="random")
    training = PeerTraining.build(run, "cpu", data, val=data)
    training.outer.begin_round()
    training.train_round(0)
    local = {name: p.detach().clone() for name, p in flat_named_params(training.model).items()}
    assert any(not torch.equal(local[n], training.outer.start[n]) for n in local), "it trained ahead"
    val_loss = training.evaluate_global()
    assert all(torch.equal(local[n], p) for n, p in flat_named_params(training.model).items())
    global_model = build_model("tiny", 0)  # the global model: the run's start, nothing applied yet
    assert val_loss == pytest.approx(evaluate(global_model, data, 1, batch_size=2, seq_len=32), rel=1e-6)


def test_a_held_out_split_too_short_for_a_sequence_is_no_evaluation(single_thread):
    import numpy as np

    from node.training.data import TokenDataset
    from node.training.peer import PeerTraining
    from protocol.run_config import RunConfig

    run = RunConfig.model_validate(
        {
            "name": "eval",
            "model": {"preset": "tiny"},
            "inner": {"steps": 1, "batch_size": 2, "seq_len": 32, "warmup_steps": 0},
        }
    )
    train = TokenDataset([np.arange(5000, dtype=np.uint16) % 256], vocab_size=256, name="train")
    short = TokenDataset([np.arange(10, dtype=np.uint16)], vocab_size=256, name="val")
    training = PeerTraining.build(run, "cpu", train, val=short)
    assert training.evaluate_global() is None and training.val is None, "and it does not try again"
