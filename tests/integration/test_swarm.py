"""A real swarm on 127.0.0.1: a coordinator process and 4 node processes (hivemind DHT, libp2p
streams, SQLite), 3 rounds. Every round, every peer ends with the same parameter digest; the
loss falls; every process exits on its own with status 0."""

import json

import pytest

from node.cli.demo import LocalSwarm

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


def test_four_nodes_three_rounds(tmp_path):
    rounds, peers = 3, 4
    with LocalSwarm(
        tmp_path, num_peers=peers, preset="tiny", rounds=rounds, inner_steps=10, top_k=64, quiet=True
    ) as swarm:
        summary = swarm.run(timeout_s=500)
        codes = [node.wait(timeout=60) for node in swarm.nodes]
        status = swarm.status()
    assert codes == [0] * peers
    assert summary["digests_identical"], "peers diverged"
    reports = [json.loads((tmp_path / f"node{i}.report.json").read_text()) for i in range(peers)]
    for k in range(rounds):
        per_round = [next(r for r in rep["rounds"] if r["round"] == k) for rep in reports]
        assert len({r["digest"] for r in per_round}) == 1
        assert all(r["num_packets"] == peers and not r["refused"] for r in per_round)
    # the coordinator saw the same: one majority digest per round, every peer agreeing
    history = status["history"]
    assert [h["round"] for h in history] == list(range(rounds))
    assert all(h["num_contributors"] == peers and h["num_applied"] == peers for h in history)
    assert history[-1]["majority_digest"] == reports[0]["rounds"][-1]["digest"]
    assert not any(p["flags"] for p in status["peers"])
    assert summary["loss_fell"], (summary["val_loss_start"], summary["val_loss_end"])
    train_loss = reports[0]["rounds"]
    assert train_loss[-1]["train_loss"] < train_loss[0]["train_loss"]


def test_overlapped_rounds_keep_peers_identical(tmp_path):
    """With the one-round-delayed outer step, round r's packets move while round r+1 trains; the
    global models still agree, and the last aggregate lands before the nodes leave."""
    rounds, peers = 3, 3
    with LocalSwarm(
        tmp_path,
        num_peers=peers,
        preset="tiny",
        rounds=rounds,
        inner_steps=10,
        top_k=64,
        quiet=True,
        run_overrides={"outer.overlap": True},
    ) as swarm:
        summary = swarm.run(timeout_s=500)
        codes = [node.wait(timeout=60) for node in swarm.nodes]
        status = swarm.status()
    assert codes == [0] * peers
    reports = [json.loads((tmp_path / f"node{i}.report.json").read_text())["rounds"] for i in range(peers)]
    for k in range(1, rounds):  # round k's report carries the digest after applying round k-1
        assert len({next(r for r in rep if r["round"] == k)["digest"] for rep in reports}) == 1
    assert [h["round"] for h in status["history"]] == list(range(rounds))
    assert all(h["num_applied"] == peers for h in status["history"])  # the last one too, after the drain
    assert summary["loss_fell"]
