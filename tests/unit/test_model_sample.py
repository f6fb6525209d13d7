"""Text samples of the model on the status page: a node sends a short greedy sample with its
validation loss (node/round/steps.py `text_sample`); the coordinator keeps it with the applied
report, shows the newest one in the status, and refuses control characters and long texts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from node.round.steps import SAMPLE_PROMPT, text_sample
from node.training.data import load_corpus
from node.training.peer import PeerTraining
from protocol.http import MAX_SAMPLE_CHARS
from protocol.run_config import RunConfig
from tests.fixtures.coordinator import SignedPeer, create_run
from tests.unit.test_round_figures import applied

pytestmark = pytest.mark.timeout(60)


def test_a_node_samples_its_global_model_greedily():
    run = RunConfig.model_validate(
        {
            "name": "sample",
            "model": {"preset": "tiny"},
            "inner": {"steps": 2, "batch_size": 2, "seq_len": 32, "warmup_steps": 2, "total_steps": 100},
        }
    )
    training = PeerTraining.build(run, "cpu", load_corpus(None).train)
    s = SimpleNamespace(run=run, training=training, config=SimpleNamespace(training=SimpleNamespace(data=None)))
    first, again = text_sample(s, 0), text_sample(s, 0)
    assert first is not None and first.startswith(SAMPLE_PROMPT) and len(first) > len(SAMPLE_PROMPT)
    assert first == again, "greedy: the same model writes the same text"
    assert len(first) <= MAX_SAMPLE_CHARS and all(
        c in "\t\n" or (" " <= c and not "\x7f" <= c <= "\x9f") for c in first
    )
    assert training.model.training, "the model is left in training mode"
    overlap = run.model_copy(update={"outer": run.outer.model_copy(update={"overlap": True})})
    assert text_sample(SimpleNamespace(run=overlap, training=training, config=s.config), 0) is None


def test_the_status_shows_the_newest_sample(coordinator_client, fake_clock):
    client = coordinator_client
    run_id = create_run(client, {"membership.min_peers": 2})
    a, b = SignedPeer(client, clock=fake_clock), SignedPeer(client, clock=fake_clock)
    for peer in (a, b):
        assert peer.join(run_id).status_code == 200
    assert client.get(f"/v1/runs/{run_id}/status").json()["sample"] is None
    for round_index, text in ((0, "def f(x):\n\treturn x"), (1, "def g(<b>y</b>): ¿ünïcode?")):
        for peer in (a, b):
            assert peer.submit(run_id, round_index).status_code == 200
        response = applied(a, run_id, round_index, "ab" * 32, val_loss=3.0, sample=text)
        assert response.status_code == 200, response.text
    assert applied(b, run_id, 1, "ab" * 32).status_code == 200  # without a sample: the newest stays
    sample = client.get(f"/v1/runs/{run_id}/status").json()["sample"]
    assert sample == {"round": 1, "peer_id": a.peer_id, "text": "def g(<b>y</b>): ¿ünïcode?"}


@pytest.mark.parametrize("hostile", ["", "x" * (MAX_SAMPLE_CHARS + 1), "bell\x07", "esc\x1b[31m", "nul\x00", "c1\x85"])
def test_hostile_samples_are_refused(coordinator_client, fake_clock, hostile):
    client = coordinator_client
    run_id = create_run(client, {"membership.min_peers": 1})
    peer = SignedPeer(client, clock=fake_clock)
    assert peer.join(run_id).status_code == 200 and peer.submit(run_id, 0).status_code == 200
    response = applied(peer, run_id, 0, "ab" * 32, sample=hostile)
    assert response.status_code == 422, hostile
    assert client.get(f"/v1/runs/{run_id}/status").json()["sample"] is None
